"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions (and the chat request's
preparation /v1/responses shares), /v1/embeddings, and SGLang's /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from sgnb.engine.request_input import sample_rids, split_samples
from sgnb.reasoning import ReasoningFormat, ReasoningStream, reasoning_format, split_reasoning
from sgnb.server.media import _Media
from sgnb.server.native_api import _Routes
from sgnb.server.protocol import (
    _SSE_DONE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    StreamOptions,
    TokenizeRequest,
    _batch_kw,
    _chat_logprobs,
    _check_samples,
    _completion_logprobs,
    _engine_error,
    _finish,
    _history_tool_calls,
    _json_body,
    _json_response,
    _n_of,
    _new_rid,
    _raise_failed,
    _response_format,
    _sse,
    _tool_plan,
    _usage,
    _validate,
)
from sgnb.server.streaming import EventStream, _ClientGone, _merge, _unless_disconnected
from sgnb.tool_decode import Decoded, ToolReply, tool_steps
from sgnb.tools import ToolPlan, call_text, tool_response_text, tool_support, tools_prompt


@dataclass(frozen=True)
class _ChatJob:
    """A chat request made ready for the engine (`OpenAIRoutes._chat_job`): the prompt as text and ids, the
    sampling values, the media, the reasoning format (None: the reply is not split), the reasoning's closing marker
    when the reply starts by thinking (`after`: a constraint or a required tool call applies from it on), the base
    request id, the logprob options, and the response's id, created and model."""

    req: ChatCompletionRequest
    plan: ToolPlan | None
    text: str
    input_ids: list[int]
    sp: dict[str, Any]
    mm: dict[str, Any]
    fmt: ReasoningFormat | None
    after: str | None
    base: str
    lp_kw: dict[str, Any]
    meta: dict[str, Any]

    @property
    def samples(self) -> list[tuple[dict[str, Any], str]]:
        """(sampling values, engine request id) of each of the n choices."""
        return list(zip(split_samples(self.sp, self.req.n), sample_rids(self.base, self.req.n)))

    @property
    def ids(self) -> dict[str, list[str]]:
        """The request id -> its engine request ids (a tool call's second request included), for /abort_request."""
        rids = sample_rids(self.base, self.req.n)
        return {self.base: [r for rid in rids for r in ((rid, f"{rid}-call") if self.plan else (rid,))]}


class OpenAIRoutes(_Routes):
    """The OpenAI-compatible routes."""

    # -- OpenAI API
    async def list_models(self, request: Request) -> Response:
        return _json_response({"object": "list", "data": [self._model_card()]})

    async def retrieve_model(self, request: Request) -> Response:
        """GET /v1/models/{model}: the served model's card, or 404 naming the one this server has."""
        name = request.path_params["model"]
        if name != self.engine.model_name:
            raise APIError(404, f"model {name!r} not found: this server serves {self.engine.model_name!r}",
                           "not_found_error", param="model")
        return _json_response(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        e = self.engine
        modalities = ["text"] + ["image"] * (e.image_token is not None) + ["video"] * (e.video_token is not None)
        return {"id": e.model_name, "object": "model", "created": int(self.started), "owned_by": "sgnb",
                "root": e.config.model_path, "max_model_len": e.context_length, "input_modalities": modalities,
                "has_image_understanding": e.image_token is not None}

    async def tokenize(self, request: Request) -> Response:
        """SGLang's /tokenize: {"tokens", "count", "max_model_len"}; a list of prompts gives lists. Messages are
        rendered and tokenized as /v1/chat/completions does (their count is its prompt_tokens)."""
        req: TokenizeRequest = _validate(TokenizeRequest, await _json_body(request))
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.continue_final_message or req.add_generation_prompt is False:
            raise APIError(400, "not supported yet: messages rendered otherwise than for a chat completion "
                                "(continue_final_message, add_generation_prompt=false)", param="messages")
        max_len = self.engine.context_length
        if req.messages is not None:
            if not req.messages:
                raise APIError(400, "messages is an empty list", param="messages")
            plan = _tool_plan(req.tools, req.tool_choice)
            _, _, _, ids = await asyncio.to_thread(self._chat_prompt, req.messages, _Media(self.engine), plan,
                                                   max_len + 1, req.chat_template_kwargs or {})
            return _json_response({"tokens": ids, "count": len(ids), "max_model_len": max_len})
        prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt or [])
        tokens = await asyncio.to_thread(lambda: [self._encode(p, req.add_special_tokens) for p in prompts])
        if isinstance(req.prompt, str):
            return _json_response({"tokens": tokens[0], "count": len(tokens[0]), "max_model_len": max_len})
        return _json_response({"tokens": tokens, "count": [len(t) for t in tokens], "max_model_len": max_len})

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The ids a prompt gets (with the BOS the tokenizer adds, if it adds one); without special tokens, no BOS
        is added (one written in the text stays)."""
        tok = self.engine.tokenizer
        ids = tok.encode(text)
        bos = tok.bos_token_id
        if not add_special_tokens and tok.add_bos_token and bos is not None and ids[:1] == [bos] \
                and not text.startswith(tok.decode([bos], skip_special_tokens=False)):
            ids = ids[1:]
        return ids

    async def detokenize(self, request: Request) -> Response:
        """SGLang's /detokenize: {"text"} for a list of ids, a list of texts for a list of lists."""
        req: DetokenizeRequest = _validate(DetokenizeRequest, await _json_body(request))
        tok = self.engine.tokenizer
        batched = bool(req.tokens) and isinstance(req.tokens[0], list)
        rows: list[list[int]] = req.tokens if batched else [req.tokens]  # type: ignore[assignment,list-item]
        vocab = tok.vocab_size
        for i, row in enumerate(rows):
            bad = [t for t in row if not 0 <= t < vocab]
            if bad:
                where = f"tokens[{i}]" if batched else "tokens"
                raise APIError(400, f"{where} holds ids outside the tokenizer's vocabulary [0, {vocab}): {bad[:5]}",
                               param="tokens")
        texts = await asyncio.to_thread(lambda: [tok.decode(r, skip_special_tokens=req.skip_special_tokens)
                                                 for r in rows])
        return _json_response({"text": texts if batched else texts[0]})

    async def embeddings(self, request: Request) -> Response:
        """/v1/embeddings: the engine's `encode`, which refuses for a generative model (every model sgnb runs):
        a 400 saying so."""
        req: EmbeddingRequest = _validate(EmbeddingRequest, await _json_body(request))
        self._check_model(req.model)
        try:
            self.engine.encode(req.input)
        except ValueError as e:
            raise APIError(400, f"/v1/embeddings: {e}", param="model", code="model_not_supported") from None
        raise APIError(501, "not supported yet: the engine embedded, but this server has no embeddings response",
                       "internal_server_error")

    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = _validate(CompletionRequest, await _json_body(request))
        self._check_model(req.model)
        if req.suffix:
            raise APIError(400, "not supported yet: suffix", param="suffix")
        if req.best_of not in (None, req.n):
            raise APIError(400, "not supported yet: best_of other than n", param="best_of")
        prompt = req.prompt
        batched = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        prompts: list[Any] = list(prompt) if batched else [prompt]
        if not prompts:
            raise APIError(400, "prompt is an empty list", param="prompt")
        sp = req.sampling_params(req.max_tokens if req.max_tokens is not None else 16)
        want_lp = req.logprobs is not None
        base = req.rid or _new_rid()
        rids = [base] if len(prompts) == 1 else [f"{base}-p{i}" for i in range(len(prompts))]
        _n_of({"n": req.n}, self.options.max_n)
        _check_samples(len(prompts) * req.n, self.options.max_samples)
        ids = {base: [r for rid in rids for r in sample_rids(rid, req.n)]}
        lp_kw = {"return_logprob": want_lp, "top_logprobs_num": req.logprobs or 0,
                 "logprob_start_len": 0 if req.echo and want_lp else -1, "return_text_in_logprobs": True}
        meta = {"id": f"cmpl-{base}", "created": int(time.time()), "model": self.engine.model_name}
        tokens = self.engine.tokenizer

        def prompt_kw(p: Any) -> dict[str, Any]:
            return {"prompt": p} if isinstance(p, str) else {"input_ids": p}

        def echo_text(i: int) -> str:
            p = prompts[i]
            return p if isinstance(p, str) else tokens.decode(p)

        if not req.stream:
            with self.inflight.track(ids):
                if batched:
                    outs = await self._generate(request, **_batch_kw(prompts), sampling_params=sp, rid=rids, **lp_kw)
                else:
                    outs = await self._generate(request, **prompt_kw(prompts[0]), sampling_params=sp, rid=rids[0],
                                                **lp_kw)
            outs = outs if isinstance(outs, list) else [outs]
            _raise_failed(outs)
            choices = []
            for k, out in enumerate(outs):
                prefix = echo_text(k // req.n) if req.echo else ""
                choices.append({"index": k, "text": prefix + out["text"],
                                "logprobs": _completion_logprobs(out, req.echo) if want_lp else None,
                                **_finish(out)})
            return _json_response({**meta, "object": "text_completion", "choices": choices,
                                   "usage": _usage(outs, req.n)})

        calls = [{**prompt_kw(p), "sampling_params": s, "rid": r, **lp_kw}
                 for i, p in enumerate(prompts)
                 for s, r in zip(split_samples(sp, req.n), sample_rids(rids[i], req.n))]
        streams = await self._start_streams(request, calls)
        head = [{"index": k, "text": echo_text(k // req.n), "logprobs": None, "finish_reason": None}
                for k in range(len(calls))] if req.echo else []

        def choice(k: int, chunk: dict, last: bool) -> dict[str, Any]:
            return {"index": k, "text": chunk["text"],
                    "logprobs": _completion_logprobs(chunk, False) if last and want_lp else None,
                    **(_finish(chunk) if last else {"finish_reason": None})}

        return EventStream(self._openai_events(  # type: ignore[return-value]
            streams, ids, {**meta, "object": "text_completion"}, head, choice, req.stream_options, req.n))

    async def chat_completions(self, request: Request) -> Response:
        req: ChatCompletionRequest = _validate(ChatCompletionRequest, await _json_body(request))
        self._check_model(req.model)
        if req.functions is not None or req.function_call is not None:
            raise APIError(400, "not supported yet: functions / function_call (OpenAI's deprecated form): use "
                                "tools and tool_choice", param="functions")
        plan = _tool_plan(req.tools, req.tool_choice)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        self._check_constraint(req, plan)
        job = await self._chat_job(req, _Media(self.engine), plan, "chatcmpl-")
        if plan is not None:
            return await self._chat_tools(request, job)
        if not req.stream:
            with self.inflight.track(job.ids):
                outs = await self._generate(request, input_ids=job.input_ids, sampling_params=job.sp, rid=job.base,
                                            **job.lp_kw, **job.mm)
            outs = outs if isinstance(outs, list) else [outs]
            _raise_failed(outs)
            choices = [{"index": k, "message": _reply_message(out["text"], job.fmt),
                        "logprobs": _chat_logprobs(out) if req.logprobs else None, **_finish(out)}
                       for k, out in enumerate(outs)]
            return _json_response({**job.meta, "object": "chat.completion", "choices": choices,
                                   "usage": _usage(outs, req.n)})

        streams = await self._choice_streams(request, job)
        head = [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for k in range(len(streams))]
        splitters = [ReasoningStream(job.fmt) if job.fmt is not None else None for _ in streams]

        def choice(k: int, chunk: dict, last: bool) -> dict[str, Any]:
            delta = _text_delta(splitters[k], chunk["text"], last)
            return {"index": k, "delta": delta,
                    "logprobs": _chat_logprobs(chunk) if last and req.logprobs else None,
                    **(_finish(chunk) if last else {"finish_reason": None})}

        return EventStream(self._openai_events(  # type: ignore[return-value]
            streams, job.ids, {**job.meta, "object": "chat.completion.chunk"}, head, choice, req.stream_options,
            req.n))

    def _check_model(self, model: str | None) -> None:
        """With ServerOptions.strict_model_name, a request naming another model than the served one is OpenAI's
        404 model_not_found; by default (SGLang's way) any name is served by the one model."""
        if self.options.strict_model_name and model is not None and model != self.engine.model_name:
            raise APIError(404, f"The model {model!r} does not exist: this server serves {self.engine.model_name!r}",
                           "invalid_request_error", param="model", code="model_not_found")

    @staticmethod
    def _check_constraint(req: ChatCompletionRequest, plan: ToolPlan | None) -> None:
        """A response_format is valid, and no constraint comes with tools that may be called."""
        constraint = _response_format(req.response_format or {})
        if plan is not None and (constraint or req.regex or req.ebnf or req.json_schema):
            raise APIError(400, "not supported yet: response_format, regex, ebnf or json_schema together with "
                                'tools (unless tool_choice is "none")', param="tool_choice")

    async def _chat_job(self, req: ChatCompletionRequest, media: _Media, plan: ToolPlan | None,
                        id_prefix: str) -> _ChatJob:
        """A chat request made ready for the engine (what /v1/chat/completions and /v1/responses share): the
        rendered prompt and its ids, the sampling values (a response_format as its constraint, applied after the
        reasoning when the model reasons), the media, the reasoning format, the request ids."""
        limit = min(self.engine.context_length, self.kv_total)
        # rendering, media decoding and tokenizing take seconds for a multi-megabyte message: off the event loop
        text, images, videos, input_ids = await asyncio.to_thread(self._chat_prompt, req.messages, media, plan, limit,
                                                                  req.chat_template_kwargs or {})
        mm = {**({"image_data": images} if images else {}), **({"video_data": videos} if videos else {})}
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        sp = req.sampling_params(max_new if max_new is not None else max(limit - len(input_ids), 1))
        fmt = self._reasoning(req, text)
        template_vars = {**getattr(self.engine, "chat_template_kwargs", {}), **(req.chat_template_kwargs or {})}
        thinking_off = False in (template_vars.get(k) for k in ("enable_thinking", "thinking"))
        # the reply starts with thinking: not turned off, and the template did not close an empty block itself
        thinks = fmt is not None and not thinking_off and not text.rstrip().endswith(fmt.close)
        after = fmt.close if thinks and fmt is not None else None
        if after is not None and any(sp.get(k) for k in ("regex", "json_schema", "ebnf")):
            sp["grammar_after"] = after  # the model thinks freely; the constraint applies to the answer
        _n_of({"n": req.n}, self.options.max_n)
        base = req.rid or _new_rid()
        lp_kw = {"return_logprob": req.logprobs, "top_logprobs_num": req.top_logprobs or 0,
                 "return_text_in_logprobs": True}
        meta = {"id": f"{id_prefix}{base}", "created": int(time.time()), "model": self.engine.model_name}
        return _ChatJob(req, plan, text, input_ids, sp, mm, fmt, after, base, lp_kw, meta)

    async def _choice_streams(self, request: Request, job: _ChatJob) -> list[AsyncIterator[dict]]:
        """One stream of engine-like chunks per choice (the last chunk has "output_ids"). With tools, that last
        chunk's "tool_calls" holds the parsed call or None (`_tool_sample`). Nothing runs until iterated."""
        if job.plan is None:
            return await self._start_streams(request, [
                {"input_ids": job.input_ids, "sampling_params": s, "rid": r, **job.lp_kw, **job.mm}
                for s, r in job.samples])
        plan = job.plan
        # each reply's first request: the step `_tool_sample` starts from (it depends on plan, sp and after only)
        firsts = [next(tool_steps(plan, s, job.after)) for s, _ in job.samples]
        streams = await self._start_streams(request, [
            {**({"prompt": job.text + step.prefix} if step.prefix else {"input_ids": job.input_ids}),
             "sampling_params": step.params, "rid": r, **job.lp_kw, **job.mm}
            for step, (_, r) in zip(firsts, job.samples)])
        return [self._tool_sample(plan, job.text, first, s, r, job.lp_kw, job.mm, job.after)
                for first, (s, r) in zip(streams, job.samples)]

    async def _collect_choices(self, request: Request, job: _ChatJob) -> list[tuple[str, dict]]:
        """Every choice's whole text and last chunk, for a non-streaming answer (the client leaving aborts)."""
        streams = await self._choice_streams(request, job)
        with self.inflight.track(job.ids):
            try:
                results = await _unless_disconnected(request, asyncio.gather(*(_collect(st) for st in streams)))
            except (_ClientGone, APIError):
                raise
            except Exception as e:
                raise _engine_error(e) from e
        _raise_failed([final for _, final in results])
        return results

    # -- tool calls
    async def _chat_tools(self, request: Request, job: _ChatJob) -> Response:
        """A chat completion that may call tools. "required" (or a named function): the reply opens with
        <tool_call> (prefilled) and is one call object constrained by the allowed functions' schemas. "auto": text
        that stops where a call opens (<tool_call>, or a bare {"name": ...} first thing), then continues as a
        constrained call. A model that thinks first (`job.after`) thinks freely and a required call's grammar
        starts at the reasoning's closing marker (grammar_after, one request). One call per choice; a stream sends
        text as it comes and the call whole once decoded. With a reasoning format the thinking is
        reasoning_content."""
        req = job.req
        if not req.stream:
            results = await self._collect_choices(request, job)
            finals = [final for _, final in results]
            choices = [{"index": k, "message": _tool_message(content, final, job.fmt),
                        "logprobs": _chat_logprobs(final) if req.logprobs else None, **_tool_finish(final)}
                       for k, (content, final) in enumerate(results)]
            return _json_response({**job.meta, "object": "chat.completion", "choices": choices,
                                   "usage": _usage(finals, req.n)})

        streams = await self._choice_streams(request, job)
        head = [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for k in range(len(streams))]
        splitters = [ReasoningStream(job.fmt) if job.fmt is not None else None for _ in streams]

        def choice(k: int, chunk: dict, last: bool) -> dict[str, Any]:
            delta = _text_delta(splitters[k], chunk["text"], last)
            if last and chunk.get("tool_calls"):
                delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(chunk["tool_calls"])]
            return {"index": k, "delta": delta, "logprobs": _chat_logprobs(chunk) if last and req.logprobs else None,
                    **(_tool_finish(chunk) if last else {"finish_reason": None})}

        return EventStream(self._openai_events(  # type: ignore[return-value]
            streams, job.ids, {**job.meta, "object": "chat.completion.chunk"}, head, choice, req.stream_options,
            req.n))

    async def _openai_events(self, streams: list[AsyncIterator[dict]], ids: dict[str, list[str]],
                             meta: dict[str, Any], head: list[dict], choice: Callable[[int, dict, bool], dict],
                             options: StreamOptions | None, n: int) -> AsyncIterator[bytes]:
        """OpenAI's stream: the `head` choices, one chunk per engine chunk (logprobs and finish_reason come with
        a choice's last chunk), a usage chunk when stream_options.include_usage, then `data: [DONE]`."""
        include_usage = bool(options and options.include_usage)
        usage = {"usage": None} if include_usage else {}
        finals: list[dict] = [{}] * len(streams)
        with self.inflight.track(ids):
            try:
                for c in head:
                    yield _sse({**meta, "choices": [c], **usage})
                async with contextlib.aclosing(_merge(streams)) as chunks:
                    async for k, chunk in chunks:
                        last = "output_ids" in chunk
                        if last:
                            finals[k] = chunk
                            _raise_failed([chunk])
                        yield _sse({**meta, "choices": [choice(k, chunk, last)], **usage})
                if include_usage:
                    yield _sse({**meta, "choices": [], "usage": _usage(finals, n)})
            except Exception as e:
                err = e if isinstance(e, APIError) else _engine_error(e)
                yield _sse({"error": {"message": err.message, "type": err.type, "code": err.status}})
            yield _SSE_DONE

    def _reasoning(self, req: ChatCompletionRequest, prompt: str) -> ReasoningFormat | None:
        """The reply's reasoning format when it is returned apart: the server's parser (None without one, or when
        the request says separate_reasoning=false); a prompt that ends by opening the block (a template that
        starts the thinking itself) makes the reply start inside it."""
        name = getattr(self.engine, "reasoning_parser", None)
        if name is None or not req.separate_reasoning:
            return None
        fmt = reasoning_format(name)
        if not fmt.starts_inside and prompt.rstrip().endswith(fmt.open):
            fmt = dataclasses.replace(fmt, starts_inside=True)
        return fmt

    def _chat_prompt(self, messages: list[dict[str, Any]], media: _Media, plan: ToolPlan | None, limit: int,
                     template_kwargs: dict[str, Any]) -> tuple[str, list[Any], list[Any], list[int]]:
        """_render_chat, then the prompt's ids. Text that could not fit `limit` tokens is a 400 before it is rendered
        or tokenized (what /generate's prompts get from the engine)."""
        budget = (limit - 1) * self.engine.tokenizer.max_token_chars
        chars = _message_chars(messages)
        if chars > budget:
            raise APIError(400, f"messages: {chars} characters of text, more than the {limit - 1} tokens this server "
                                f"takes could hold (context length {self.engine.context_length})", param="messages")
        text, images, videos = self._render_chat(messages, media, plan, template_kwargs)
        if len(text) > budget:
            raise APIError(400, f"messages: the rendered chat has {len(text)} characters, more than the {limit - 1} "
                                f"tokens this server takes could hold (context length {self.engine.context_length})",
                           param="messages")
        return text, images, videos, self.engine.tokenizer.encode(text)

    def _render_chat(self, messages: list[dict[str, Any]], media: _Media, plan: ToolPlan | None = None,
                     template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[Any], list[Any]]:
        """The prompt text (the chat template over the messages) and its images and videos in order. A content
        list's text parts are joined by newlines; an image_url (video_url) part becomes the model's image (video)
        token in its place, with nothing around it, so text + image + text reads back as it was split.

        Tools: a chat template that renders tools gets the request's tools (unless tool_choice is "none"), past
        assistant tool_calls (arguments parsed from JSON) and tool messages (with tool_call_id, and the called
        function's name) as transformers passes them. Otherwise sgnb's fallback: the tools are described in the
        system message (`sgnb.tools.tools_prompt`), past calls are written into the assistant's content in sgnb's
        format (<tool_call>...</tool_call>), and a tool result is a "tool" message if the template takes that role, else
        a user message holding <tool_response>...</tool_response>."""
        native, tool_role = self._tool_support
        rendered: list[dict[str, Any]] = []
        images: list[Any] = []
        videos: list[Any] = []
        call_names: dict[Any, str] = {}
        for i, m in enumerate(messages):
            role = m.get("role")
            if role not in ("system", "developer", "user", "assistant", "tool"):
                raise APIError(400, f"messages[{i}].role must be system, developer, user, assistant or tool, "
                                    f"got {role!r}", param="messages")
            content = m.get("content")
            if isinstance(content, list):
                pieces, after_text = [], False
                for j, part in enumerate(content):
                    kind = part.get("type") if isinstance(part, dict) else None
                    where = f"messages[{i}].content[{j}]"
                    if kind == "text":
                        pieces += ["\n", str(part.get("text", ""))] if after_text else [str(part.get("text", ""))]
                        after_text = True
                    elif kind in ("image_url", "video_url"):
                        pieces.append(self._media_part(part, kind, where, media, images, videos))
                        after_text = False
                    else:
                        raise APIError(400, f"not supported yet: {where} of type {kind!r} (text, image_url, "
                                            "video_url)", param="messages")
                content = "".join(pieces)
            elif content is None:
                content = ""
            elif not isinstance(content, str):
                raise APIError(400, f"messages[{i}].content must be a string or a list of parts", param="messages")
            msg: dict[str, Any] = {"role": role, "content": content}
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
            if role == "assistant" and m.get("tool_calls"):
                calls = _history_tool_calls(m["tool_calls"], f"messages[{i}]")
                call_names.update((c["id"], c["name"]) for c in calls if c["id"] is not None)
                if native:
                    msg["tool_calls"] = [{**({"id": c["id"]} if c["id"] is not None else {}), "type": "function",
                                          "function": {"name": c["name"], "arguments": c["arguments"]}}
                                         for c in calls]
                else:
                    msg["content"] = "\n".join([content] * bool(content)
                                               + [call_text(c["name"], c["arguments"]) for c in calls])
            elif role == "tool":
                call_id = m.get("tool_call_id")
                if native:
                    if isinstance(call_id, str):
                        msg["tool_call_id"] = call_id
                    if "name" not in msg and isinstance(call_id, str) and call_id in call_names:
                        msg["name"] = call_names[call_id]
                elif not tool_role:
                    msg = {"role": "user", "content": tool_response_text(content)}
            rendered.append(msg)
        tools_kw: dict[str, Any] = {}
        if plan is not None and native:
            tools_kw = {"tools": plan.tools}
        elif plan is not None:
            described = tools_prompt(plan.functions)
            if rendered and rendered[0]["role"] == "system":
                first = rendered[0]["content"]
                rendered[0] = {**rendered[0], "content": f"{first}\n\n{described}" if first else described}
            else:
                rendered.insert(0, {"role": "system", "content": described})
        reserved = {"messages", "add_generation_prompt", "tools", "documents"} & set(template_kwargs or {})
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {sorted(reserved)}", param="chat_template_kwargs")
        try:
            text = self.engine.apply_chat_template(rendered, add_generation_prompt=True,
                                                   **{**(template_kwargs or {}), **tools_kw})
        except Exception as e:
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from e
        return text, images, videos

    @cached_property
    def _tool_support(self) -> tuple[bool, bool]:
        """(whether the chat template renders tools, whether it renders a "tool" role message): sgnb.tools'
        probes over this tokenizer's template."""
        tok = self.engine.tokenizer
        return tool_support(lambda m, g, **kw: tok.apply_chat_template(m, add_generation_prompt=g, **kw))

    async def _tool_sample(self, plan: ToolPlan, text: str, first: AsyncIterator[dict], sp: dict[str, Any],
                           rid: str, lp_kw: dict[str, Any], mm: dict[str, Any],
                           after: str | None = None) -> AsyncIterator[dict]:
        """One choice as engine-like chunks, `tool_steps` driven over the engine: `first` streams the reply's first
        request; a text request's chunks go on as they come ("auto"), and a last chunk (it has "output_ids") holds
        the rest of the content and "tool_calls": the parsed call, or None when the reply is text (or a call cut
        short by max_tokens, whose raw text is then the content). A later request (the call) is read whole."""
        steps = tool_steps(plan, sp, after)
        step = next(steps)
        pieces: list[str] = []
        final: dict[str, Any] = {}
        async with contextlib.aclosing(first) as chunks:  # type: ignore[type-var]
            async for chunk in chunks:
                if "output_ids" in chunk:
                    final = chunk
                    break
                pieces.append(chunk["text"])
                if step.streamed:
                    yield chunk
        head = "".join(pieces)
        sent = len(head) if step.streamed else 0  # the content the chunks gave
        output_ids = list(final["output_ids"])
        decoded: Decoded = (head + final["text"], final["meta_info"])  # (text, meta_info)
        while True:
            try:
                step = steps.send(decoded)
            except StopIteration as done:
                reply: ToolReply = done.value
                break
            try:
                out = await self.engine.async_generate(prompt=text + step.prefix, sampling_params=step.params,
                                                       rid=f"{rid}-call", fit_to_context=False, **lp_kw, **mm)
            except Exception as e:
                raise _engine_error(e) from e
            output_ids += out["output_ids"]
            decoded = (out["text"], out["meta_info"])
        yield {**final, "text": reply.content[sent:], "meta_info": reply.meta, "output_ids": output_ids,
               "tool_calls": [reply.call] if reply.call else None}

    @staticmethod
    def _media_part(part: dict[str, Any], kind: str, where: str, media: _Media, images: list[Any],
                    videos: list[Any]) -> str:
        """An image_url / video_url content part -> the model's token for it; the item joins images / videos."""
        spec = part.get(kind)
        if isinstance(spec, str):  # some clients send the URL alone
            spec = {"url": spec}
        if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
            raise APIError(400, f'{where}.{kind} must be {{"url": "data:..."}}', param="messages")
        if kind == "image_url":
            token = media.check_model("image", "messages")
            images.append(media.item(spec["url"], "image", f"{where}.image_url.url"))
        else:
            token = media.check_model("video", "messages")
            item = {"url": spec["url"], **({"num_frames": spec["num_frames"]} if "num_frames" in spec else {})}
            videos.append(media.item(item, "video", f"{where}.video_url"))
        return token


def _message_chars(messages: list[dict[str, Any]]) -> int:
    """The characters of text in the messages' contents (strings and text parts; media parts are not text)."""
    total = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return total


async def _collect(stream: AsyncIterator[dict]) -> tuple[str, dict]:
    """A choice's whole text and its last chunk."""
    pieces, final = [], {}
    async with contextlib.aclosing(stream) as chunks:  # type: ignore[type-var]
        async for chunk in chunks:
            pieces.append(chunk["text"])
            if "output_ids" in chunk:
                final = chunk
    return "".join(pieces), final


def _text_delta(splitter: ReasoningStream | None, text: str, last: bool) -> dict[str, Any]:
    """A streamed chunk's text as a chat delta: with a reasoning splitter, the thinking as reasoning_content and the
    rest as content (what the splitter holds back is given at the last chunk)."""
    if splitter is None:
        return {"content": text} if text or not last else {}
    reasoning, answer = splitter.feed(text)
    if last:
        more_r, more_a = splitter.finish()
        reasoning, answer = reasoning + more_r, answer + more_a
    return {**({"reasoning_content": reasoning} if reasoning else {}), **({"content": answer} if answer else {})}


def _reply_message(text: str, fmt: ReasoningFormat | None) -> dict[str, Any]:
    """A chat reply: with a reasoning format, its thinking as reasoning_content (None when there was none)."""
    if fmt is None:
        return {"role": "assistant", "content": text}
    reasoning, answer = split_reasoning(text, fmt)
    return {"role": "assistant", "content": answer, "reasoning_content": reasoning or None}


def _tool_message(content: str, final: dict[str, Any], fmt: ReasoningFormat | None = None) -> dict[str, Any]:
    """A reply that may hold a call; with a reasoning format, its thinking as reasoning_content."""
    message = _reply_message(content, fmt)
    calls = final.get("tool_calls")
    if not calls:
        return message
    return {**message, "content": message["content"] if message["content"].strip() else None, "tool_calls": calls}


def _tool_finish(final: dict[str, Any]) -> dict[str, Any]:
    return {"finish_reason": "tool_calls", "matched_stop": None} if final.get("tool_calls") else _finish(final)
