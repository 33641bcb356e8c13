"""DSPy on sgnb: `sgnb.dspy.LM` runs DSPy programs on an sgnb backend, in-process, without a server.

    import dspy, sgnb.dspy
    lm = sgnb.dspy.LM(sgnb.Runtime("smollm2"), temperature=0)  # or an Engine, a model path, any sgnb Backend
    dspy.configure(lm=lm, adapter=dspy.JSONAdapter())
    dspy.ChainOfThought("question -> answer: int")(question="What is 2 + 3?")

Each DSPy call is a small sgnb program (`dspy_call`: the messages as roles, then one assistant `gen`), so it
goes through the backend like any program: on the in-process engine it is batched with the other requests and
shows in the engine's events and radix tree. `response_format` (a pydantic model, as DSPy's JSONAdapter sends
it, or OpenAI's {"type": "json_schema" | "json_object"} dicts, or a bare JSON schema) becomes the gen's
`json_schema`: constrained decoding, so the reply parses on any model (unless max_tokens cuts it short). The
LM says it supports response schemas, so JSONAdapter (and ChatAdapter's fallback to it) sends one.

Sampling keyword arguments (on the LM or per call, DSPy's usual way): max_tokens (max_completion_tokens),
temperature, top_p, stop, n (forks of the conversation), frequency_penalty, presence_penalty, logprobs and
top_logprobs, and SGLang's top_k, min_p, repetition_penalty, min_tokens. Other keys are ignored. Native tool
calling is not offered here (DSPy then describes tools in the prompt, as it does for any such LM).

This is DSPy's BaseLM.forward() plugin interface (the `sgnb[dspy]` extra: dspy 3.4). DSPy 3.4 emits a
DeprecationWarning about it: 3.5 replaces the interface by engines (complete(Request) -> Response).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

try:
    import dspy
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("sgnb.dspy needs DSPy: pip install 'sgnb[dspy]'") from e

from sgnb.backends.base import Backend
from sgnb.engine.meta_info import MetaInfo
from sgnb.function import function, get_default_backend
from sgnb.logprobs import chat_logprobs
from sgnb.primitives import assistant, gen, image

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_SAMPLING = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
             "top_p": "top_p", "stop": "stop", "frequency_penalty": "frequency_penalty",
             "presence_penalty": "presence_penalty", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens"}


@function
def dspy_call(s: Any, messages: list[dict[str, Any]], replies: int, gen_kwargs: dict[str, Any]) -> list[Any]:
    """One DSPy LM call as an sgnb program: the conversation, then `replies` assistant replies (forks when more
    than one; the name is not `n`, which run() takes as its sampling parameter, as SGLang's does)."""
    for i, m in enumerate(messages):
        role = _ROLES.get(m.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise ValueError(f"messages[{i}]: role {m.get('role')!r} is not supported by sgnb.dspy.LM "
                             "(system, developer, user, assistant)")
        with getattr(s, role)():  # s.user() etc. without content: one message of the appends inside
            for part in _parts(m.get("content"), i):
                s += part
    branches = list(s.fork(replies)) if replies > 1 else [s]
    for b in branches:
        b += assistant(gen("answer", **gen_kwargs))
    return branches


def _parts(content: Any, i: int) -> list[Any]:
    """A message's content as program appends: text, and sgnb images for image_url parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content] if content else []
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}].content must be a string or a list of parts")
    out: list[Any] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if out and isinstance(out[-1], str):
                out.append("\n")
            out.append(str(part.get("text", "")))
        elif kind == "image_url":
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else spec
            out.append(image(url))
        else:
            raise ValueError(f"messages[{i}].content[{j}]: part type {kind!r} is not supported by sgnb.dspy.LM "
                             "(text, image_url)")
    return out


def _json_schema(fmt: Any) -> str | None:
    """response_format -> the gen's json_schema (None: unconstrained)."""
    if fmt is None:
        return None
    if isinstance(fmt, type) and hasattr(fmt, "model_json_schema"):  # a pydantic model (DSPy's JSONAdapter)
        return json.dumps(fmt.model_json_schema())
    if isinstance(fmt, str):
        return fmt
    if isinstance(fmt, dict):
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return '{"type": "object"}'
        if kind == "json_schema":
            spec = fmt.get("json_schema") or {}
            return json.dumps(spec.get("schema", {}) if isinstance(spec, dict) else {})
        return json.dumps(fmt)  # a JSON schema itself
    raise TypeError(f"response_format must be a pydantic model, a dict or a JSON string, got {type(fmt).__name__}")


def _logprobs(meta: MetaInfo) -> dict[str, Any] | None:
    """OpenAI's chat logprobs of a result, None where the backend returned none."""
    return None if meta.get("output_token_logprobs") is None else chat_logprobs(meta)


class LM(dspy.BaseLM):
    """A DSPy language model on an sgnb backend.

    `backend`: an sgnb Backend (`sgnb.Runtime(...)`, `sgnb.RuntimeEndpoint(url)`, ...), an in-process
    `sgnb.Engine`, or a model path for a new Runtime; None takes sgnb's default backend (set_default_backend),
    else starts a Runtime on the default model. `max_tokens` defaults to 512 (a constrained JSON reply that runs
    out of tokens does not parse); other keyword arguments are default sampling values (see the module doc).
    DSPy's response cache is off by default: the engine's prefix cache makes repeats cheap anyway.
    """

    def __init__(self, backend: Any = None, *, model: str | None = None, model_type: str = "chat",
                 temperature: float | None = None, max_tokens: int | None = 512, cache: bool = False,
                 num_retries: int = 0, callbacks: list[Any] | None = None, **kwargs: Any) -> None:
        if model_type != "chat":
            raise ValueError("sgnb.dspy.LM is a chat model (model_type='chat')")
        self.backend = _resolve(backend, model)
        super().__init__(model=model or f"sgnb/{self.backend.get_model_name()}", model_type="chat",
                         temperature=temperature, max_tokens=max_tokens, cache=cache, callbacks=callbacks,
                         num_retries=num_retries, **kwargs)

    # -- what DSPy's adapters ask
    @property
    def supports_response_schema(self) -> bool:
        return True

    @property
    def supports_function_calling(self) -> bool:
        return False

    @property
    def supported_params(self) -> set[str]:
        return {"response_format", "n", "logprobs", "top_logprobs", *_SAMPLING}

    # -- calls
    def forward(self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
                **kwargs: Any) -> Any:
        from openai.types.chat import ChatCompletion

        options = {**self.kwargs, **kwargs}
        if options.get("tools"):
            raise NotImplementedError("sgnb.dspy.LM does not do native tool calling: leave tools to DSPy's "
                                      "adapters (they describe them in the prompt)")
        if messages is None:
            messages = [{"role": "user", "content": prompt or ""}]
        n = options.get("n") or 1
        state = dspy_call.run(messages=list(messages), replies=int(n), gen_kwargs=_gen_kwargs(options),
                              backend=self.backend)
        state.sync()  # raises the program's error (a bad message, a backend failure)
        branches = state.ret_value
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for k, branch in enumerate(branches):
            text = branch["answer"]
            meta: MetaInfo = branch.get_meta_info("answer") or MetaInfo()
            reason = (meta.get("finish_reason") or {}).get("type")
            choices.append({"index": k, "message": {"role": "assistant", "content": text},
                            "finish_reason": "length" if reason == "length" else "stop",
                            "logprobs": _logprobs(meta) if options.get("logprobs") else None})
            prompt_tokens = prompt_tokens or int(meta.get("prompt_tokens") or 0)
            completion_tokens += int(meta.get("completion_tokens") or 0)
        return ChatCompletion.model_validate({
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}})

    async def aforward(self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
                       **kwargs: Any) -> Any:
        return await asyncio.to_thread(self.forward, prompt, messages, **kwargs)

    def __repr__(self) -> str:
        return f"sgnb.dspy.LM({self.model!r}, backend={type(self.backend).__name__})"


def _resolve(backend: Any, model: str | None) -> Backend:
    from sgnb.backends.runtime import Runtime

    if isinstance(backend, Backend):
        return backend
    if isinstance(backend, str):
        return Runtime(backend)
    if backend is not None:  # an Engine
        return Runtime(engine=backend)
    if model is not None and model.startswith("sgnb/"):
        return Runtime(model[len("sgnb/"):])
    return get_default_backend() or Runtime()


def _gen_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """DSPy / OpenAI call options -> gen() arguments."""
    kw = {_SAMPLING[k]: v for k, v in options.items() if k in _SAMPLING and v is not None}
    schema = _json_schema(options.get("response_format"))
    if schema is not None:
        kw["json_schema"] = schema
    if options.get("logprobs"):
        kw.update(return_logprob=True, top_logprobs_num=int(options.get("top_logprobs") or 0),
                  return_text_in_logprobs=True)
    return kw


__all__ = ["LM", "dspy_call"]
