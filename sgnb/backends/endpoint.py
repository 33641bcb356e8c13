"""RuntimeEndpoint: a program's backend over SGLang's native HTTP API (`sgnb serve`, an SGLang server or router).

    backend = RuntimeEndpoint("http://localhost:30000")

Speaks /generate (one prompt, a batch, or an SSE stream), /get_model_info, /get_server_info, /flush_cache and
/abort_request, so the same program runs in-process (`Runtime`) or against a remote server unchanged.
Thread-safe: each calling thread gets its own HTTP session.

Images and videos go with every request of a program that has them (`image_data`, `video_data`, SGLang's
fields) as data: URLs: local files are read and encoded here, by the client, since the server need not see this
machine's files (`sgnb serve` reads none); http(s) URLs go as they are, for servers that fetch them. A video
sampled to other than 8 frames goes as {"url": data URL, "num_frames": n}, which `sgnb serve` understands.
The image (video) token comes from the server's /get_model_info ("image_token", "video_token"; else "<image>"
when it says "has_image_understanding").
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from functools import cached_property
from typing import Any

import requests

from sgnb.backends._select import select_by_logprobs
from sgnb.backends.base import Backend, BackendError, ChoiceDecision, GenContext, RequestAborted
from sgnb.backends.runtime import with_global_sampling
from sgnb.chat_template import NAMED, ChatTemplate, derive_from_jinja, named_template, template_for_model_name
from sgnb.engine.meta_info import FinishReason, MetaInfo
from sgnb.engine.scoring import start_len
from sgnb.media import DEFAULT_NUM_FRAMES, IMAGE_MARKER, Media, data_url
from sgnb.sampling import REPORTING, GenParams


class RuntimeEndpoint(Backend):
    """`RuntimeEndpoint(base_url, api_key=None, timeout=600.0, chat_template=None, chat_template_name=None)`.

    Contacts the server once at construction (GET /get_model_info), so a wrong URL fails here, not mid-program.
    `chat_template` (a ChatTemplate or a name) or `chat_template_name` (SGLang's keyword: a name in
    sgnb.chat_template.NAMED, which holds SGLang's names for the common formats) overrides the template the
    server's model ships, which is the default.
    """

    fetches_urls = True  # an http(s) image URL goes as it is: the server decides (sgnb serve refuses it: a 400)

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0,
                 chat_template: ChatTemplate | str | None = None, verify: bool | str | None = None,
                 chat_template_name: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.verify = verify
        self._local = threading.local()
        if chat_template_name is not None:
            if chat_template is not None:
                raise ValueError("give chat_template or chat_template_name, not both")
            chat_template = chat_template_name
        if isinstance(chat_template, str):
            chat_template = named_template(chat_template)
        self._template_override = chat_template
        self.model_info: dict[str, Any] = self._get("/get_model_info")
        info = self.model_info
        self.image_token = info.get("image_token") or (IMAGE_MARKER if info.get("has_image_understanding") else None)
        self.video_token = info.get("video_token")

    # ---- HTTP --------------------------------------------------------------------------------------------
    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            if self.api_key:
                session.headers["Authorization"] = f"Bearer {self.api_key}"
            if self.verify is not None:
                session.verify = self.verify
        return session

    def _call(self, method: str, path: str, payload: dict[str, Any] | None = None,
              stream: bool = False) -> requests.Response:
        url = self.base_url + path
        try:
            res = self._session().request(method, url, json=payload, stream=stream,
                                          timeout=(min(self.timeout, 30.0), self.timeout))
        except requests.RequestException as e:
            raise BackendError(f"{method} {url} failed: {e}") from e
        if res.status_code != 200:
            raise BackendError(f"{method} {url} -> HTTP {res.status_code}: {_error_message(res)}")
        return res

    def _get(self, path: str) -> Any:
        return self._call("GET", path).json()

    def _post(self, path: str, payload: dict[str, Any]) -> Any:
        res = self._call("POST", path, payload)
        try:
            return res.json()
        except ValueError:
            return res.text

    def _generate(self, payload: dict[str, Any], rid: str | None = None) -> Any:
        """POST /generate; an interrupted wait (KeyboardInterrupt) aborts the request on the server."""
        try:
            out = self._post("/generate", payload)
        except BackendError:
            raise
        except BaseException:  # an interrupted wait
            if rid is not None:
                self.abort(rid)
            raise
        for item in out if isinstance(out, list) else [out]:
            _raise_if_failed(item)
        return out

    # ---- Backend -----------------------------------------------------------------------------------------
    def get_model_name(self) -> str:
        return str(self.model_info.get("model_path") or self.model_info.get("model_name") or "unknown")

    @property
    def reasoning_parser(self) -> str | None:
        """The server's reasoning format (`sgnb serve --reasoning-parser`): separate_reasoning's default."""
        value = self.model_info.get("reasoning_parser")
        return str(value) if value else None

    @cached_property
    def _template(self) -> ChatTemplate:
        """The override, else the server's role prefixes, else its Jinja chat template (rendered here with
        probe conversations, as Runtime does), else a guess from the model path."""
        if self._template_override is not None:
            return self._template_override
        info = self.model_info
        roles = info.get("role_prefix_and_suffix")
        if isinstance(roles, dict) and roles:
            return ChatTemplate(str(info.get("chat_template_name") or self.get_model_name()),
                                {r: (p, s) for r, (p, s) in roles.items()},
                                info.get("default_system_prompt"), tuple(info.get("chat_stop_str") or ()))
        source = info.get("chat_template")
        if isinstance(source, str) and source in NAMED:
            return NAMED[source]
        if isinstance(source, str) and "{%" in source:
            try:
                return _template_from_jinja(source, info, self.get_model_name())
            except Exception:  # a template that rejects the probe conversations: fall back to the name
                pass
        return template_for_model_name(self.get_model_name())

    def get_chat_template(self) -> ChatTemplate:
        return self._template

    def cache_prefix(self, prefix: str, images: list[Media] | None = None) -> None:
        if prefix:
            self._generate({"text": prefix, "sampling_params": {"max_new_tokens": 0}, **_media_fields(images or [])})

    def _payload(self, ctx: GenContext, params: GenParams) -> dict[str, Any]:
        data: dict[str, Any] = {"text": ctx.text, "sampling_params": with_global_sampling(params.sampling_dict()),
                                "rid": ctx.rid}
        for key in REPORTING:
            value = getattr(params, key)
            if value is not None:
                data[key] = value
        return {**data, **_media_fields(ctx.images)}

    def generate(self, ctx: GenContext, params: GenParams) -> tuple[str, MetaInfo]:
        out = self._generate(self._payload(ctx, params), ctx.rid)
        return out["text"], out["meta_info"]

    def generate_samples(self, ctx: GenContext, params: GenParams) -> list[tuple[str, MetaInfo]]:
        out = self._generate(self._payload(ctx, params), ctx.rid)  # n > 1: the server answers a list
        return [(o["text"], o["meta_info"]) for o in (out if isinstance(out, list) else [out])]

    @cached_property
    def _incremental(self) -> bool:
        """Whether the server streams only what is new per chunk (SGLang's --incremental-streaming-output, which
        its /get_server_info tells); otherwise the text and logprobs so far, as by default."""
        try:
            return bool(self._get("/get_server_info").get("incremental_streaming_output"))
        except (BackendError, ValueError, AttributeError):
            return False

    def generate_stream(self, ctx: GenContext, params: GenParams) -> Iterator[tuple[str, MetaInfo]]:
        """Yields the new text per SSE chunk with the gen's meta_info so far (its output logprobs all of them,
        whether the server sends the text and logprobs so far, SGLang's default, or only the new ones)."""
        payload = {**self._payload(ctx, params), "stream": True}
        incremental = self._incremental
        res = self._call("POST", "/generate", payload, stream=True)
        finished = False
        try:
            sent = 0
            seen: dict[str, list] = {}  # incremental: the output (top) logprobs so far
            for line in res.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                body = line[5:].strip()
                if body == b"[DONE]":
                    break
                chunk = json.loads(body)
                if "error" in chunk:
                    raise BackendError(f"stream from {self.base_url} failed: {_message_of(chunk)}")
                meta: MetaInfo = chunk.get("meta_info", {})
                text = chunk.get("text", "")
                if meta.get("finish_reason") is not None:
                    finished = True
                    _raise_if_failed(chunk, text if incremental else text[sent:])
                if incremental:
                    for key in ("output_token_logprobs", "output_top_logprobs"):
                        if meta.get(key) is not None:
                            seen[key] = seen.get(key, []) + list(meta[key])
                            meta = {**meta}  # a new dict: the chunk's stays as it came
                            meta[key] = seen[key]
                    if text or finished:
                        yield text, meta
                    continue
                if len(text) > sent or finished:
                    yield text[sent:], meta
                    sent = max(sent, len(text))
            finished = True
        finally:
            res.close()  # closing the connection early makes the server abort the request
            if not finished:
                self.abort(ctx.rid)

    def select(self, ctx: GenContext, choices: list[str], temperature: float,
               choices_method: str) -> ChoiceDecision:
        """As SGLang's RuntimeEndpoint.select (engine/scoring.py has the method): the prefix's token count from the
        server, then one batched /generate of prefix + each choice with logprob_start_len = max(prompt_len - 2, 0)
        (and, for unconditional_likelihood_normalized, one of each choice's scored tokens alone)."""
        outs: list[dict[str, Any]] = []

        def conditional() -> list[list[tuple]]:
            media = _media_fields(ctx.images)
            head = self._generate({"text": ctx.text, "sampling_params": {"max_new_tokens": 0}, **media})
            start = start_len(int(head["meta_info"]["prompt_tokens"]))  # as the server counts (images too)
            # a batch takes one image_data (video_data) entry per prompt: every prompt holds the prefix's media
            per_prompt = {k: [v] * len(choices) for k, v in media.items()}
            outs.extend(self._generate({"text": [ctx.text + c for c in choices],
                                        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
                                        "return_logprob": True, "logprob_start_len": start,
                                        "return_text_in_logprobs": True, **per_prompt}))
            return [_entries(o) for o in outs]

        def unconditional(rows: list[list[tuple]]) -> list[list[tuple]]:
            alone = self._generate({"input_ids": [[e[1] for e in row] for row in rows],
                                    "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                                    "logprob_start_len": 0, "return_text_in_logprobs": True})
            return [_entries(o) for o in alone]

        decision = select_by_logprobs(ctx, choices, choices_method, conditional, unconditional)
        decision.meta_info.update({
            "output_token_logprobs": [[tuple(e) for e in o["meta_info"].get("output_token_logprobs") or []]
                                      for o in outs],
            "cached_tokens": sum(o["meta_info"].get("cached_tokens", 0) for o in outs),
            "prompt_tokens": sum(o["meta_info"].get("prompt_tokens", 0) for o in outs),
        })
        return decision

    def abort(self, rid: str) -> None:
        try:
            self._session().post(self.base_url + "/abort_request", json={"rid": rid}, timeout=10)
        except requests.RequestException:
            pass  # best effort: the server may be gone already

    def flush_cache(self) -> bool:
        self._post("/flush_cache", {})
        return True

    def get_server_info(self) -> dict[str, Any]:
        return self._get("/get_server_info")

    def shutdown(self) -> None:
        """Close this thread's HTTP session (the server keeps running: it is not ours to stop)."""
        session = getattr(self._local, "session", None)
        if session is not None:
            session.close()
            self._local.session = None


def _template_from_jinja(source: str, info: dict[str, Any], name: str) -> ChatTemplate:
    from sgnb.engine.tokenizer import compile_chat_template

    compiled = compile_chat_template(source)
    tokens = {k: info[k] for k in ("bos_token", "eos_token") if isinstance(info.get(k), str)}
    variables = {"tools": None, "documents": None, **tokens}
    return derive_from_jinja(lambda m, g, **kw: compiled.render(messages=m, add_generation_prompt=g,
                                                               **{**variables, **kw}), name)


def _entries(out: dict[str, Any]) -> list[tuple]:
    """A /generate result's input_token_logprobs as (logprob, token id, text) tuples (JSON sends lists)."""
    return [tuple(e) for e in out["meta_info"].get("input_token_logprobs") or []]


def _message_of(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)
        return str(err if err is not body else body.get("message") or body.get("detail") or body)
    return str(body)


def _error_message(res: requests.Response) -> str:
    try:
        return _message_of(res.json())
    except ValueError:
        return res.text.strip() or res.reason


def _raise_if_failed(out: dict[str, Any], new_text: str | None = None) -> None:
    """RequestAborted when the request was aborted, with the text the caller has not seen (`new_text`; by
    default the whole output)."""
    meta: MetaInfo = out.get("meta_info") or MetaInfo()
    reason: FinishReason = meta.get("finish_reason") or {}
    if isinstance(reason, dict) and reason.get("type") == "abort":
        detail = reason.get("message") or meta.get("error") or "aborted"
        raise RequestAborted(f"request {meta.get('id')} was aborted: {detail}",
                             out.get("text", "") if new_text is None else new_text, meta)


def _media_fields(media: list[Media]) -> dict[str, Any]:
    """image_data / video_data of one prompt: a single item alone (what every SGLang version takes), several
    as a list, in the order of their tokens."""
    images = [data_url(m) for m in media if m.kind == "image"]
    videos = [data_url(m) if m.num_frames in (None, DEFAULT_NUM_FRAMES)
              else {"url": data_url(m), "num_frames": m.num_frames} for m in media if m.kind == "video"]
    fields: dict[str, Any] = {}
    for key, items in (("image_data", images), ("video_data", videos)):
        if items:
            fields[key] = items[0] if len(items) == 1 else items
    return fields
