"""OpenAI: a program's backend over the OpenAI API (or any OpenAI-compatible server: `sgnb serve`, SGLang, vLLM).

    backend = OpenAI("gpt-4o-mini")                                   # a chat model
    backend = OpenAI("smollm2", base_url="http://localhost:30000/v1", api_key="x", is_chat_model=False)

Completion models get the program's text as the prompt and can score `select` choices (echoed prompt
logprobs). Chat models get the program's messages; they write assistant turns only and cannot score choices.

Images and videos (chat models): image() writes IMAGE_MARKER ("<image>") into the text and each message's
content is sent as OpenAI content parts, split on the markers: text parts and
`{"type": "image_url", "image_url": {"url": data URL}}` in order (local files are read and encoded here; an
http(s) URL goes as it is, for the API to fetch). A video becomes `{"type": "video_url", "video_url": {"url":
data URL, "num_frames": n}}`: not part of OpenAI's API but an extension that `sgnb serve` (and some other
OpenAI-compatible servers) understand; OpenAI itself refuses it. Completion models take no images (the
completions API has no image input): image() fails at its line.

Speculative API execution (`@function(num_api_spec_tokens=N)`, completion models): a gen asks the API once for
max(N, max_tokens) tokens without its stop strings and keeps the continuation. When the program then appends
exactly the constant text the model had already written and asks for the next gen, that gen is served from the
kept text with no API call. The kept text lives in the program's scratch space (ctx.program), so concurrent
programs and forks never share it. `backend.usage` counts calls and tokens (thread-safe).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from sgnb.backends._api_common import Usage, api_errors, check_assistant_turn, check_one_sample, token_counts
from sgnb.backends._select import select_by_logprobs
from sgnb.backends.base import Backend, BackendError, ChoiceDecision, GenContext
from sgnb.chat_template import NAMED, ChatTemplate, template_for_model_name
from sgnb.engine.meta_info import FinishReason, MetaInfo
from sgnb.engine.scoring import start_len
from sgnb.media import IMAGE_MARKER, VIDEO_MARKER, Media, data_url, with_media_parts
from sgnb.sampling import OPENAI_NAMES, OPENAI_STANDARD, SAMPLING_DEFAULTS, SAMPLING_FIELDS, GenParams

if TYPE_CHECKING:
    from sgnb.tools import ToolPlan

COMPLETION_MODEL_NAMES = ("gpt-3.5-turbo-instruct", "davinci-002", "babbage-002")

# create() arguments as they are (max tokens, n and stop have their own rules)
_DIRECT = tuple(name for name in OPENAI_STANDARD if name not in ("max_new_tokens", "n", "stop"))
# constrained decoding: other servers take it in extra_body, OpenAI refuses it (json_schema has its own rule)
_CONSTRAINTS = ("regex", "ebnf", "stop_regex")
# SGLang's other sampling values, which OpenAI's API lacks: sent to other servers in extra_body (by their OpenAI
# names) when they differ from the engine's defaults, ignored with a warning on OpenAI
_SOFT_EXTRAS = tuple(name for name in SAMPLING_FIELDS
                     if name not in (*OPENAI_STANDARD, *_CONSTRAINTS, "json_schema"))
_SPEC_KEY = "openai_spec"
_USAGE_KEY = "openai_usage"


def guess_is_chat_model(model: str) -> bool:
    """Completion models: OpenAI's legacy ones (`*-instruct`, davinci, babbage); anything else is a chat model."""
    m = model.lower()
    return not (m in COMPLETION_MODEL_NAMES or m.endswith("-instruct") or "davinci" in m or "babbage" in m)


class OpenAI(Backend):
    """`OpenAI(model, base_url=None, api_key=None, is_chat_model=None, chat_template=None, **client_kwargs)`.

    client_kwargs go to `openai.OpenAI` (timeout, max_retries, organization, ...). is_chat_model defaults to a
    guess from the model name (see guess_is_chat_model).
    """

    fetches_urls = True  # image URLs go to the API as they are
    api_name = "OpenAI"  # whose API refuses what it lacks (see is_openai), in messages

    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None,
                 is_chat_model: bool | None = None, chat_template: ChatTemplate | str | None = None,
                 **client_kwargs: Any) -> None:
        import openai

        self._openai = openai
        if base_url is not None:
            client_kwargs["base_url"] = base_url
        try:
            self.client = self._make_client(api_key, client_kwargs)
        except openai.OpenAIError as e:
            raise BackendError(f"cannot create the {self.api_name} client: {e}") from e
        self.model = model
        self.is_chat_model = guess_is_chat_model(model) if is_chat_model is None else bool(is_chat_model)
        # OpenAI's own API (not an OpenAI-compatible server): SGLang's extras are ignored, constraints refused
        self.is_openai = "api.openai.com" in str(self.client.base_url)
        if isinstance(chat_template, str):
            chat_template = NAMED[chat_template]
        self._template = chat_template or template_for_model_name(model)
        self.usage = Usage("spec_hits")
        self._warned: set[str] = set()

    def _make_client(self, api_key: str | None, client_kwargs: dict[str, Any]) -> Any:
        """What the calls go through: `client.chat.completions.create` and `client.completions.create`, as
        openai.OpenAI's (which it is here)."""
        return self._openai.OpenAI(api_key=api_key, **client_kwargs)

    @property
    def token_usage(self) -> Usage:
        """SGLang's name for `usage`: `.prompt_tokens`, `.completion_tokens`, `.reset()`."""
        return self.usage

    def get_model_name(self) -> str:
        return self.model

    def get_chat_template(self) -> ChatTemplate:
        return self._template

    @property
    def image_token(self) -> str | None:  # type: ignore[override]
        return IMAGE_MARKER if self.is_chat_model else None

    @property
    def video_token(self) -> str | None:  # type: ignore[override]
        return VIDEO_MARKER if self.is_chat_model else None

    def media_token(self, media: Media) -> str:
        if not self.is_chat_model:
            raise BackendError(f"{self.model} is an OpenAI completion model: the completions API takes no "
                               f"{media.kind}s; use a chat model (is_chat_model=True)")
        return super().media_token(media)

    def get_server_info(self) -> dict[str, Any]:
        return {"backend": type(self).__name__, "model": self.model, "base_url": str(self.client.base_url),
                "is_chat_model": self.is_chat_model, "usage": dict(self.usage)}

    # ---- calls and accounting ----------------------------------------------------------------------------
    def _api_errors(self, what: str) -> AbstractContextManager[None]:
        return api_errors(what, self._openai.APIStatusError, self._openai.OpenAIError)

    def _count(self, ctx: GenContext | None, usage: Any, calls: int = 1, spec_hits: int = 0) -> None:
        add = {"calls": calls, "spec_hits": spec_hits, **token_counts(usage)}
        self.usage.add(add)
        if ctx is not None:
            mine = ctx.program.setdefault(_USAGE_KEY, dict.fromkeys(self.usage, 0))
            for k, v in add.items():
                mine[k] += v

    def _completion(self, ctx: GenContext | None, what: str, **kwargs: Any) -> Any:
        with self._api_errors(what):
            resp = self.client.completions.create(model=self.model, **kwargs)
        self._count(ctx, resp.usage)
        return resp

    # ---- parameters --------------------------------------------------------------------------------------
    def _kwargs(self, params: GenParams) -> dict[str, Any]:
        """create() arguments for a gen; refuses what this endpoint cannot honour."""
        check_one_sample(params, self.api_name)
        kw: dict[str, Any] = {}
        if params.max_new_tokens is not None:
            kw[self._max_tokens_arg()] = params.max_new_tokens
        if params.stop:
            kw["stop"] = list(params.stop)
        for name in _DIRECT:
            value = getattr(params, name, None)  # GenParams has no seed
            if value is not None:
                kw[name] = value
        extra: dict[str, Any] = {}
        for name in _SOFT_EXTRAS:
            value = getattr(params, name)
            if value is not None and value != SAMPLING_DEFAULTS[name]:
                if self.is_openai:
                    self._warn_once(name, f"{name}={value!r} is not a parameter of the {self.api_name} API; "
                                          "it is ignored")
                else:
                    extra[OPENAI_NAMES.get(name, name)] = list(value) if isinstance(value, tuple) else value
        for name in _CONSTRAINTS:
            value = getattr(params, name)
            if value is not None:
                if self.is_openai:
                    raise BackendError(f"{name} (constrained decoding) is not available on the {self.api_name} "
                                       "API; use an sgnb/SGLang server (RuntimeEndpoint) for it")
                extra[name] = list(value) if isinstance(value, tuple) else value
        if params.json_schema is not None:
            if self.is_chat_model:
                kw["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "output", "schema": json.loads(params.json_schema)}}
            elif self.is_openai:
                raise BackendError("json_schema on an OpenAI completion model is not available; use a chat model "
                                   "(response_format) or an sgnb/SGLang server")
            else:
                extra["json_schema"] = params.json_schema
        if extra:
            kw["extra_body"] = extra
        return kw

    def _max_tokens_arg(self) -> str:
        return "max_completion_tokens" if self.is_chat_model and self.is_openai else "max_tokens"

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=4)

    def _chat_messages(self, ctx: GenContext) -> list[dict[str, Any]]:
        check_assistant_turn(ctx)
        messages = [dict(m) for m in ctx.messages]
        if ctx.in_role == "assistant" and messages and messages[-1]["role"] == "assistant" \
                and not messages[-1]["content"]:
            messages.pop()  # the open, still empty assistant turn is what the model writes
        if not messages:
            raise BackendError("a chat model needs messages: write system/user roles before the gen")
        if ctx.images:
            try:
                messages = with_media_parts(messages, ctx.images, _content_part)
            except ValueError as e:
                raise BackendError(str(e)) from None
        return messages

    # ---- generate ----------------------------------------------------------------------------------------
    def generate(self, ctx: GenContext, params: GenParams) -> tuple[str, MetaInfo]:
        kwargs = self._kwargs(params)
        if self.is_chat_model:
            with self._api_errors("chat completion"):
                resp = self.client.chat.completions.create(model=self.model, messages=self._chat_messages(ctx),
                                                           n=1, **kwargs)
            self._count(ctx, resp.usage)
            choice = resp.choices[0]
            return choice.message.content or "", _meta(resp, choice)
        constrained = any(getattr(params, k) is not None for k in (*_CONSTRAINTS, "json_schema"))
        if ctx.num_api_spec_tokens and not constrained:
            return self._spec_generate(ctx, params, kwargs)
        resp = self._completion(ctx, "completion", prompt=ctx.text, n=1, **kwargs)
        choice = resp.choices[0]
        return choice.text, _meta(resp, choice)

    def generate_samples(self, ctx: GenContext, params: GenParams) -> list[tuple[str, MetaInfo]]:
        """n samples in one call (the API's n): one (text, meta_info) per choice (the token counts in each are
        the call's)."""
        kwargs = self._kwargs(dataclasses.replace(params, n=None))
        if self.is_chat_model:
            with self._api_errors("chat completion"):
                resp = self.client.chat.completions.create(model=self.model, messages=self._chat_messages(ctx),
                                                           n=params.n, **kwargs)
            self._count(ctx, resp.usage)
            texts = [c.message.content or "" for c in resp.choices]
        else:
            resp = self._completion(ctx, "completion", prompt=ctx.text, n=params.n, **kwargs)
            texts = [c.text for c in resp.choices]
        return [(text, _meta(resp, c)) for c, text in sorted(zip(resp.choices, texts), key=lambda ct: ct[0].index)]

    def generate_tool_call(self, ctx: GenContext, params: GenParams,
                           plan: ToolPlan) -> tuple[str, list[dict[str, Any]], MetaInfo]:
        """A chat model is sent the tools and tool_choice (as given) and returns OpenAI's tool_calls."""
        kwargs = self._kwargs(params)
        with self._api_errors("chat completion with tools"):
            resp = self.client.chat.completions.create(model=self.model, messages=self._chat_messages(ctx), n=1,
                                                       tools=plan.tools, tool_choice=plan.choice, **kwargs)
        self._count(ctx, resp.usage)
        choice = resp.choices[0]
        calls = [{"id": c.id, "type": "function",
                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                 for c in choice.message.tool_calls or []]
        return choice.message.content or "", calls, _meta(resp, choice)

    def generate_stream(self, ctx: GenContext, params: GenParams) -> Iterator[tuple[str, MetaInfo]]:
        if ctx.num_api_spec_tokens and not self.is_chat_model:
            yield self.generate(ctx, params)
            return
        kwargs = self._kwargs(params)
        with self._api_errors("streaming completion"):
            if self.is_chat_model:
                stream = self.client.chat.completions.create(
                    model=self.model, messages=self._chat_messages(ctx), n=1, stream=True,
                    stream_options={"include_usage": True}, **kwargs)
            else:
                stream = self.client.completions.create(model=self.model, prompt=ctx.text, n=1, stream=True,
                                                        stream_options={"include_usage": True}, **kwargs)
            finish, usage, rid = None, None, None
            try:
                for chunk in stream:
                    rid = chunk.id
                    if getattr(chunk, "usage", None) is not None:
                        usage = chunk.usage
                    if not chunk.choices:
                        continue
                    c = chunk.choices[0]
                    piece = (c.delta.content if self.is_chat_model else c.text) or ""
                    finish = c.finish_reason or finish
                    if piece:
                        yield piece, {"id": rid}
            finally:
                stream.close()
        self._count(ctx, usage)
        meta: MetaInfo = {"id": rid, "finish_reason": {"type": finish}}
        if usage is not None:
            meta.update(_usage_meta(usage))
        yield "", meta

    # ---- speculative API execution -----------------------------------------------------------------------
    def _spec_generate(self, ctx: GenContext, params: GenParams,
                       kwargs: dict[str, Any]) -> tuple[str, MetaInfo]:
        """Serve the gen from the program's kept continuation if the program followed it, else call the API."""
        stops = tuple(params.stop or ())
        max_tokens = params.max_new_tokens if params.max_new_tokens is not None else 16
        call_kwargs = {k: v for k, v in kwargs.items() if k not in ("stop", "max_tokens")}
        key = json.dumps(call_kwargs, sort_keys=True, default=str)
        kept: _Lookahead | None = ctx.program.get(_SPEC_KEY)
        if kept is not None and kept.key == key and ctx.text.startswith(kept.end):
            constant = ctx.text[len(kept.end):]
            if kept.rest.startswith(constant):
                served = kept.advance(len(constant)).take(stops, max_tokens, first=False)
                if served is not None:
                    part, finish, after = served
                    ctx.program[_SPEC_KEY] = after
                    self._count(ctx, None, calls=0, spec_hits=1)
                    return part, {"id": kept.rid, "finish_reason": finish, "speculative": "hit"}
        want = max(ctx.num_api_spec_tokens or 0, max_tokens)
        resp = self._completion(ctx, "completion", prompt=ctx.text, n=1, max_tokens=want, logprobs=1, **call_kwargs)
        choice = resp.choices[0]
        offsets = None
        lp = getattr(choice, "logprobs", None)
        if lp is not None and lp.text_offset:
            # OpenAI counts offsets from the prompt's start; some servers from the completion's
            base = len(ctx.text) if lp.text_offset[0] >= len(ctx.text) else 0
            offsets = [o - base for o in lp.text_offset]
            if offsets[0] != 0 or offsets != sorted(offsets) or offsets[-1] > len(choice.text):
                offsets = None  # not token bounds of this text: cut by stop strings only
        look = _Lookahead(ctx.text, choice.text, offsets, choice.finish_reason == "stop", key, resp.id)
        served = look.take(stops, max_tokens, first=True)
        assert served is not None  # a fresh lookahead always serves its first gen
        part, finish, after = served
        ctx.program[_SPEC_KEY] = after
        meta = _meta(resp, None)
        meta.update({"finish_reason": finish, "speculative": "call"})
        return part, meta

    # ---- select ------------------------------------------------------------------------------------------
    def select(self, ctx: GenContext, choices: list[str], temperature: float,
               choices_method: str) -> ChoiceDecision:
        """Completion models, as Engine.score and RuntimeEndpoint (engine/scoring.py has the method) from echoed
        prompt logprobs: one call echoes the prefix (its token count) and prefix + each choice; the
        unconditional method echoes each choice's scored text alone in a second. Token ids are unknown here
        (None in input_token_logprobs)."""
        if self.is_chat_model:
            raise BackendError("select needs token logprobs of given text, which chat endpoints do not return; "
                               "use a completion model")
        fulls: list[str] = []  # prefix + each choice
        echoed: list[list[tuple[str, float | None, int]]] = []

        def conditional() -> list[list[tuple]]:
            fulls.extend(ctx.text + c for c in choices)
            echoed.extend(self._echo_logprobs(ctx, [ctx.text, *fulls]))
            start = start_len(len(echoed[0]))
            return [[(lp, None, tok) for tok, lp, _ in e[start:]] for e in echoed[1:]]

        def unconditional(rows: list[list[tuple]]) -> list[list[tuple]]:
            # the text from each choice's first scored entry on (the token ids are not known here)
            cut = [e[len(e) - len(row)][2] for e, row in zip(echoed[1:], rows)]
            alone = self._echo_logprobs(ctx, [full[c:] for full, c in zip(fulls, cut)])
            return [[(lp, None, tok) for tok, lp, _ in e] for e in alone]

        return select_by_logprobs(ctx, choices, choices_method, conditional, unconditional,
                                  " (from the endpoint's echoed logprobs)")

    def _echo_logprobs(self, ctx: GenContext, prompts: list[str]) -> list[list[tuple[str, float | None, int]]]:
        """Per prompt: (token text, logprob, start offset) of each of its tokens, echoed (the first token's
        logprob is None)."""
        try:
            resp = self._completion(ctx, "select (echoed prompt logprobs)", prompt=prompts, echo=True, logprobs=1,
                                    max_tokens=1, temperature=0.0)
        except BackendError as e:
            raise BackendError(f"select needs the prompt's token logprobs (echo=True with logprobs), which this "
                               f"endpoint refused: {e}") from e
        echoed = []
        for choice in sorted(resp.choices, key=lambda c: c.index):
            lp = choice.logprobs
            if lp is None or not lp.text_offset:
                raise BackendError("select needs token logprobs of the echoed prompt; the endpoint sent none")
            size = len(prompts[choice.index])
            echoed.append([(lp.tokens[i], lp.token_logprobs[i], o) for i, o in enumerate(lp.text_offset)
                           if o < size])  # the generated token starts at the prompt's end
        return echoed


class _Lookahead:
    """Text the model wrote past the last gen (speculative execution): `rest` continues the program text `end`.
    `offsets` are token start positions within `rest` (None when the server gave no token bounds)."""

    def __init__(self, end: str, rest: str, offsets: list[int] | None, complete: bool, key: str, rid: str) -> None:
        self.end, self.rest, self.offsets, self.complete, self.key, self.rid = end, rest, offsets, complete, key, rid

    def advance(self, n: int) -> _Lookahead:
        """Drop the first n characters of `rest` (text the program has appended itself)."""
        offsets = None if self.offsets is None else [o - n for o in self.offsets if o >= n]
        return _Lookahead(self.end + self.rest[:n], self.rest[n:], offsets, self.complete, self.key, self.rid)

    def take(self, stops: tuple[str, ...], max_tokens: int,
             first: bool) -> tuple[str, FinishReason, _Lookahead] | None:
        """The gen's text from the start of `rest` (cut at a stop or max_tokens, like the API would) and what is
        left after it; None when the kept text ends before the gen would (then a real call is needed)."""
        text = self.rest
        limit = len(text)  # where the gen's max_tokens-th token ends, when token bounds are known
        enough = self.offsets is not None and len(self.offsets) >= max_tokens
        if self.offsets is not None and len(self.offsets) > max_tokens:
            limit = self.offsets[max_tokens]
        # the API stops at the first stop string to complete (and leaves it out), if that is within max_tokens
        hits = sorted((i + len(s), i, s) for s in stops if (i := text.find(s)) != -1)
        if hits and hits[0][0] <= limit:
            _, pos, stop = hits[0]
            return text[:pos], {"type": "stop", "matched": stop}, self.advance(pos)
        if enough:
            return text[:limit], {"type": "length"}, self.advance(limit)
        if self.complete:  # the model ended (EOS) inside the kept text
            return text, {"type": "stop", "matched": None}, self.advance(len(text))
        if first:  # no token bounds and no stop: the whole continuation is the best answer there is
            return text, {"type": "length"}, self.advance(len(text))
        return None


def _content_part(media: Media) -> dict[str, Any]:
    if media.kind == "video":
        return {"type": "video_url", "video_url": {"url": data_url(media), "num_frames": media.num_frames}}
    return {"type": "image_url", "image_url": {"url": data_url(media)}}


def _meta(resp: Any, choice: Any) -> MetaInfo:
    finish: FinishReason = {"type": getattr(choice, "finish_reason", None)}
    matched = getattr(choice, "matched_stop", None)  # SGLang-style servers say which stop string ended it
    if matched is not None:
        finish["matched"] = matched
    meta: MetaInfo = {"id": resp.id, "finish_reason": finish}
    if resp.usage is not None:
        meta.update(_usage_meta(resp.usage))
    return meta


def _usage_meta(usage: Any) -> MetaInfo:
    """Token counts, with the server's prompt cache hits where it reports them (prompt_tokens_details)."""
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cached_tokens": cached or 0}
