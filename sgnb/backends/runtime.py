"""Runtime: the in-process engine as a backend (SGLang's `Runtime` launches a server; ours runs in-process)."""

from __future__ import annotations

import json
import warnings
from collections.abc import AsyncIterator, Iterator
from functools import cached_property
from typing import Any, cast

from sgnb.backends.base import Backend, ChoiceDecision, GenContext, RequestAborted
from sgnb.chat_template import ChatTemplate, derive_from_jinja
from sgnb.engine.meta_info import FinishReason, MetaInfo
from sgnb.media import Media
from sgnb.sampling import GenParams


class Runtime(Backend):
    """`Runtime(model_path="smollm2", **engine_options)` or `Runtime(engine=existing_engine)`: the in-process
    engine as a program backend, and SGLang's `Runtime` for a script written for it.

    The options are the engine's (SGLang's server argument names: mem_fraction_static, context_length, ...,
    log_level, chat_template; see `sgnb.Engine`). `port` / `host` are where `rt.url` / `rt.endpoint` serve the
    engine over HTTP (`sgnb serve`, started on first use: there is no server to wait for in-process, so
    SGLang's `launch_timeout` changes nothing). SGLang's Runtime calls work: `rt.generate(prompt,
    sampling_params)` (a JSON string, as SGLang's), `rt.async_generate`, `rt.encode`, `rt.get_tokenizer()`,
    `rt.start_profile()` / `rt.stop_profile()`, `rt.shutdown()`."""

    # A streamed gen's text comes in pieces at most this often (the steps between travel together): a program's
    # thread then wakes ~20 times a second, not at every decode step (at GPU speed 200+ a second per program,
    # which cost a streamed 64-program run_batch a third of its throughput; benchmarks/bench_views.py).
    stream_interval_s = 0.05

    def __init__(self, model_path: str = "smollm2", engine: Any = None, *, port: int | None = None,
                 host: str = "127.0.0.1", **engine_kwargs: Any) -> None:
        if engine_kwargs.pop("launch_timeout", None) is not None:
            warnings.warn("sgnb: Runtime(launch_timeout=...) changes nothing: the engine runs in this process",
                          stacklevel=2)
        if engine is None:
            from sgnb.engine import Engine

            engine = Engine(model_path, **engine_kwargs)
        elif engine_kwargs:
            raise TypeError("give either engine= or engine options, not both")
        self.engine = engine
        self._serve_at = (host, port)
        self._server: Any = None
        self._endpoint: Any = None

    # ---- SGLang's Runtime ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The engine over HTTP (`sgnb serve` on host:port, started on first use; a free port when none given)."""
        if self._server is None:
            from sgnb.server import start_server_thread

            host, port = self._serve_at
            self._server = start_server_thread(self.engine, host, 0 if port is None else port)
        return self._server.url

    @property
    def endpoint(self) -> Any:
        """A RuntimeEndpoint over `url` (as SGLang's Runtime has one)."""
        if self._endpoint is None:
            from sgnb.backends.endpoint import RuntimeEndpoint

            self._endpoint = RuntimeEndpoint(self.url)
        return self._endpoint

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def encode(self, prompt: Any) -> str:
        return json.dumps(self.engine.encode(prompt))

    def start_profile(self) -> None:
        self.engine.start_profile()

    def stop_profile(self) -> str:
        return self.engine.stop_profile()

    async def async_generate(self, prompt: str, sampling_params: dict | None = None,
                             session_id: str | None = None) -> AsyncIterator[str]:
        """SGLang's: the generated text, piece by piece, as it comes."""
        _no_sessions(session_id)
        async for chunk in await self.engine.async_generate(prompt, sampling_params, stream=True):
            if chunk["text"]:
                yield chunk["text"]

    add_request = async_generate

    def get_model_name(self) -> str:
        return self.engine.model_name

    @property
    def reasoning_parser(self) -> str | None:
        """The engine's reasoning format (`Runtime(..., reasoning_parser="qwen3")`): separate_reasoning's default."""
        return getattr(self.engine, "reasoning_parser", None)

    @cached_property
    def _template(self) -> ChatTemplate:
        tok = self.engine.tokenizer
        if tok.chat_template is None:
            from sgnb.chat_template import PLAIN

            return PLAIN
        extra = self.engine.chat_template_kwargs  # e.g. enable_thinking: the roles render with it
        return derive_from_jinja(lambda m, g, **kw: tok.apply_chat_template(m, add_generation_prompt=g,
                                                                            **{**extra, **kw}),
                                 self.engine.model_name)

    def get_chat_template(self) -> ChatTemplate:
        return self._template

    @property
    def image_token(self) -> str | None:  # type: ignore[override]
        return self.engine.image_token

    @property
    def video_token(self) -> str | None:  # type: ignore[override]
        return self.engine.video_token

    def cache_prefix(self, prefix: str, images: list[Media] | None = None) -> None:
        if prefix:
            self.engine.generate(prefix, {"max_new_tokens": 0}, **_media_kw(images or []))

    def _request(self, ctx: GenContext, params: GenParams) -> dict[str, Any]:
        # the gen's values over the program's, checked together (each was checked at its gen() / run() line) into
        # the SamplingParams the engine's request keeps: the engine does not validate it again
        sampling = self.engine.sampling_params(with_global_sampling(params.sampling_dict()))
        return dict(prompt=ctx.text, sampling_params=sampling, rid=ctx.rid,
                    return_logprob=bool(params.return_logprob),
                    logprob_start_len=params.logprob_start_len if params.logprob_start_len is not None else -1,
                    top_logprobs_num=params.top_logprobs_num or 0,
                    return_text_in_logprobs=bool(params.return_text_in_logprobs), **_media_kw(ctx.images))

    def generate(self, ctx: Any, params: Any = None, return_logprob: Any = False, logprob_start_len: Any = None,
                 top_logprobs_num: Any = None, lora_path: Any = None, session_id: Any = None) -> Any:
        """The backend call `generate(ctx, params)` a program makes; or SGLang's `rt.generate(prompt,
        sampling_params, ...)`, which returns the engine's result as a JSON string (as SGLang's Runtime does)."""
        if not isinstance(ctx, GenContext):
            if lora_path is not None:
                raise ValueError("Runtime.generate(lora_path=...): sgnb runs no LoRA adapters")
            _no_sessions(session_id)
            out = self.engine.generate(ctx, params, return_logprob=return_logprob,
                                       logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
                                       top_logprobs_num=top_logprobs_num or 0)
            return json.dumps(out)
        out = self.engine.generate(**self._request(ctx, params))
        _raise_if_aborted(out["meta_info"], out["text"])
        return out["text"], out["meta_info"]

    def generate_samples(self, ctx: GenContext, params: GenParams) -> list[tuple[str, MetaInfo]]:
        outs = self.engine.generate(**self._request(ctx, params))  # one request: the n samples share the prefix
        outs = outs if isinstance(outs, list) else [outs]
        for out in outs:
            _raise_if_aborted(out["meta_info"], out["text"])
        return [(out["text"], out["meta_info"]) for out in outs]

    def generate_stream(self, ctx: GenContext, params: GenParams) -> Iterator[tuple[str, MetaInfo]]:
        interval = self.stream_interval_s if ctx.stream_interval_s is None else ctx.stream_interval_s
        for chunk in self.engine.generate(**self._request(ctx, params), stream=True, stream_interval_s=interval):
            meta: MetaInfo = chunk["meta_info"]
            if "finish_reason" in meta:  # the last chunk: the complete meta_info (output_tokens included)
                _raise_if_aborted(meta, chunk["text"])
            yield chunk["text"], meta

    def select(self, ctx: GenContext, choices: list[str], temperature: float,
               choices_method: str) -> ChoiceDecision:
        res = self.engine.score(ctx.text, choices, choices_method, return_text_in_logprobs=True,
                                **_media_kw(ctx.images))  # SGLang's meta_info: the token texts included
        meta = cast(MetaInfo, {k: v for k, v in res.items() if k not in ("index", "choice")})
        meta["choices"] = list(choices)
        return ChoiceDecision(res["choice"], meta)

    def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return {"backend": "Runtime", **self.engine.get_stats()}

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        self.engine.shutdown()


def _no_sessions(session_id: Any) -> None:
    if session_id is not None:
        raise ValueError("session_id: sgnb keeps no sessions; the radix cache reuses a conversation's prefix anyway")


def with_global_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """A request's sampling values with what `sgl.global_config` sets for every request (as SGLang's backends
    send it): skip_special_tokens_in_output=False keeps special tokens in the text."""
    from sgnb.function import global_config

    if not global_config.skip_special_tokens_in_output:
        return {**sampling, "skip_special_tokens": False}
    return sampling


def _media_kw(media: list[Media]) -> dict[str, Any]:
    """image_data / video_data for the engine: the items as the program gave them (the engine reads paths, PIL
    images, arrays, bytes and data: URLs itself), in order per kind, as its image (video) tokens are."""
    images = [m.data for m in media if m.kind == "image"]
    videos = [(m.data, m.num_frames) for m in media if m.kind == "video"]
    return {**({"image_data": images} if images else {}), **({"video_data": videos} if videos else {})}


def _raise_if_aborted(meta: MetaInfo, text: str) -> None:
    """RequestAborted (with `text`, what the request generated that the caller has not seen) when it was aborted."""
    reason: FinishReason = meta.get("finish_reason") or {}
    if reason.get("type") == "abort":
        why = reason.get("message") or "aborted"
        raise RequestAborted(f"request {meta.get('id')} was aborted" + ("" if why == "aborted" else f": {why}"),
                             text, meta)
