"""Engine: the in-process runtime, compatible with SGLang's offline `sgl.Engine`.

    engine = Engine(model_path="smollm2")
    out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
    out["text"], out["meta_info"]["cached_tokens"]

All public methods are thread-safe; requests run on a background scheduler thread, so calls never touch an
asyncio loop (Jupyter's is already running). `async_generate` / `async_score` are awaitable variants.
Bad input raises (TypeError / ValueError) in the calling thread before any model work. A request that fails
inside the engine comes back with finish_reason {"type": "abort", "message": ...}; the engine stays usable.

Engine is the API; its parts live beside it: request_media (a request's images and videos), grammar_wait (its
grammars compiled before it is submitted), request_output (its results, streams and waits), score_requests
(select's requests), tree_introspection (the radix tree for views), stats (get_stats), profiling.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import importlib.util
import json
import logging
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from sgnb.engine import request_output, score_requests, server_args, tree_introspection
from sgnb.engine.config import EngineConfig
from sgnb.engine.events import Event, EventBus
from sgnb.engine.grammar_wait import compiled, compiled_sync, constrained
from sgnb.engine.media import is_pad
from sgnb.engine.model_loader import generation_defaults, load_tokenizer, resolve_model
from sgnb.engine.model_runner import Runner, make_runner
from sgnb.engine.profiling import Profiler
from sgnb.engine.radix_cache import RadixCache
from sgnb.engine.request import Req
from sgnb.engine.request_input import GenerateInput, new_rid, sample_rids, sample_seed
from sgnb.engine.request_media import RequestMedia, check_media_tokens
from sgnb.engine.sampling_params import SamplingParams, check_constraint_size, is_strict_int
from sgnb.engine.scheduler import Scheduler
from sgnb.engine.stats import engine_stats
from sgnb.engine.tokenizer import TextOffsets

CUDA_PREFILL_CHUNK = 8192  # EngineConfig.chunked_prefill_size's default on CUDA
# the GIL switch interval while a CUDA engine runs (see EngineConfig.gil_switch_interval)
CUDA_SWITCH_INTERVAL = 0.0005
GC_YOUNG_THRESHOLD = 50_000  # the collector's generation-0 threshold while an engine runs (EngineConfig.gc_threshold)
log = logging.getLogger("sgnb.engine")
OFF_LOOP_PROMPT_CHARS = 32_768  # async_generate tokenizes longer prompts in a worker thread

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None
SamplingLike = dict[str, Any] | SamplingParams  # a request's sampling values: SGLang's dict, or validated


class EngineError(RuntimeError):
    """The engine can no longer serve (its scheduler thread died)."""


def _template_file(spec: str) -> str:
    """The Jinja text of a chat template given as a file (SGLang's `chat_template=` path; a .json file holds
    {"chat_template": ...}). ValueError naming the value otherwise."""
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"chat_template={spec!r}: no such file; give a Jinja template file (.jinja) or a JSON "
                         'file with "chat_template"')
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        template = json.loads(text).get("chat_template")
        if not isinstance(template, str):
            raise ValueError(f"chat_template={spec!r}: the JSON file has no \"chat_template\" string")
        return template
    return text


class _Phases:
    """`with phases(key, label):` times one phase of the engine's start into `durations[key]` and tells
    `progress(label, None)` when it begins, `progress(label, seconds)` when it ends."""

    def __init__(self, durations: dict[str, float], progress: Callable[[str, float | None], None] | None) -> None:
        self.durations = durations
        self.progress = progress

    @contextlib.contextmanager
    def __call__(self, key: str, label: str) -> Iterator[None]:
        if self.progress is not None:
            self.progress(label, None)
        t0 = time.perf_counter()
        yield
        self.durations[key] = time.perf_counter() - t0
        if self.progress is not None:
            self.progress(label, self.durations[key])


class Engine:
    def __init__(self, model_path: str = "smollm2", *, progress: Callable[[str, float | None], None] | None = None,
                 **kwargs: Any) -> None:
        """`kwargs` are EngineConfig's options, which take SGLang's server argument names (mem_fraction_static,
        context_length, tp_size, ...); also SGLang's `log_level` (the sgnb loggers' level), `chat_template` (a
        Jinja file for the tokenizer's template), `served_model_name` (`model_name`) and `reasoning_parser` (the
        reasoning format of the model's replies: an SGLang parser name, sgnb/reasoning.py; what
        `separate_reasoning` and `sgnb serve`'s chat completions split by default). Other SGLang server
        arguments are accepted with one warning naming them; anything else is refused as unknown.

        `progress(label, seconds)` hears of each phase of the start (finding the model, the tokenizer, the
        weights and KV cache, warming the kernels): seconds None when it begins, its duration when it ends.
        The durations stay in `load_phases` ({"model", "tokenizer", "weights", "warmup", and "decode_graphs" /
        "extend_graphs" for the CUDA graphs' share of "weights": seconds})."""
        log_level = kwargs.pop("log_level", None)
        chat_template = kwargs.pop("chat_template", None)
        # variables every chat-template render gets (e.g. {"enable_thinking": False} for Qwen3); SGLang's name too
        template_kwargs = kwargs.pop("chat_template_kwargs", None) or kwargs.pop("default_chat_template_kwargs", None)
        if isinstance(template_kwargs, str):  # SGLang's command line passes JSON
            template_kwargs = json.loads(template_kwargs)
        self.chat_template_kwargs: dict[str, Any] = dict(template_kwargs or {})
        self.served_model_name: str | None = kwargs.pop("served_model_name", None)
        self.reasoning_parser: str | None = kwargs.pop("reasoning_parser", None)
        if self.reasoning_parser is not None:
            from sgnb.reasoning import reasoning_format

            reasoning_format(self.reasoning_parser)  # an unknown name fails here
        kwargs, ignored = server_args.split(kwargs, EngineConfig)
        self.config = EngineConfig.from_kwargs(model_path=model_path, **kwargs)
        server_args.warn_ignored(ignored, "Engine(...)")
        if log_level is not None:
            logging.getLogger("sgnb").setLevel(str(log_level).upper())
        t0 = time.perf_counter()
        self.load_phases: dict[str, float] = {}
        phase = _Phases(self.load_phases, progress)
        with phase("model", "finding the model (a GGUF is converted once, then cached)"):
            self.source = resolve_model(self.config.model_path, self.config.cache_dir, self.config.revision)
            # generation_config.json's temperature / top_p / ...: what a request that gives none samples with
            self.sampling_defaults: dict[str, Any] = generation_defaults(self.source)
        with phase("tokenizer", "loading the tokenizer"):
            self.tokenizer = load_tokenizer(self.source, self.config.cache_dir, self.config.tokenizer_path)
            if chat_template is not None:
                self.tokenizer.chat_template = _template_file(chat_template)
        self.vision = getattr(self.source.config, "vision", None)  # None for text-only models
        if self.vision is not None:
            if self.config.tp_size > 1 or self.config.tp_workers:
                raise ValueError(f"{self.source.name} takes images: multimodal models run at tp_size 1 only")
            check_media_tokens(self.source, self.tokenizer)
        with phase("weights", "loading the weights, allocating the KV cache (and capturing CUDA graphs on a GPU)"):
            self.runner: Runner = make_runner(self.config, self.source)  # tp_size > 1: worker processes
        for graphs, what in ((getattr(self.runner, "graphs", None), "decode"),
                             (getattr(self.runner, "extend_graphs", None), "extend")):
            if graphs is not None:  # part of the phase above, said apart
                self.load_phases[f"{what}_graphs"] = graphs.capture_seconds
        # a prompt holds at most this many tokens less one: the context, or the KV pool when it is smaller
        self._prompt_limit = min(self.context_length, self.runner.kv_pool.size)
        self._media = RequestMedia(self.source, self.config.max_image_pixels, self.config.max_video_frames,
                                   self._prompt_limit)
        self._profiler = Profiler(self.runner.device.type == "cuda")
        if self.config.chunked_prefill_size is None:  # the device's default (see EngineConfig)
            self.config = dataclasses.replace(
                self.config, chunked_prefill_size=CUDA_PREFILL_CHUNK if self.runner.device.type == "cuda" else 2048)
        try:
            self.events = EventBus(self.config.event_history)
            self.tree = RadixCache(self.runner.kv_pool.free, self.config.disable_radix_cache,
                                   emit=self.events.emit)
            eos = tuple(self.tokenizer.eos_token_ids) or tuple(self.source.config.eos_token_ids)
            self._grammar_backend: Any = None
            self._grammar_lock = threading.Lock()
            self.scheduler = Scheduler(self.config, self.runner, self.tree, self.events, eos, self.tokenizer,
                                       self.grammar_backend)
            self.scheduler.start()
        except BaseException:
            self.runner.shutdown()
            raise
        # stop the thread (and any workers) at exit or when the engine is collected (a daemon thread dying
        # inside torch aborts)
        self._finalizer = weakref.finalize(self, _stop, self.scheduler, self.runner, self._interpreter_settings())
        self._closed = False
        self.warmup_seconds = 0.0
        if self.config.warmup or (self.config.warmup is None and self.runner.device.type == "cuda"):
            from sgnb.engine.warmup import warm_up

            try:
                with phase("warmup", "warming up the kernels (compiling them on a fresh machine)"):
                    self.warmup_seconds = warm_up(self)
            except BaseException:
                self.shutdown()
                raise
            # and the structured-output compiler, off the start's path: xgrammar's tokenizer tables take about a
            # second that the first regex or JSON request would otherwise wait for; a request arriving meanwhile
            # waits on the same lock
            if importlib.util.find_spec("xgrammar") is not None:
                threading.Thread(target=self._prebuild_grammar, name="sgnb-grammar-prebuild", daemon=True).start()
        self.load_seconds = time.perf_counter() - t0

    def _interpreter_settings(self) -> _Restore:
        """Set the process-wide settings the engine runs best under (the GIL switch interval, the collector's
        young threshold: EngineConfig); returns what puts back the ones it changed."""
        restore = _Restore()
        switch = self.config.gil_switch_interval or (CUDA_SWITCH_INTERVAL if self.runner.device.type == "cuda" else None)
        if switch is not None and switch != sys.getswitchinterval():
            restore.switch = (sys.getswitchinterval(), switch)
            sys.setswitchinterval(switch)
        young = GC_YOUNG_THRESHOLD if self.config.gc_threshold is None else self.config.gc_threshold
        was = gc.get_threshold()
        if young > was[0]:
            restore.gc = (was, (young, *was[1:]))
            gc.set_threshold(*restore.gc[1])
        return restore

    def _prebuild_grammar(self) -> None:
        try:
            self.grammar_backend()
        except Exception as e:  # its first real use raises this again, to the request that needs it
            log.debug("building the grammar backend ahead of use failed: %r", e)

    # ---- properties --------------------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        """False once shut down, or if the scheduler thread or a tensor-parallel worker died."""
        return (not self._closed and self.scheduler.fatal is None and self.scheduler.thread.is_alive()
                and self.runner.failure() is None)

    @property
    def context_length(self) -> int:
        return self.runner.context_length

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.source.name

    def grammar_backend(self) -> Any:
        """The structured-output compiler (xgrammar), made on first use: unconstrained work never loads it."""
        with self._grammar_lock:
            if self._grammar_backend is None:
                from sgnb.engine.grammar import GrammarBackend

                self._grammar_backend = GrammarBackend(self.tokenizer, self.source.config.vocab_size,
                                                       max_source_bytes=self.config.max_grammar_bytes)
            return self._grammar_backend

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The model's chat template over `messages`; `kwargs` are template variables (tools, documents, a
        template's own switches such as Qwen3's enable_thinking) over the engine's `chat_template_kwargs`."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  **{**self.chat_template_kwargs, **kwargs})

    # ---- requests ----------------------------------------------------------------------------------------
    def _check_open(self, workers: bool = True) -> None:
        """Raise EngineError if the engine cannot serve. Waits for submitted requests pass workers=False: a
        worker failure then reaches them as their own failure (finish_reason abort, meta_info error)."""
        if self._closed:
            raise EngineError("the engine was shut down")
        if self.scheduler.fatal is not None:
            raise EngineError(f"the engine's scheduler died: {self.scheduler.fatal!r}")
        failure = self.runner.failure() if workers else None
        if failure is not None:
            raise EngineError(f"the engine's model workers failed: {failure}") from failure

    def _tokens(self, prompt: str | None, input_ids: Sequence[int] | None) -> tuple[list[int], TextOffsets | None]:
        """The prompt's token ids, checked against the model and the context, and for a text prompt where they
        sit in its characters."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        limit = self._prompt_limit
        if prompt is not None:
            if not isinstance(prompt, str):
                raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
            _check_unicode(prompt, "prompt")
            if len(prompt) > (limit - 1) * self.tokenizer.max_token_chars:  # too long to fit: skip encoding it
                raise ValueError(f"the prompt has {len(prompt)} characters, more than the {limit - 1} tokens this "
                                 f"engine takes could hold (context length {self.context_length})")
            ids, offsets = self.tokenizer.encode_with_offsets(prompt)
        else:
            assert input_ids is not None  # exactly one of them
            offsets = None
            # a list of plain ints (what the language and the server send: select scoring's thousands of ids a
            # round) is checked by type alone; anything else element by element (numpy ints pass, bools do not)
            if isinstance(input_ids, list) and all(type(t) is int for t in input_ids):
                ids = input_ids.copy()
            elif isinstance(input_ids, (str, bytes)) or not all(is_strict_int(t) for t in input_ids):
                raise ValueError("input_ids must be a list of ints")
            else:
                ids = [int(t) for t in input_ids]
        self._check_fits(ids, from_text=prompt is not None)
        return ids, offsets

    def _check_fits(self, ids: list[int], from_text: bool) -> None:
        """ValueError unless the token ids (ints: the tokenizer's, or a caller's checked by `_tokens`) are in the
        model's vocabulary and fit the context; from_text: the tokenizer made them from a prompt's text."""
        vocab, limit = self.source.config.vocab_size, self._prompt_limit
        if from_text and ids and max(ids) >= vocab:
            raise ValueError(
                f"the tokenizer turned this prompt into ids up to {max(ids)}, outside the model's vocabulary "
                f"[0, {vocab}): the tokenizer ({self.tokenizer.vocab_size} ids) does not fit this model"
                + (". Dummy models use the SmolLM2 tokenizer: for text prompts pick one whose vocabulary "
                   "holds it (dummy:tiny, dummy:llama-2-7b-smolvocab, dummy:llama-3-8b) or pass input_ids"
                   if self.source.dummy else ""))
        if not from_text and ids and not (0 <= min(ids) and max(ids) < vocab):
            bad = [t for t in ids if not 0 <= t < vocab]
            raise ValueError(f"input_ids holds ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens; this engine takes at most {limit - 1} "
                             f"(context length {self.context_length}, KV pool {self.runner.kv_pool.size} tokens)")

    # ---- images and videos ----------------------------------------------------------------------------------
    @property
    def image_token(self) -> str | None:
        """The text that stands for an image in a prompt (e.g. "<image>"), None for text-only models."""
        return None if self.vision is None else self.vision.image_token

    @property
    def video_token(self) -> str | None:
        return None if self.vision is None else self.vision.video_token

    def media_processor(self) -> Any:
        """Image / video loading and preprocessing for this model (made on first use)."""
        return self._media.processor()

    def sampling_params(self, values: dict[str, Any] | None) -> SamplingParams:
        """A request's sampling values validated (TypeError / ValueError naming the value), with the model's
        generation_config values where it gives none. generate() takes the result as is: a caller that sends
        the same values many times (the language's in-process backend) validates them once."""
        if self.sampling_defaults:
            given = values or {}
            values = {**given, **{k: v for k, v in self.sampling_defaults.items() if given.get(k) is None}}
        return SamplingParams.from_dict(values)

    def _make_reqs(self, inp: GenerateInput, fit_to_context: bool = True) -> tuple[list[Req], bool]:
        """Validate everything and build the requests (n > 1 expands in place). Nothing is submitted here.
        fit_to_context: a max_new_tokens past the context length is lowered to fit (the in-process default) or,
        False, refused (what HTTP clients get, as from OpenAI and SGLang)."""
        items = inp.prompts()
        reqs: list[Req] = []
        compiles: dict[tuple[str, str], Any] = {}
        for item in items:
            if item.rid is not None:
                if not isinstance(item.rid, str):
                    raise TypeError(f"rid must be a str, got {type(item.rid).__name__}")
                _check_unicode(item.rid, "rid")
            ids, offsets = self._tokens(item.prompt, item.input_ids)
            ids, placements = self._media.place(ids, item.image_data, item.video_data)
            given = item.sampling_params
            sp = given if isinstance(given, SamplingParams) else self.sampling_params(given)
            grammar_future = grammar_key = None
            if sp.regex is not None or sp.json_schema is not None or sp.ebnf is not None:
                from sgnb.engine.grammar import constraint_of

                kind, source = constraint_of(sp)  # type: ignore[misc]
                grammar_key = (kind, source)
                grammar_future = compiles.get(grammar_key)
                if grammar_future is None:  # one compile_async (one waiter: grammar_wait releases it) per grammar
                    check_constraint_size(kind, source, self.config.max_grammar_bytes)
                    backend = self.grammar_backend()
                    backend.validate(kind, source)  # an invalid constraint fails here, with the parser's message
                    grammar_future = compiles[grammar_key] = backend.compile_async(kind, source)
            room = self.context_length - len(ids)
            if sp.max_new_tokens > room and not fit_to_context:
                raise ValueError(f"sampling_params.max_new_tokens={sp.max_new_tokens}: the prompt's {len(ids)} tokens "
                                 f"plus that many exceed the context length {self.context_length}; ask for at most "
                                 f"{room}")
            if sp.max_new_tokens > room:
                sp = dataclasses.replace(sp, max_new_tokens=room, min_new_tokens=min(sp.min_new_tokens, room))
            pool = self.runner.kv_pool.size
            if len(ids) + sp.max_new_tokens > pool:  # it could never run to its end: refuse it now, not midway
                raise ValueError(f"sampling_params.max_new_tokens={sp.max_new_tokens}: the prompt's {len(ids)} "
                                 f"tokens plus that many new ones cannot fit this engine's KV pool of {pool} "
                                 f"tokens; ask for at most {pool - len(ids)} (or a bigger max_total_tokens)")
            vocab = self.source.config.vocab_size
            start, top = item.logprob_start_len, item.top_logprobs_num
            if not is_strict_int(start) or start < -1:
                raise ValueError(f"logprob_start_len={start!r}: must be an int >= -1")
            if item.return_logprob and start >= len(ids):
                raise ValueError(f"logprob_start_len={start} must be < the prompt length {len(ids)} (or -1)")
            if not is_strict_int(top) or not 0 <= top <= vocab:
                raise ValueError(f"top_logprobs_num={top!r}: must be an int in [0, {vocab}] (the vocabulary)")
            outside = [t for t in sp.stop_token_ids if t >= vocab]
            if outside:
                raise ValueError(f"sampling_params.stop_token_ids holds ids outside the vocabulary [0, {vocab}): "
                                 f"{outside[:5]}")
            base = item.rid or new_rid()
            for j, name in enumerate(sample_rids(base, sp.n)):
                req = Req(name, ids, sp if sp.n == 1 else dataclasses.replace(sp, n=1),
                          return_logprob=bool(item.return_logprob),
                          logprob_start_len=start, top_logprobs_num=top)
                req.grammar_future, req.grammar_key = grammar_future, grammar_key
                req.mm, req.prompt_offsets = placements, offsets
                if sp.seed is not None:
                    req.generator = torch.Generator(device=self.runner.device).manual_seed(sample_seed(sp.seed, j))
                reqs.append(req)
        return reqs, inp.batched or len(reqs) > 1

    def generate(self, prompt: Prompt = None, sampling_params: SamplingLike | list[SamplingLike] | None = None,
                 input_ids: InputIds = None, return_logprob: bool | list[bool] = False,
                 logprob_start_len: int | list[int] = -1, top_logprobs_num: int | list[int] = 0,
                 return_text_in_logprobs: bool = False, stream: bool = False,
                 rid: str | list[str] | None = None, image_data: Any = None,
                 video_data: Any = None, stream_interval_s: float = 0.0) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (-> dict) or a list (-> list of dicts, n samples per prompt in order).

        image_data / video_data (multimodal models, SGLang's names): for one prompt an item or a list, for a
        batch a list with one entry (item or list) per prompt. An image is a path, PIL image, numpy array,
        bytes or data: URL; a video a path, (path, num_frames) or {"path", "num_frames"}. The prompt holds the
        model's image token (`engine.image_token`, e.g. "<image>") where each image goes, in order.

        With stream=True (one prompt, n=1) returns an iterator of dicts whose "text" is the new text since the
        previous chunk; the last chunk carries the full meta_info. `stream_interval_s` > 0 coalesces: chunks
        come at most that often, the first one interval after the call (the tokens of the steps between travel
        together; the last chunk still comes the moment the request ends), so a consumer that shows text need
        not wake at every decode step.
        Interrupting the wait (KeyboardInterrupt) aborts the requests, which frees their KV and cache locks.

        sampling_params: a dict of SGLang's names (validated here), or a SamplingParams from
        `engine.sampling_params(...)`, taken as it is (already validated, the model's defaults applied).

        Besides SGLang's, a finished request's meta_info holds `output_tokens` (per output token: its text as
        detokenized, the pieces joining to the text, and whether jump-forward forced it) and, for a text prompt,
        `cached_chars` (how many of its characters the `cached_tokens` cover).
        """
        self._check_open()
        reqs, many = self._make_reqs(GenerateInput(prompt, input_ids, sampling_params, return_logprob,
                                                   logprob_start_len, top_logprobs_num, rid, image_data, video_data))
        compiled_sync(reqs, self.config.grammar_compile_timeout, self.grammar_backend)
        if stream:
            if many:
                raise ValueError("stream=True takes one prompt with n=1")
            return request_output.stream(self, reqs[0], return_text_in_logprobs, stream_interval_s)
        outs = request_output.wait(self, reqs, return_text_in_logprobs)
        return outs if many else outs[0]

    async def async_generate(self, prompt: Prompt = None,
                             sampling_params: SamplingLike | list[SamplingLike] | None = None,
                             input_ids: InputIds = None, return_logprob: bool | list[bool] = False,
                             logprob_start_len: int | list[int] = -1, top_logprobs_num: int | list[int] = 0,
                             return_text_in_logprobs: bool = False, stream: bool = False,
                             rid: str | list[str] | None = None, image_data: Any = None,
                             video_data: Any = None, fit_to_context: bool = True, stream_interval_s: float = 0.0
                             ) -> dict | list[dict] | AsyncIterator[dict]:
        """Awaitable generate; with stream=True returns an async iterator (`stream_interval_s` as in generate).
        Cancelling aborts the requests. fit_to_context=False refuses a max_new_tokens past the context length
        instead of lowering it."""
        self._check_open()
        args = (GenerateInput(prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
                              top_logprobs_num, rid, image_data, video_data), fit_to_context)
        # images, videos and long texts are decoded, preprocessed and tokenized off the caller's event loop (a
        # server's: a multi-megabyte prompt would stall every other client meanwhile)
        text_chars = sum(len(p) for p in ([prompt] if isinstance(prompt, str) else prompt or []) if isinstance(p, str))
        off_loop = (image_data is not None or video_data is not None or text_chars > OFF_LOOP_PROMPT_CHARS
                    or constrained(sampling_params))  # a grammar's parse: 1 s for a schema nested 200 deep
        reqs, many = await asyncio.to_thread(self._make_reqs, *args) if off_loop else self._make_reqs(*args)
        await compiled(reqs, self.config.grammar_compile_timeout, self.grammar_backend)
        loop = asyncio.get_running_loop()
        if stream:
            if many:
                raise ValueError("stream=True takes one prompt with n=1")
            return request_output.stream_async(self, reqs[0], return_text_in_logprobs, loop, stream_interval_s)
        outs = await request_output.wait_async(self, reqs, return_text_in_logprobs)
        return outs if many else outs[0]

    def abort(self, rid: str) -> None:
        """Abort a request by id (queued or running). Its locks and KV slots are released."""
        self.scheduler.abort(rid)

    def _token_text(self, token: int) -> str:
        if is_pad(token):  # an image's / video's placeholder position
            return f"[{(self._media.shown(token) or {}).get('kind', 'image')}]"
        return self.tokenizer.token_text(token)

    def key_text(self, ids: list[int]) -> str:
        """A radix key as text: an image's (video's) run of pad ids reads "[image]" ("[video]")."""
        return tree_introspection.key_text(ids, lambda run: self.tokenizer.decode(run, False), self._token_text)

    def key_media(self, ids: list[int]) -> list[dict[str, Any]]:
        """The images / videos a radix key holds: kind, short hash, thumbnail (data: URL), tokens in this key."""
        return tree_introspection.key_media(self._media, ids)

    # ---- choice scoring (select) ------------------------------------------------------------------------
    def score(self, prefix: str | list[int], choices: list[str],
              choices_method: str = "token_length_normalized", return_text_in_logprobs: bool = False,
              image_data: Any = None, video_data: Any = None) -> dict:
        """Score continuations of one prefix as SGLang's select does (engine/scoring.py has the method); the
        prefix KV is shared through the radix cache. The prefix may hold images / videos (image_data /
        video_data, as in generate).

        Returns {"index", "choice", "normalized_prompt_logprobs", "input_token_logprobs" (per choice, from
        logprob_start_len = max(prompt_len - 2, 0); the first entry's logprob is None), "output_token_logprobs",
        "cached_tokens", "prompt_tokens"}, plus "greedy_logprob_matrix" (greedy_token_selection) or
        "unconditional_token_logprobs" and "normalized_unconditional_prompt_logprobs"
        (unconditional_likelihood_normalized): SGLang's meta_info for the method.
        """
        self._check_open()
        plan = score_requests.plan(self, prefix, choices, choices_method, image_data, video_data)
        return plan.result(request_output.wait(self, plan.reqs, False), return_text_in_logprobs, self._token_text)

    async def async_score(self, prefix: str | list[int], choices: list[str],
                          choices_method: str = "token_length_normalized", return_text_in_logprobs: bool = False,
                          image_data: Any = None, video_data: Any = None) -> dict:
        self._check_open()
        args = (prefix, choices, choices_method, image_data, video_data)
        plan = (await asyncio.to_thread(score_requests.plan, self, *args)
                if image_data is not None or video_data is not None else score_requests.plan(self, *args))
        outs = await request_output.wait_async(self, plan.reqs, False)
        return plan.result(outs, return_text_in_logprobs, self._token_text)

    # ---- cache and observability ------------------------------------------------------------------------
    def flush_cache(self, timeout: float | None = None) -> bool:
        """Empty the radix cache once no request is in flight (waits for that). Returns True when flushed."""
        self._check_open()
        return bool(self.scheduler.flush().result(timeout=timeout))

    def subscribe(self, callback, replay: bool = False):
        """Receive every engine event (dicts: insert, split, hit, evict, lock, unlock, reset, request).
        Runs on the scheduler thread: be quick. Returns an unsubscribe function."""
        return self.events.subscribe(callback, replay=replay)

    def event_history(self) -> list[Event]:
        return self.events.history()

    def tree_snapshot(self, max_key_tokens: int = 64) -> dict:
        """The live radix tree: {"nodes": [...], "total_tokens", "evictable_tokens", "protected_tokens"}."""
        return tree_introspection.snapshot(self.tree, self._media, self.key_text, max_key_tokens)

    # the tree node by node, for views (ids as in tree_snapshot and the events); safe from any thread
    def node_key(self, node_id: int) -> list[int] | None:
        """The radix key of tree node `node_id` (token ids; an image is its run of pad ids), or None when the node
        is gone. It is the node's own list: a split replaces it and nothing mutates it, so reading it needs no
        lock; do not modify it."""
        return tree_introspection.node_key(self.tree, node_id)

    def node_path(self, node_id: int) -> list[int] | None:
        """Ids of the nodes from the root (excluded) down to `node_id` (included), or None when it is gone."""
        return tree_introspection.node_path(self.tree, node_id)

    def get_stats(self) -> dict:
        return engine_stats(self)

    # ---- lifecycle --------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._finalizer()
            if self._grammar_backend is not None:
                self._grammar_backend.close()

    # ---- the rest of SGLang's offline Engine --------------------------------------------------------------
    def get_server_info(self) -> dict[str, Any]:
        """As SGLang's: the engine's settings (its server arguments), the running state and the version."""
        from sgnb import __version__

        settings = {k: v for k, v in dataclasses.asdict(self.config).items() if k != "extra"}
        return {**settings, "served_model_name": self.model_name, "reasoning_parser": self.reasoning_parser,
                "version": __version__,
                "internal_states": [self.get_stats()]}

    def get_tokenizer(self) -> Any:
        """The model's tokenizer as transformers loads it (what SGLang's get_tokenizer returns)."""
        from transformers import AutoTokenizer

        if self.tokenizer.directory is None:
            raise ValueError("this engine's tokenizer was not read from a directory transformers can load")
        return AutoTokenizer.from_pretrained(str(self.tokenizer.directory))

    def encode(self, prompt: Any, **kwargs: Any) -> Any:
        """SGLang's embedding call, for embedding models: none of the models sgnb runs is one, so this says so."""
        raise ValueError(f"{self.model_name} is a generative model: encode() (embeddings) needs an embedding model, "
                         "which sgnb does not run")

    def start_profile(self, output_dir: str | None = None, with_stack: bool = False) -> None:
        """Start torch's profiler over the engine's work (CPU ops of every thread; CUDA kernels on a GPU) until
        `stop_profile()`, which writes a Chrome trace into `output_dir` (default: $SGLANG_TORCH_PROFILER_DIR,
        else the temporary directory)."""
        self._profiler.start(output_dir, with_stack)

    def stop_profile(self) -> str:
        """Stop the profiler `start_profile()` started; returns the path of the Chrome trace it wrote."""
        return self._profiler.stop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


@dataclasses.dataclass
class _Restore:
    """Process-wide settings an engine changed: (before, the engine's) of each, None where it left it."""
    switch: tuple[float, float] | None = None
    gc: tuple[tuple[int, ...], tuple[int, ...]] | None = None


def _stop(scheduler: Scheduler, runner: Runner, restore: _Restore | None = None) -> None:
    scheduler.stop()
    runner.shutdown()
    if restore is None:
        return
    # each back as it was, unless someone changed it since
    if restore.switch is not None and sys.getswitchinterval() == restore.switch[1]:
        sys.setswitchinterval(restore.switch[0])
    if restore.gc is not None and gc.get_threshold() == restore.gc[1]:
        gc.set_threshold(*restore.gc[0])


def _check_unicode(text: str, name: str) -> None:
    """ValueError naming `name` when `text` holds a lone UTF-16 surrogate (no tokenizer takes one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: a lone UTF-16 surrogate {text[e.start]!r} at character {e.start}: text must be "
                         "valid Unicode") from None
