"""The route handlers' shared state and helpers, and SGLang's native API (/generate, /get_model_info, ...)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from sgnb.engine.request_input import GenerateInput, sample_rids, split_samples
from sgnb.server.access import ServerOptions
from sgnb.server.media import _Media
from sgnb.server.protocol import (
    _FLUSH_TIMEOUT_S,
    _HEALTH_TIMEOUT_S,
    _IGNORED_SAMPLING_NAMES,
    _SSE_DONE,
    AbortRequest,
    APIError,
    ConcatAppendRequest,
    GenerateRequest,
    _check_samples,
    _engine_error,
    _Inflight,
    _json_body,
    _json_response,
    _n_of,
    _new_rid,
    _sse,
    _validate,
)
from sgnb.server.streaming import EventStream, _ClientGone, _merge, _unless_disconnected

if TYPE_CHECKING:
    from sgnb.engine import Engine


class _Routes:
    """The engine, the options and the in-flight ids every route handler shares, and their helpers."""

    def __init__(self, engine: Engine, options: ServerOptions) -> None:
        self.engine = engine
        self.options = options
        self.inflight = _Inflight()
        self.started = time.time()
        self.kv_total = engine.get_stats()["kv_total"]  # the KV pool's size is fixed

    # -- helpers
    def _check_alive(self) -> None:
        e = self.engine
        if not e.is_alive:
            raise APIError(503, "the engine is not running", "service_unavailable")

    async def _start_streams(self, request: Request, calls: list[dict[str, Any]]) -> list[AsyncIterator[dict]]:
        """Validate and create one engine stream per call (none is submitted until iterated; their grammars are
        compiled). A client that leaves meanwhile stops the wait (its compiles are dropped if nobody else wants
        them)."""
        async def start() -> list[AsyncIterator[dict]]:
            streams = []
            for kw in calls:
                try:
                    streams.append(await self.engine.async_generate(**kw, stream=True, fit_to_context=False))
                except Exception as e:
                    raise _engine_error(e) from e
            return streams

        return await _unless_disconnected(request, start())

    async def _generate(self, request: Request, **kw: Any) -> Any:
        try:
            return await _unless_disconnected(request, self.engine.async_generate(**kw, fit_to_context=False))
        except (_ClientGone, APIError):
            raise
        except Exception as e:
            raise _engine_error(e) from e


class NativeRoutes(_Routes):
    """SGLang's native API."""

    # -- native API
    async def generate(self, request: Request) -> Response:
        req: GenerateRequest = _validate(GenerateRequest, await _json_body(request))
        for name in ("audio_data", "lora_path", "custom_logit_processor"):
            if getattr(req, name):
                raise APIError(400, f"not supported yet: {name}", param=name)
        if req.return_hidden_states:
            raise APIError(400, "not supported yet: return_hidden_states", param="return_hidden_states")
        if (req.text is None) == (req.input_ids is None):
            raise APIError(400, "give exactly one of text or input_ids")
        source = req.text if req.text is not None else req.input_ids
        prompt_key = "prompt" if req.text is not None else "input_ids"
        inp = GenerateInput(req.text, req.input_ids, req.sampling_params, req.return_logprob, req.logprob_start_len,
                            req.top_logprobs_num, req.rid)
        try:
            items = inp.prompts()  # the engine's own normalization: one entry per prompt
        except ValueError as e:
            raise APIError(400, str(e)) from None
        batched, count = inp.batched, len(items)
        prompts: list[Any] = [it.prompt if req.text is not None else it.input_ids for it in items]
        params = [self._native_sampling(it.sampling_params) for it in items]
        rids = [it.rid or _new_rid() for it in items]
        lps = [bool(it.return_logprob) for it in items]
        # SGLang's logprob_start_len: None is -1 (no input logprobs), and without return_logprob it is ignored
        starts = [-1 if it.logprob_start_len is None or not lp else it.logprob_start_len
                  for it, lp in zip(items, lps)]
        tops = [0 if it.top_logprobs_num is None else it.top_logprobs_num for it in items]
        ns = [_n_of(p, self.options.max_n) for p in params]
        _check_samples(sum(ns), self.options.max_samples)
        ids = {r: sample_rids(r, n) for r, n in zip(rids, ns)}
        if any(t > self.options.max_top_logprobs_num for t in tops if isinstance(t, int)):
            raise APIError(400, f"top_logprobs_num: at most {self.options.max_top_logprobs_num} on this server "
                                "(--max-top-logprobs-num)", param="top_logprobs_num")

        media = _Media(self.engine)
        images = media.prompts(req.image_data, "image", "image_data", batched, count)
        videos = media.prompts(req.video_data, "video", "video_data", batched, count)

        def media_kw(i: int | None) -> dict[str, Any]:  # prompt i's media; None: every prompt's (a batch)
            kw: dict[str, Any] = {}
            for key, per in (("image_data", images), ("video_data", videos)):
                if any(x is not None for x in per):
                    kw[key] = per if i is None else per[i]
            return kw

        if not req.stream:
            def pick(values: list[Any]) -> Any:  # per prompt for a batch, the one value otherwise
                return values if batched else values[0]

            with self.inflight.track(ids):
                out = await self._generate(
                    request, **{prompt_key: source}, sampling_params=pick(params), return_logprob=pick(lps),
                    logprob_start_len=pick(starts), top_logprobs_num=pick(tops),
                    return_text_in_logprobs=req.return_text_in_logprobs, rid=pick(rids),
                    **media_kw(None if batched else 0))
            return _json_response(_sglang_logprobs(out))

        calls = []
        for i, prompt in enumerate(prompts):
            for sp, rid in zip(split_samples(params[i], len(ids[rids[i]])), ids[rids[i]]):
                calls.append({prompt_key: prompt, "sampling_params": sp,
                              "return_logprob": lps[i], "logprob_start_len": starts[i],
                              "top_logprobs_num": tops[i], "return_text_in_logprobs": req.return_text_in_logprobs,
                              "rid": rid, **media_kw(i)})
        streams = await self._start_streams(request, calls)  # the engine has read the media here
        indexed = batched or len(calls) > 1
        return EventStream(self._native_events(streams, ids, indexed))  # type: ignore[return-value]

    @staticmethod
    def _native_sampling(params: dict[str, Any] | None) -> dict[str, Any]:
        params = dict(params or {})
        for name in _IGNORED_SAMPLING_NAMES:
            params.pop(name, None)
        return params

    async def _native_events(self, streams: list[AsyncIterator[dict]], ids: dict[str, list[str]],
                             indexed: bool) -> AsyncIterator[bytes]:
        """SGLang's stream format: each chunk carries the text so far (with incremental_streaming_output: the
        new text, output ids and output logprobs only; output_token_logprobs_length counts them all); then
        `data: [DONE]`."""
        incremental = self.options.incremental_streaming_output
        texts = [""] * len(streams)
        sent = [0] * len(streams)  # output tokens sent so far, per stream
        with self.inflight.track(ids):
            try:
                async with contextlib.aclosing(_merge(streams)) as chunks:
                    async for i, chunk in chunks:
                        texts[i] += chunk["text"]
                        out = _sglang_logprobs({**chunk, "text": chunk["text"] if incremental else texts[i]})
                        if "output_ids" not in chunk:  # not the last chunk
                            out["meta_info"] = {**out["meta_info"], "finish_reason": None}
                        if incremental:
                            out = _new_part(out, sent[i])
                            sent[i] = out["meta_info"].get("completion_tokens", sent[i])
                        if indexed:
                            out["index"] = i
                        yield _sse(out)
            except Exception as e:
                yield _sse({"error": {"message": _engine_error(e).message}})
            yield _SSE_DONE

    async def get_model_info(self, request: Request) -> Response:
        e = self.engine
        return _json_response({
            "model_path": e.config.model_path,
            "tokenizer_path": e.config.model_path,
            "model_name": e.model_name,
            "is_generation": True,
            "context_length": e.context_length,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": e.image_token is not None,
            "has_audio_understanding": False,
            "image_token": e.image_token,
            "video_token": e.video_token,
            "chat_template": e.tokenizer.chat_template,
            "reasoning_parser": getattr(e, "reasoning_parser", None),
        })

    async def get_server_info(self, request: Request) -> Response:
        from sgnb import __version__

        e = self.engine
        stats = e.get_stats()
        return _json_response({
            **dataclasses.asdict(e.config),
            "model_name": e.model_name,
            "context_length": e.context_length,
            "max_total_num_tokens": stats["kv_total"],
            "load_seconds": getattr(e, "load_seconds", None),
            "uptime_s": time.time() - self.started,
            "internal_states": [stats],
            "version": __version__,
            "has_image_understanding": e.image_token is not None,
            "image_token": e.image_token,
            "video_token": e.video_token,
            "incremental_streaming_output": self.options.incremental_streaming_output,  # SGLang's server arg
            "reasoning_parser": getattr(e, "reasoning_parser", None),  # SGLang's server arg (--reasoning-parser)
        })

    async def flush_cache(self, request: Request) -> Response:
        self._check_alive()
        try:
            # waits until no request is in flight; on a timeout the flush still happens once the engine is idle
            ok = await asyncio.to_thread(self.engine.flush_cache, _FLUSH_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            ok = False
        if not ok:
            raise APIError(400, f"the cache was not flushed within {_FLUSH_TIMEOUT_S:.0f} s: requests are "
                                "still running (it will be flushed once the engine is idle)")
        return Response("Cache flushed.\n", media_type="text/plain")

    async def health(self, request: Request) -> Response:
        self._check_alive()
        return Response(status_code=200)

    async def health_generate(self, request: Request) -> Response:
        """Healthy when the engine generates one token within the timeout."""
        self._check_alive()
        tok = self.engine.tokenizer.bos_token_id or 0
        rid = f"HEALTH_CHECK_{_new_rid()}"
        try:
            out = await asyncio.wait_for(self.engine.async_generate(
                input_ids=[tok], sampling_params={"max_new_tokens": 1, "temperature": 0}, rid=rid), _HEALTH_TIMEOUT_S)
        except Exception as e:  # asyncio.TimeoutError included
            raise APIError(503, f"the engine did not generate: {type(e).__name__}: {e}", "service_unavailable") from e
        if out["meta_info"]["finish_reason"]["type"] == "abort":
            raise APIError(503, f"the engine failed to generate: {out['meta_info'].get('error')}", "service_unavailable")
        return Response(status_code=200)

    async def concat_and_append(self, request: Request) -> Response:
        """SGLang's frontend asks the server to append the KV of forked requests to another's. Here the KV of a
        prompt is found by its text, so nothing needs moving: the frontend appends the branches' text itself and
        its next request hits the radix cache for whatever of that text is cached. Accepted (200) once valid."""
        _validate(ConcatAppendRequest, await _json_body(request))
        return Response(status_code=200)

    async def abort_request(self, request: Request) -> Response:
        req: AbortRequest = _validate(AbortRequest, await _json_body(request))
        if not req.rid and not req.abort_all:
            raise APIError(400, "give rid or abort_all=true")
        for rid in self.inflight.engine_ids(req.rid, req.abort_all):
            self.engine.abort(rid)
        return Response(status_code=200)


def _sglang_logprobs(out: Any) -> Any:
    """Logprobs as SGLang's server gives them. Input: the token at logprob_start_len has no logprob (None), its
    top logprobs none either, whatever logprob_start_len is (the engine computes them when it is > 0); a select
    through SGLang's own frontend relies on it (it averages every logprob after that token). Output:
    output_token_logprobs_length beside output_token_logprobs."""
    for o in out if isinstance(out, list) else [out]:
        meta = o.get("meta_info") if isinstance(o, dict) else None
        if not isinstance(meta, dict):
            continue
        meta = dict(meta)
        if meta.get("output_token_logprobs") is not None:
            meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
        if meta.get("input_token_logprobs"):
            first, *rest = meta["input_token_logprobs"]
            meta["input_token_logprobs"] = [(None, *first[1:]), *rest]
            if meta.get("input_top_logprobs"):
                meta["input_top_logprobs"] = [None, *meta["input_top_logprobs"][1:]]
        o["meta_info"] = meta
    return out


def _new_part(out: dict[str, Any], sent: int) -> dict[str, Any]:
    """A stream chunk reduced to what is new since the first `sent` output tokens (SGLang's incremental
    streaming output): its output ids and output (top) logprobs; the text is already the new text."""
    meta = dict(out["meta_info"])
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if meta.get(key) is not None:
            meta[key] = meta[key][sent:]
    part = {**out, "meta_info": meta}
    if "output_ids" in part:
        part["output_ids"] = list(part["output_ids"])[sent:]
    return part
