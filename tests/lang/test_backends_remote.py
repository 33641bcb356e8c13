"""Remote backends against a real `sgnb serve` on loopback (RuntimeEndpoint, OpenAI) and a canned local
Messages API (Anthropic): greedy results match the in-process Runtime on the same engine."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import sgnb as sgl
from sgnb.backends import Backend, BackendError, GenContext, Runtime
from sgnb.sampling import GenParams

PEOPLE = ("Person 1\nName: Bob\nAge: 30\nJob: baker\n\nPerson 2\nName: Carol\nAge: 41\nJob: nurse\n\n"
          "Person 3\nName: Dan\nAge: 25\nJob: pilot\n\nPerson 4\nName:")
GREEDY = GenParams.build(max_new_tokens=16, temperature=0, stop="\n")
METHODS = ("token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized")


def ctx(text: str, **kw) -> GenContext:
    return GenContext(text, kw.pop("messages", []), kw.pop("rid", "test"), **kw)


@pytest.fixture(scope="module")
def server(engine):
    from sgnb.server import start_server_thread

    handle = start_server_thread(engine, port=0)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def runtime(engine):
    return Runtime(engine=engine)


@pytest.fixture(scope="module")
def endpoint(server):
    return _endpoint(server.url)


def _endpoint(url: str) -> Backend:
    from sgnb.backends import RuntimeEndpoint

    return RuntimeEndpoint(url)


def _openai(server, chat: bool):
    from sgnb.backends import OpenAI

    return OpenAI("smollm2", base_url=server.url + "/v1", api_key="x", is_chat_model=chat, max_retries=0)


# ---- RuntimeEndpoint ---------------------------------------------------------------------------------------------
def test_endpoint_generate_matches_runtime(endpoint, runtime):
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        expected, _ = runtime.generate(ctx(prompt), GREEDY)
        text, meta = endpoint.generate(ctx(prompt), GREEDY)
        assert text == expected
        assert meta["completion_tokens"] >= 1 and meta["finish_reason"]["type"] in ("stop", "length")


def test_endpoint_stream_yields_deltas(endpoint, runtime):
    expected, _ = runtime.generate(ctx("Once upon a time"), GREEDY)
    chunks = list(endpoint.generate_stream(ctx("Once upon a time"), GREEDY))
    assert "".join(t for t, _ in chunks) == expected
    assert len(chunks) >= 2  # deltas, not one cumulative blob
    assert chunks[-1][1]["finish_reason"]["type"] in ("stop", "length")


@pytest.mark.parametrize("prefix, choices", [
    ("Q: Is the sky blue?\nAnswer:", [" yes", " no", " maybe so"]),
    ("The color of grass is ", ["green", "blue", "reddish"]),  # choices merge with the trailing space
])
def test_endpoint_select_matches_runtime(endpoint, runtime, prefix, choices):
    for method in METHODS:
        local = runtime.select(ctx(prefix), choices, 0.0, method)
        remote = endpoint.select(ctx(prefix), choices, 0.0, method)
        assert remote.decision == local.decision
        assert remote.meta_info["normalized_prompt_logprobs"] == pytest.approx(
            local.meta_info["normalized_prompt_logprobs"], abs=1e-3)
        assert len(remote.meta_info["input_token_logprobs"]) == len(choices)


def test_endpoint_chat_template_and_info(endpoint, runtime):
    assert endpoint.get_chat_template().role_prefix_and_suffix == runtime.get_chat_template().role_prefix_and_suffix
    assert endpoint.get_model_name() == "smollm2"
    assert endpoint.get_server_info()["model_name"]


def test_endpoint_cache_prefix_and_flush(endpoint, engine):
    prefix = "A long shared preamble that several requests will reuse. " * 4
    assert endpoint.flush_cache() is True
    assert engine.tree.total_size == 0
    endpoint.cache_prefix(prefix)
    assert engine.tree.total_size > 0
    _, meta = endpoint.generate(ctx(prefix + "Next:"), GREEDY)
    assert meta["cached_tokens"] >= meta["prompt_tokens"] - 4


def test_endpoint_errors_and_abort(endpoint, server):
    with pytest.raises(BackendError, match="prompt has"):  # the server's own message comes through
        endpoint.generate(ctx("word " * 20000), GREEDY)
    long = GenParams.build(max_new_tokens=4000, temperature=0, ignore_eos=True)
    result: dict = {}

    def work():
        try:
            endpoint.generate(ctx("Count forever:", rid="to-abort"), long)
        except BackendError as e:
            result["error"] = e

    t = threading.Thread(target=work)
    t.start()
    time.sleep(0.5)
    endpoint.abort("to-abort")
    t.join(30)
    assert not t.is_alive() and "abort" in str(result.get("error", ""))
    with pytest.raises(BackendError, match="failed"):
        _endpoint("http://127.0.0.1:9")  # nothing listens there


# ---- OpenAI (completion and chat) against the server's /v1 ---------------------------------------------------------
def test_openai_completion_generate_and_select(server, runtime):
    backend = _openai(server, chat=False)
    expected, _ = runtime.generate(ctx("The capital of France is"), GREEDY)
    text, meta = backend.generate(ctx("The capital of France is"), GREEDY)
    assert text == expected and meta["finish_reason"]["type"] == "stop"
    streamed = list(backend.generate_stream(ctx("The capital of France is"), GREEDY))
    assert "".join(t for t, _ in streamed) == expected
    for prefix, choices in (("Q: Is the sky blue?\nAnswer:", [" yes", " no", " maybe so"]),
                            ("The color of grass is ", ["green", "blue", "reddish"])):
        for method in ("token_length_normalized", "unconditional_likelihood_normalized"):
            local = runtime.select(ctx(prefix), choices, 0.0, method)
            remote = backend.select(ctx(prefix), choices, 0.0, method)
            assert remote.decision == local.decision
            assert remote.meta_info["normalized_prompt_logprobs"] == pytest.approx(
                local.meta_info["normalized_prompt_logprobs"], abs=1e-3)
    assert backend.usage["calls"] >= 5


def _fill_person(backend, spec: int | None) -> dict[str, str]:
    program: dict = {}
    text, values = PEOPLE, {}
    params = GenParams.build(max_new_tokens=8, temperature=0, stop="\n")
    for name, after in (("name", "\nAge:"), ("age", "\nJob:"), ("job", "")):
        value, _ = backend.generate(ctx(text, program=program, num_api_spec_tokens=spec), params)
        values[name] = value
        text += value + after
    return values


def test_openai_speculative_execution(server):
    plain, spec = _openai(server, chat=False), _openai(server, chat=False)
    without = _fill_person(plain, None)
    with_spec = _fill_person(spec, 32)
    assert with_spec == without and all(without.values())
    assert spec.usage["spec_hits"] >= 1
    assert spec.usage["calls"] < plain.usage["calls"]
    assert spec.usage["prompt_tokens"] < plain.usage["prompt_tokens"]


def test_openai_speculative_program(server):
    def person(s):
        s += PEOPLE + sgl.gen("name", max_tokens=8, stop="\n", temperature=0)
        s += "\nAge:" + sgl.gen("age", max_tokens=8, stop="\n", temperature=0)
        s += "\nJob:" + sgl.gen("job", max_tokens=8, stop="\n", temperature=0)

    plain, spec = _openai(server, chat=False), _openai(server, chat=False)
    a = sgl.function(num_api_spec_tokens=32)(person).run(backend=spec)
    b = sgl.function(person).run(backend=plain)
    assert [a[k] for k in ("name", "age", "job")] == [b[k] for k in ("name", "age", "job")]
    assert spec.usage["calls"] == 1 and spec.usage["spec_hits"] == 2 and plain.usage["calls"] == 3
    assert spec.usage["prompt_tokens"] < plain.usage["prompt_tokens"]


def test_lookahead_cuts_like_the_api():
    from sgnb.backends.openai import _Lookahead

    # " Emily\nAge: 28\n" as tokens " Emily", "\n", "Age", ":", " 28", "\n"
    look = _Lookahead("p", " Emily\nAge: 28\n", [0, 6, 7, 10, 11, 14], False, "k", "id")
    assert look.take(("\n",), 8, first=False)[:2] == (" Emily", {"type": "stop", "matched": "\n"})
    assert look.take(("\n",), 1, first=False)[:2] == (" Emily", {"type": "length"})  # the stop is token 2
    assert look.take(("Age",), 1, first=False)[:2] == (" Emily", {"type": "length"})
    after = look.advance(len(" Emily\nAge:"))
    assert after.end == "p Emily\nAge:" and after.take(("\n",), 8, first=False)[0] == " 28"
    assert after.take(("xyz",), 8, first=False) is None  # ran out before the gen would end: a real call


def test_openai_chat_generate(server, engine):
    backend = _openai(server, chat=True)
    messages = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": ""}]
    params = GenParams.build(max_new_tokens=10, temperature=0)
    text, meta = backend.generate(ctx("", messages=messages, in_role="assistant"), params)
    prompt = engine.apply_chat_template(messages[:1])
    assert text == engine.generate(prompt, {"max_new_tokens": 10, "temperature": 0})["text"]
    streamed = list(backend.generate_stream(ctx("", messages=messages, in_role="assistant"), params))
    assert "".join(t for t, _ in streamed) == text
    with pytest.raises(BackendError, match="chat endpoints"):
        backend.select(ctx("Q?", messages=messages), ["a", "b"], 0.0, "token_length_normalized")
    with pytest.raises(BackendError, match="assistant"):
        backend.generate(ctx("", messages=messages[:1], in_role="user"), params)


def test_openai_refuses_what_the_api_lacks():
    from sgnb.backends.openai import OpenAI, guess_is_chat_model

    assert not guess_is_chat_model("gpt-3.5-turbo-instruct") and not guess_is_chat_model("davinci-002")
    assert guess_is_chat_model("gpt-4o-mini")
    backend = OpenAI("gpt-3.5-turbo-instruct", api_key="x")
    assert backend.is_openai and not backend.is_chat_model
    with pytest.raises(BackendError, match="regex"):
        backend.generate(ctx("x"), GenParams.build(regex="[0-9]+"))  # refused before any request


# ---- Anthropic against a canned Messages API ---------------------------------------------------------------------
class _Messages(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Messages.seen.append({"path": self.path, "body": body, "key": self.headers.get("x-api-key")
                              or (self.headers.get("Authorization") or "").removeprefix("Bearer ")})
        if body.get("stream"):
            events = [
                ("message_start", {"type": "message_start", "message": {
                    "id": "msg_2", "type": "message", "role": "assistant", "model": body["model"], "content": [],
                    "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 12, "output_tokens": 1}}}),
                ("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {"type": "text", "text": ""}}),
                *[("content_block_delta", {"type": "content_block_delta", "index": 0,
                                           "delta": {"type": "text_delta", "text": piece}}) for piece in ("Bon", "jour")],
                ("content_block_stop", {"type": "content_block_stop", "index": 0}),
                ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                   "usage": {"output_tokens": 3}}),
                ("message_stop", {"type": "message_stop"}),
            ]
            data = "".join(f"event: {e}\ndata: {json.dumps(d)}\n\n" for e, d in events).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
        else:
            data = json.dumps({"id": "msg_1", "type": "message", "role": "assistant", "model": body["model"],
                               "content": [{"type": "text", "text": "Paris"}], "stop_reason": "stop_sequence",
                               "stop_sequence": "\n", "usage": {"input_tokens": 20, "output_tokens": 2}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def messages_api():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Messages)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    _Messages.seen.clear()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_anthropic_request_and_parse(messages_api):
    from sgnb.backends import Anthropic

    backend = Anthropic("claude-test", api_key="k", base_url=messages_api, max_retries=0)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": ""}]
    params = GenParams.build(max_new_tokens=20, temperature=0.5, stop="\n")
    text, meta = backend.generate(ctx("", messages=messages, in_role="assistant"), params)
    assert text == "Paris" and meta["finish_reason"] == {"type": "stop", "matched": "\n"}
    assert meta["prompt_tokens"] == 20 and backend.usage == {"calls": 1, "prompt_tokens": 20, "completion_tokens": 2}
    sent = _Messages.seen[0]
    assert sent["path"] == "/v1/messages" and sent["key"] == "k"
    body = sent["body"]
    assert body["system"] == "Be terse." and body["model"] == "claude-test"
    assert body["messages"] == [{"role": "user", "content": "Capital of France?"}]  # the empty open turn is dropped
    assert body["max_tokens"] == 20 and body["stop_sequences"] == ["\n"] and body["temperature"] == 0.5

    pieces = list(backend.generate_stream(ctx("", messages=messages[:2]), params))
    assert "".join(t for t, _ in pieces) == "Bonjour" and pieces[-1][1]["finish_reason"]["type"] == "stop"
    assert _Messages.seen[1]["body"]["stream"] is True
    with pytest.raises(BackendError, match="logprobs"):
        backend.select(ctx("x", messages=messages), ["a", "b"], 0.0, "token_length_normalized")
    with pytest.raises(BackendError, match="regex"):
        backend.generate(ctx("", messages=messages[:2]), GenParams.build(regex="a+"))
