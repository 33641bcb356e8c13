"""ModelRunner: owns the model weights, the KV pools and the device; runs one forward per batch.

The runner contract the scheduler relies on (`TPModelRunner` in tp_runner.py keeps it too):
- `device`: where the scheduler's tables, slot ids and logits live; `kv_pool`, `req_pool`, `context_length`;
- `forward(spec)` runs a BatchSpec (writing its K/V) and returns its hidden states, opaque to the caller except
  for passing them to `logits(hidden, rows)`: (len(rows), vocab) float32 for those rows (all when None);
- `attention_backend`: the name of the attention backend the model runs with;
- `graphs`, `extend_graphs`: the decode and small-extend CUDA graphs (engine/cuda_graph.py) when they run, else
  None; `forward` sets spec.graphed when it replayed one; `replays_graph(spec)` says beforehand whether it will
  (the scheduler then skips the cascade's bookkeeping, which a replay does not read);
- `supports_overlap` (optional, default False): `forward` accepts a decode spec whose ids are on the device
  (`spec.input_ids_device`), so the scheduler may overlap steps;
- `encode(item)`: encoder features of an image or video (multimodal models);
- `failure()`: the error that makes the runner unusable (a dead worker), else None; `shutdown()`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from sgnb.engine.attention import make_attention_backend
from sgnb.engine.config import EngineConfig, cpu_threads
from sgnb.engine.cuda_graph import DEFAULT_MAX_BS, DecodeGraphs, ExtendGraphs
from sgnb.engine.forward_batch import BatchSpec, ForwardBatch
from sgnb.engine.kv_pool import KVCache, KVPool, ReqToTokenPool
from sgnb.engine.model_config import ModelConfig
from sgnb.engine.model_loader import ModelSource
from sgnb.engine.models.registry import build_model, resolve_quantization

log = logging.getLogger("sgnb.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_KV_BUDGET_BYTES = 2 << 30  # default KV pool on CPU: 2 GiB
CPU_MAX_KV_TOKENS = 1 << 16
MIN_GPU_KV_TOKENS = 256  # a GPU pool smaller than this is a machine out of memory, not a configuration


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {name!r}")
    return _DTYPES[name]


def kv_pool_slots(config: EngineConfig, mcfg: ModelConfig, kv_dtype: torch.dtype, device: torch.device,
                  num_kv_heads: int, context_length: int) -> int:
    """How many KV slots to allocate: max_total_tokens, else what fits in mem_fraction_static of the GPU for
    `num_kv_heads` heads (a tensor-parallel rank's share), else the CPU default (always for the whole model,
    so the pool is the same size at every tp size)."""
    if config.max_total_tokens is not None:
        return config.max_total_tokens
    if device.type == "cuda":
        per_token = 2 * mcfg.num_hidden_layers * num_kv_heads * mcfg.head_dim * kv_dtype.itemsize
        free, total = torch.cuda.mem_get_info(device)
        budget = free - total * (1.0 - config.mem_fraction_static)
        slots = int(budget // per_token)
        if slots < MIN_GPU_KV_TOKENS:
            raise MemoryError(
                f"no room for the KV cache on {device}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free after the "
                f"weights, {(1.0 - config.mem_fraction_static) * total / 2**30:.1f} GiB kept back by "
                f"mem_fraction_static={config.mem_fraction_static}, so {max(slots, 0)} tokens of KV fit. Free the "
                "GPU (another engine in this process or another process holds it), raise mem_fraction_static, "
                "or set max_total_tokens")
        return slots
    per_token = 2 * mcfg.num_hidden_layers * mcfg.num_key_value_heads * mcfg.head_dim * kv_dtype.itemsize
    return max(min(CPU_KV_BUDGET_BYTES // per_token, CPU_MAX_KV_TOKENS), min(context_length, CPU_MAX_KV_TOKENS))


class Runner(Protocol):
    """What the scheduler and the engine use of a runner (see the module docstring for the contract)."""

    config: EngineConfig
    source: ModelSource
    model_config: ModelConfig
    device: torch.device
    placement: str
    attention_backend: str
    graphs: DecodeGraphs | None
    extend_graphs: ExtendGraphs | None
    quantization: str
    context_length: int
    kv_pool: KVPool
    req_pool: ReqToTokenPool

    def replays_graph(self, spec: BatchSpec) -> bool: ...

    def forward(self, spec: BatchSpec) -> Any: ...

    def logits(self, hidden: Any, rows: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor: ...

    def encode(self, item: Any) -> torch.Tensor: ...

    def failure(self) -> BaseException | None: ...

    def shutdown(self) -> None: ...


def describe_quantization(mode: str, model: Any) -> str:
    """What the weights are, for logs and stats: "none", or e.g. "auto: int4 x210, bf16 x1"."""
    counts = getattr(model, "quantized_layers", None)
    if not counts:
        return mode
    return f"{mode}: " + ", ".join(f"{m} x{n}" for m, n in sorted(counts.items()))


def make_runner(config: EngineConfig, source: ModelSource) -> Runner:
    """The in-process runner, or tensor-parallel worker processes when tp_size > 1 or tp_workers is set."""
    if config.tp_size > 1 or config.tp_workers:
        from sgnb.engine.tp_runner import TPModelRunner

        return TPModelRunner(config, source)
    return ModelRunner(config, source)


class ModelRunner:
    """The model in this process (tp_size 1): the scheduler's tables and the KV storage on one device."""

    supports_overlap = True  # forward takes spec.input_ids_device (overlap scheduling)

    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.config = config
        self.source = source
        self.device = resolve_device(config.device)
        self.placement = str(self.device)  # for logs and stats
        self.dtype = resolve_dtype(config.dtype, self.device)
        kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else resolve_dtype(config.kv_cache_dtype, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(cpu_threads(config.num_threads))
        mcfg = source.config
        self.model_config = mcfg
        self.context_length = config.context_length or mcfg.max_position_embeddings

        quantization = resolve_quantization(config.quantization, self.device)
        # one of the registry's classes (LlamaForCausalLM and its subclasses, LLaVA's): no common base but nn.Module,
        # which declares neither compute_logits nor the multimodal ones' encode
        self.model: Any = build_model(mcfg, source, self.device, self.dtype, self.context_length,
                                      seed=config.random_seed, quantization=quantization)
        self.quantization = describe_quantization(quantization, self.model)

        slots = kv_pool_slots(config, mcfg, kv_dtype, self.device, mcfg.num_key_value_heads, self.context_length)
        self.kv_cache = KVCache(slots, mcfg.num_hidden_layers, mcfg.num_key_value_heads, mcfg.head_dim, kv_dtype,
                                self.device)
        self.kv_pool = KVPool(slots, self.kv_cache)
        self.req_pool = ReqToTokenPool(config.max_running_requests + 8, self.context_length + 1, self.device)
        self.attn = make_attention_backend(config.attention_backend, self.kv_cache, mcfg.num_attention_heads,
                                           mcfg.num_key_value_heads, mcfg.head_dim, self.device)
        self.attention_backend = self.attn.name
        self.graphs: DecodeGraphs | None = None
        self.extend_graphs: ExtendGraphs | None = None
        reserved = 0
        if self.device.type == "cuda":
            # the baseline without the cached blocks of loading's temporaries: capture empties the cache, so
            # measured against a full one the graphs' memory would come out negative
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            reserved = torch.cuda.memory_reserved(self.device)
        if self.device.type == "cuda" and not config.disable_cuda_graph:
            if self.attn.supports_cuda_graph:
                max_bs = min(config.cuda_graph_max_bs or DEFAULT_MAX_BS, config.max_running_requests)
                pad_row = self.req_pool.alloc()  # never a request's: the graphs' padding rows read it
                assert pad_row is not None
                self.graphs = DecodeGraphs(self.model, self.attn, self.req_pool.req_to_token, pad_row,
                                           self.kv_cache.scratch_slot, max_bs, self.kv_pool.size, self.device)
                if config.cuda_graph_max_extend_tokens and self.attn.supports_extend_graph:
                    self.extend_graphs = ExtendGraphs(
                        self.model, self.attn, self.req_pool.req_to_token, pad_row, self.kv_cache.scratch_slot,
                        config.cuda_graph_max_extend_tokens, config.max_running_requests, mcfg.head_dim, self.device)
            else:
                log.info("decode runs without CUDA graphs: the %s attention backend has no graph hooks",
                         self.attention_backend)
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        kv_bytes = self.kv_cache.bytes_per_token() * (slots + 2)
        graph_bytes = max(torch.cuda.memory_reserved(self.device) - reserved, 0) if self.device.type == "cuda" else 0
        self.memory = {"weights_bytes": weights, "kv_cache_bytes": kv_bytes, "cuda_graph_bytes": graph_bytes}
        log.info("model %s on %s/%s (weights: %s, %.2f GiB), KV pool %d tokens (%.2f GiB), CUDA graphs %.2f GiB, "
                 "attention %s", source.name, self.device, self.dtype, self.quantization, weights / 2**30,
                 self.kv_pool.size, kv_bytes / 2**30, graph_bytes / 2**30, self.attention_backend)

    def replays_graph(self, spec: BatchSpec) -> bool:
        """Whether forward(spec) will replay a CUDA graph (which reads each request's whole key range: the
        batch's shared prefix and groups are not used, so the scheduler need not work them out)."""
        return ((self.graphs is not None and self.graphs.can_run(spec))
                or (self.extend_graphs is not None and self.extend_graphs.can_run(spec)))

    def forward(self, spec: BatchSpec) -> torch.Tensor:
        """Hidden states (T, hidden) of the batch's new tokens; writes their K/V into the pool."""
        self.req_pool.sync_device()  # the scheduler's table writes since the last forward, ahead of it on the stream
        if self.graphs is not None and self.graphs.can_run(spec):
            spec.graphed = True
            return self.graphs.replay(spec)
        if self.extend_graphs is not None and self.extend_graphs.can_run(spec):
            spec.graphed = True
            return self.extend_graphs.replay(spec)
        fb = ForwardBatch.build(spec, self.req_pool.req_to_token, self.device)
        fb.attn_backend = self.attn
        self.attn.init_forward_metadata(fb)
        return self.model(fb)

    def encode(self, item: Any) -> torch.Tensor:
        """Encoder features (item.num_tokens, hidden) of one image or video (multimodal models only)."""
        return self.model.encode(item)

    def logits(self, hidden: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
        """(len(rows), vocab) float32 logits of those rows of `hidden` (every row when rows is None)."""
        out = self.model.compute_logits(hidden if rows is None else hidden[rows])
        assert out is not None
        return out

    def failure(self) -> BaseException | None:
        return None  # nothing outside this process can fail

    def shutdown(self) -> None:
        pass
