"""sgnb serve over the real default model: SGLang's native API against engine.generate, the OpenAI API through
the official client, errors, concurrency, client disconnects, and the `sgnb serve` command."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from sgnb.server import start_server_thread

PROMPT = "The capital of France is"
GREEDY = {"max_new_tokens": 8, "temperature": 0}
LONG = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}  # minutes on a CPU: only ever aborted


@pytest.fixture(scope="module")
def server(engine):
    handle = start_server_thread(engine, "127.0.0.1", 0)
    yield handle
    handle.stop()
    assert not handle.running


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _request(server, method: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _post(server, path: str, body=None, raw: bytes | None = None) -> tuple[int, dict | list | str]:
    status, data = _request(server, "POST", path, body, raw)
    try:
        return status, json.loads(data)
    except json.JSONDecodeError:
        return status, data.decode()


def _sse(data: bytes) -> list:
    """The `data:` payloads of an event stream, [DONE] kept as the string."""
    events = [line[len(b"data: "):] for line in data.split(b"\n\n") if line.startswith(b"data: ")]
    return [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]


def _wait_idle(engine, timeout: float = 30.0) -> dict:
    """Wait until nothing is queued or running and no cache node is locked (the scheduler thread takes a
    request out of `running` a moment before it releases its locks, so poll for both)."""
    deadline = time.time() + timeout
    while True:
        stats = engine.get_stats()
        idle = stats["running"] == 0 and stats["waiting"] == 0
        if idle and engine.tree.protected_size == 0:
            return stats
        assert time.time() < deadline, f"not idle after {timeout} s: {stats}, locked {engine.tree.protected_size}"
        time.sleep(0.02)


def _wait_running(engine, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while engine.get_stats()["running"] == 0:
        assert time.time() < deadline, "the request never started"
        time.sleep(0.02)


# ---- native API -------------------------------------------------------------------------------------------
def test_info_health_and_flush(server, engine):
    status, body = _request(server, "GET", "/health")
    assert status == 200
    assert _request(server, "GET", "/health_generate")[0] == 200
    status, info = _request(server, "GET", "/get_model_info")
    info = json.loads(info)
    assert status == 200 and info["is_generation"] is True and info["model_path"] == "smollm2"
    info = json.loads(_request(server, "GET", "/get_server_info")[1])
    assert info["context_length"] == engine.context_length and info["schedule_policy"] == "lpm"
    assert info["internal_states"][0]["kv_total"] > 0
    assert _request(server, "GET", "/server_info")[0] == _request(server, "GET", "/model_info")[0] == 200
    models = json.loads(_request(server, "GET", "/v1/models")[1])
    assert [m["id"] for m in models["data"]] == [engine.model_name]
    assert json.loads(_request(server, "GET", f"/v1/models/{engine.model_name}")[1]) == models["data"][0]
    status, body = _request(server, "GET", "/v1/models/gpt-9")
    assert status == 404 and b"this server serves" in body
    assert _request(server, "POST", "/flush_cache")[0] == 200
    assert _request(server, "GET", "/flush_cache")[0] == 405  # admin routes change state: POST only


def test_generate_matches_engine(server, engine):
    expect = engine.generate(PROMPT, GREEDY)
    status, out = _post(server, "/generate", {"text": PROMPT, "sampling_params": GREEDY})
    assert status == 200
    assert out["text"] == expect["text"] and out["output_ids"] == expect["output_ids"]
    assert out["meta_info"]["prompt_tokens"] == expect["meta_info"]["prompt_tokens"]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}

    # token ids in, the same tokens out
    ids = engine.tokenizer.encode(PROMPT)
    status, out = _post(server, "/generate", {"input_ids": ids, "sampling_params": GREEDY})
    assert status == 200 and out["output_ids"] == expect["output_ids"]

    # a batch answers a list, in order; SGLang's frontend also sends spaces_between_special_tokens
    prompts = [PROMPT, "Once upon a time"]
    expect_batch = engine.generate(prompts, {"max_new_tokens": 4, "temperature": 0})
    status, outs = _post(server, "/generate", {"text": prompts, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "spaces_between_special_tokens": False}})
    assert status == 200 and [o["text"] for o in outs] == [o["text"] for o in expect_batch]


def test_generate_logprobs(server, engine):
    kw = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    expect = engine.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0}, **kw)
    status, out = _post(server, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 4,
                                                                                  "temperature": 0}, **kw})
    assert status == 200
    meta, want = out["meta_info"], expect["meta_info"]
    assert len(meta["input_token_logprobs"]) == len(want["input_token_logprobs"]) == 5
    assert meta["input_token_logprobs"][0][0] is None  # the first prompt token has no logprob
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    for (lp, tok, text), (wlp, wtok, wtext) in zip(meta["output_token_logprobs"], want["output_token_logprobs"]):
        assert tok == wtok and text == wtext and lp == pytest.approx(wlp, abs=1e-3)
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])


def test_generate_stream_is_cumulative(server, engine):
    expect = engine.generate(PROMPT, GREEDY)
    status, data = _request(server, "POST", "/generate", {"text": PROMPT, "sampling_params": GREEDY, "stream": True})
    assert status == 200
    events = _sse(data)
    assert events[-1] == "[DONE]" and len(events) >= 3
    texts = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # what SGLang's RuntimeEndpoint slices
    assert texts[-1] == expect["text"] and events[-2]["output_ids"] == expect["output_ids"]
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"
    counts = [e["meta_info"]["completion_tokens"] for e in events[:-1]]  # every chunk carries its counts
    assert counts == sorted(counts) and counts[-1] == len(expect["output_ids"])
    assert all(e["meta_info"]["prompt_tokens"] == expect["meta_info"]["prompt_tokens"] for e in events[:-1])

    # a batch (and n > 1) streams with an index per chunk
    status, data = _request(server, "POST", "/generate", {
        "text": [PROMPT, "Hello"], "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "stream": True})
    finals = {e["index"]: e for e in _sse(data)[:-1] if e["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1] and finals[0]["text"] == engine.generate(
        PROMPT, {"max_new_tokens": 3, "temperature": 0})["text"]


# ---- OpenAI API ----------------------------------------------------------------------------------------------
def test_completions(client, engine):
    expect = engine.generate(PROMPT, GREEDY)
    r = client.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].text == expect["text"] and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8 and r.usage.total_tokens == 13
    r = client.completions.create(model="any", prompt=PROMPT, max_tokens=2, temperature=0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(PROMPT)
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 + 2 and lp.token_logprobs[0] is None
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    # a stop string ends and is trimmed; the repeated prompt comes from the cache
    stop = expect["text"].strip()[2]
    r = client.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    # several prompts and n samples come back as prompt-major choices
    r = client.completions.create(model="any", prompt=[PROMPT, "Hi"], max_tokens=2, n=2, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.choices[0].text == r.choices[1].text


def test_completions_stream(client, engine):
    expect = engine.generate(PROMPT, GREEDY)
    chunks = list(client.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expect["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat_completions(client, engine):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expect = engine.generate(engine.apply_chat_template(messages), GREEDY)
    r = client.chat.completions.create(model="any", messages=messages, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=2)
    choice, n_out = r.choices[0], expect["meta_info"]["completion_tokens"]
    assert choice.message.role == "assistant" and choice.message.content == expect["text"]
    assert choice.finish_reason == expect["meta_info"]["finish_reason"]["type"] and r.usage.completion_tokens == n_out
    # logprobs cover every generated token (an EOS among them reads as its token text)
    assert len(choice.logprobs.content) == n_out and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert "".join(t.token for t in choice.logprobs.content).startswith(expect["text"])

    stream = client.chat.completions.create(model="any", messages=messages, max_completion_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expect["text"]
    assert chunks[-1].usage.completion_tokens == n_out
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the chat prompt was cached above


# ---- errors -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, raw, needle", [
    (None, b"{not json", "malformed JSON"),
    (None, b"[1, 2]", "must be a JSON object"),
    ({"text": PROMPT, "sampling_params": {"temperature": -1}}, None, "temperature"),
    ({"text": PROMPT, "sampling_params": {"max_new_tokns": 4}}, None, "max_new_tokns"),
    ({"text": PROMPT, "stream": "yes"}, None, "stream"),
    ({"txt": PROMPT}, None, "unknown field 'txt'"),
    ({"text": ""}, None, "empty"),
    ({"input_ids": [1] * 9000}, None, "at most"),
    # beyond the context: refused over HTTP (as OpenAI and SGLang do), never silently shortened
    ({"input_ids": [1] * 8000, "sampling_params": {"max_new_tokens": 500}}, None, "exceed the context length"),
    ({"text": PROMPT, "sampling_params": {"regex": "(unclosed"}}, None, "invalid regex"),
    ({"text": PROMPT, "sampling_params": {"json_schema": "[1]"}}, None, "JSON object"),
    # strict types and the model's limits (issue 14): named, never coerced, refused before any model work
    ({"text": PROMPT, "sampling_params": {"max_new_tokens": 2.5}}, None, "max_new_tokens=2.5: must be an int"),
    ({"text": PROMPT, "sampling_params": {"ignore_eos": "yes"}}, None, "ignore_eos"),
    ({"text": PROMPT, "sampling_params": {"seed": 1.5}}, None, "seed"),
    ({"text": PROMPT, "sampling_params": {"temperature": "hot"}}, None, "temperature='hot': must be a finite number"),
    ({"text": PROMPT, "sampling_params": {"stop_token_ids": [10**7], "min_new_tokens": 1}}, None, "vocabulary"),
    ({"text": PROMPT, "return_logprob": True, "top_logprobs_num": 10**6}, None, "top_logprobs_num"),
])
def test_bad_native_requests_are_400(server, body, raw, needle):
    status, out = _post(server, "/generate", body, raw)
    assert status == 400, out
    assert needle in out["error"]["message"] and out["error"]["code"] == 400


def test_bad_openai_requests_are_400_and_server_keeps_serving(server, client):
    import openai

    for kwargs, needle in [({"temperature": -1.0}, "temperature"), ({"max_tokens": -3}, "max_new_tokens"),
                           ({"max_tokens": 9000}, "exceed the context length"),
                           ({"extra_body": {"bogus": 1}}, "bogus"), ({"prompt": ""}, "empty")]:
        with pytest.raises(openai.BadRequestError, match=needle):
            client.completions.create(**{"model": "any", "prompt": PROMPT, "max_tokens": 2, **kwargs})
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="any", messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}],
                                       response_format={"type": "yaml"})
    status, out = _post(server, "/v1/nope", {})
    assert status == 404 and "Not Found" in out["error"]["message"]
    assert client.completions.create(model="any", prompt="Hi", max_tokens=2).usage.completion_tokens == 2


# ---- load, aborts and disconnects -------------------------------------------------------------------------
def test_16_concurrent_clients(server, client, engine):
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            if i % 2:
                r = client.completions.create(model="any", prompt=f"{PROMPT} (#{i})", max_tokens=4,
                                              temperature=0.7, seed=i, extra_body={"ignore_eos": True})
                results[i] = r.usage.completion_tokens
            else:
                status, out = _post(server, "/generate", {"text": f"{PROMPT} [{i}]", "sampling_params": {
                    "max_new_tokens": 4, "ignore_eos": True}})
                assert status == 200
                results[i] = out["meta_info"]["completion_tokens"]
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and results == {i: 4 for i in range(16)}
    _wait_idle(engine)


def test_client_disconnect_aborts_non_streaming(server, engine):
    aborted = engine.get_stats()["requests_aborted"]
    body = json.dumps({"text": PROMPT, "sampling_params": LONG}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    _wait_running(engine)
    sock.close()
    stats = _wait_idle(engine)
    assert stats["requests_aborted"] == aborted + 1


def test_client_disconnect_aborts_stream(server, client, engine):
    aborted = engine.get_stats()["requests_aborted"]
    stream = client.completions.create(model="any", prompt=PROMPT, stream=True, max_tokens=3000, temperature=0,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    stats = _wait_idle(engine)
    assert stats["requests_aborted"] == aborted + 1


def test_abort_request_by_rid(server, engine):
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(out=_post(server, "/generate", {
        "text": PROMPT, "sampling_params": LONG, "rid": "abort-me"})))
    t.start()
    _wait_running(engine)
    assert _post(server, "/abort_request", {"rid": "abort-me"})[0] == 200
    t.join(timeout=30)
    status, out = box["out"]
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    _wait_idle(engine)


def test_stopping_a_server_thread_with_streams_open_leaves_the_engine_serving(engine):
    """A notebook stops its server thread while a client streams: the stream's request is aborted, the engine
    (shared with the kernel) keeps working; once, the scheduler died of "Event loop is closed" here."""
    handle = start_server_thread(engine, "127.0.0.1", 0)
    aborted = engine.get_stats()["requests_aborted"]
    body = json.dumps({"text": PROMPT, "sampling_params": LONG, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", handle.port))
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    _wait_running(engine)
    handle.stop()
    assert not handle.running
    stats = _wait_idle(engine)
    sock.settimeout(10)
    received = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            received += chunk
    sock.close()
    assert b"the server is shutting down" in received  # the stream's client is told, not just cut off
    assert stats["requests_aborted"] == aborted + 1
    assert engine.scheduler.fatal is None
    assert engine.generate(PROMPT, GREEDY)["meta_info"]["completion_tokens"] > 0


# ---- the command --------------------------------------------------------------------------------------------
def test_cli_imports_no_torch_and_maps_engine_options():
    from sgnb.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "--model", "dummy:tiny", "--max-total-tokens", "4096",
                                      "--disable-radix-cache", "--schedule-policy", "fcfs", "--port", "1234"])
    assert engine_kwargs(args) == {"model_path": "dummy:tiny", "max_total_tokens": 4096,
                                   "disable_radix_cache": True, "schedule_policy": "fcfs"}
    code = "import sys, sgnb.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_sgnb_serve_command(sig):
    """The command serves, and a signal with a stream in flight shuts it down cleanly (exit 0, the engine shut
    down, no traceback): once, SIGINT crashed the scheduler ("Event loop is closed") and SIGTERM exited 143 without
    shutdown; later, a stream outliving the grace period was cancelled and uvicorn logged that as a crash. The
    stream and the plain request here outlive a 0.2 s grace: their clients are told why they ended."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "sgnb.cli", "serve", "--model", "dummy:tiny", "--port", str(port),
                             "--max-total-tokens", "4096", "--log-level", "warning", "--shutdown-grace", "0.2",
                             "--served-model-name", "tiny-house"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.time() < deadline, "sgnb serve did not answer /health in 60 s"
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.2)
            finally:
                conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/generate", json.dumps({"text": "Hi", "sampling_params": {"max_new_tokens": 2}}),
                     headers={"Content-Type": "application/json"})
        assert json.loads(conn.getresponse().read())["meta_info"]["completion_tokens"] == 2
        conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/v1/models")
        assert [m["id"] for m in json.loads(conn.getresponse().read())["data"]] == ["tiny-house"]
        conn.close()
        plain = socket.create_connection(("127.0.0.1", port), timeout=30)  # a non-streaming request in flight
        body = json.dumps({"text": "Hello", "sampling_params": LONG}).encode()
        plain.sendall(b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        stream = socket.create_connection(("127.0.0.1", port), timeout=30)
        body = json.dumps({"text": "Hi", "stream": True, "sampling_params": LONG}).encode()
        stream.sendall(b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        received = stream.recv(4096)
        assert received.startswith(b"HTTP/1.1 200")  # streaming has begun
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        out = proc.stdout.read().decode()
        assert "scheduler crashed" not in out and "Traceback" not in out and "Exception" not in out, out
        while chunk := stream.recv(65536):
            received += chunk
        stream.close()
        assert b"the server is shutting down: this request was aborted" in received, received[-500:]
        answer = b""
        while chunk := plain.recv(65536):
            answer += chunk
        plain.close()
        assert answer.startswith(b"HTTP/1.1 503") and b"the server is shutting down" in answer, answer
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_shutdown_grace_flag_is_checked():
    """A negative grace is refused at the flag, before the model loads."""
    run = subprocess.run([sys.executable, "-m", "sgnb.cli", "serve", "--model", "dummy:tiny", "--shutdown-grace", "-1"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "shutdown_grace must be >= 0 seconds" in run.stderr, run.stderr


def test_structured_output_over_http(server, client):
    """Constraints travel through both APIs: SGLang's sampling_params.regex and OpenAI's response_format."""
    import json
    import re

    status, out = _post(server, "/generate", {"text": "Year:", "sampling_params": {
        "regex": "(19|20)[0-9]{2}", "max_new_tokens": 8, "temperature": 0}})
    assert status == 200 and re.fullmatch("(19|20)[0-9]{2}", out["text"])
    assert out["meta_info"]["decode_steps"] <= out["meta_info"]["completion_tokens"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    resp = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}], max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert isinstance(json.loads(resp.choices[0].message.content)["ok"], bool)


# ---- issue 35: drop-in, all the way --------------------------------------------------------------------------
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": False}


def test_completions_response_format(client):
    """/v1/completions applies response_format as constrained decoding, as the chat route does (SGLang's
    CompletionRequest has it): json_schema validates, json_object parses; with a regex too it is a 400."""
    import openai

    jsonschema = pytest.importorskip("jsonschema")
    r = client.completions.create(model="any", prompt="A large city and its population, as JSON:", max_tokens=60,
                                  temperature=0, extra_body={"response_format": {
                                      "type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), CITY)
    r = client.completions.create(model="any", prompt="Paris, as JSON:", max_tokens=40, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].text.lstrip().startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    # streamed, too
    chunks = list(client.completions.create(model="any", prompt="A large city and its population, as JSON:",
                                            max_tokens=60, temperature=0, stream=True, extra_body={"response_format": {
                                                "type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}}))
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in chunks if c.choices)), CITY)
    with pytest.raises(openai.BadRequestError, match="not both"):
        client.completions.create(model="any", prompt="Hi", max_tokens=4,
                                  extra_body={"response_format": {"type": "json_object"}, "regex": "[a-z]+"})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.completions.create(model="any", prompt="Hi", max_tokens=4, extra_body={"response_format": {
            "type": "structural_tag"}})


def test_tokenize_and_detokenize(server, client, engine):
    """SGLang's /tokenize (prompt -> tokens, count, max_model_len; messages as a chat completion counts them)
    and /detokenize (tokens -> text), under /v1/ too; bad input is a 400 naming the field."""
    import requests

    url = server.url
    out = requests.post(url + "/tokenize", json={"prompt": PROMPT}).json()
    ids = engine.tokenizer.encode(PROMPT)
    assert out == {"tokens": ids, "count": len(ids), "max_model_len": engine.context_length}
    out = requests.post(url + "/v1/tokenize", json={"prompt": [PROMPT, "Hi"], "model": "any"}).json()
    assert out["tokens"] == [ids, engine.tokenizer.encode("Hi")] and out["count"] == [len(ids), 1]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = requests.post(url + "/tokenize", json={"messages": messages}).json()
    chat = client.chat.completions.create(model="any", messages=messages, max_tokens=1)
    assert out["count"] == chat.usage.prompt_tokens == len(out["tokens"])
    assert out["tokens"] == engine.tokenizer.encode(engine.apply_chat_template(messages))

    assert requests.post(url + "/detokenize", json={"tokens": ids}).json() == {"text": PROMPT}
    assert requests.post(url + "/v1/detokenize", json={"tokens": [ids, []]}).json() == {"text": [PROMPT, ""]}
    eos = engine.tokenizer.eos_token_ids[0]
    special = requests.post(url + "/detokenize", json={"tokens": [*ids, eos], "skip_special_tokens": False}).json()
    assert special["text"] == PROMPT + engine.tokenizer.token_text(eos)
    assert requests.post(url + "/detokenize", json={"tokens": [*ids, eos]}).json()["text"] == PROMPT

    for path, body, needle in [
        ("/tokenize", {}, "exactly one of prompt or messages"),
        ("/tokenize", {"prompt": "a", "messages": messages}, "exactly one of prompt or messages"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "bogus": 1}, "unknown field 'bogus'"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        ("/detokenize", {}, "missing required field 'tokens'"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [1, -1]}, "outside the tokenizer's vocabulary"),
        ("/detokenize", {"tokens": [[1], [10**9]]}, "tokens[1] holds ids outside"),
    ]:
        r = requests.post(url + path, json=body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (path, body, r.text)


def test_embeddings_say_the_model_cannot_embed(server, client, engine):
    import openai

    with pytest.raises(openai.BadRequestError, match="generative model") as info:
        client.embeddings.create(model="any", input="Hello")
    assert info.value.body["code"] == "model_not_supported" and engine.model_name in info.value.body["message"]
    status, out = _post(server, "/v1/embeddings", {"inputs": "typo"})
    assert status == 400 and "unknown field 'inputs'" in out["error"]["message"]


def test_served_model_name_and_strict_model_name(engine, server, monkeypatch):
    """--served-model-name is the model's name in /v1/models and every response; with --strict-model-name another
    name is OpenAI's 404 model_not_found on each OpenAI route (by default any name is served, as SGLang does)."""
    import openai

    from sgnb.server import ServerOptions

    monkeypatch.setattr(engine, "served_model_name", "house-model")  # what Engine(served_model_name=...) sets
    strict = start_server_thread(engine, "127.0.0.1", 0, options=ServerOptions(strict_model_name=True))
    try:
        for handle in (server, strict):
            c = openai.OpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            assert [m.id for m in c.models.list()] == ["house-model"]
            assert c.completions.create(model="house-model", prompt="Hi", max_tokens=1).model == "house-model"
            assert c.chat.completions.create(model="house-model", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=1).model == "house-model"
            assert c.responses.create(model="house-model", input="Hi", max_output_tokens=1).model == "house-model"
            assert json.loads(_request(handle, "GET", "/get_model_info")[1])["model_name"] == "house-model"
        lenient = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert lenient.completions.create(model="gpt-4o", prompt="Hi", max_tokens=1).model == "house-model"
        c = openai.OpenAI(base_url=strict.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        calls = [lambda: c.completions.create(model="gpt-4o", prompt="Hi", max_tokens=1),
                 lambda: c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}]),
                 lambda: c.responses.create(model="gpt-4o", input="Hi"),
                 lambda: c.embeddings.create(model="gpt-4o", input="Hi")]
        for call in calls:
            with pytest.raises(openai.NotFoundError, match="'gpt-4o' does not exist") as info:
                call()
            assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    finally:
        strict.stop()


def test_serve_flags_for_the_model_name():
    """The flags reach the engine and the server options, and `sgnb serve --help` documents them."""
    from sgnb.cli import build_parser, serve_engine_kwargs, server_options

    args = build_parser().parse_args(["serve", "--served-model-name", "house-model", "--strict-model-name"])
    assert serve_engine_kwargs(args) == {"model_path": "smollm2", "served_model_name": "house-model",
                                         "reasoning_parser": None}
    assert server_options(args).strict_model_name is True
    assert server_options(build_parser().parse_args(["serve"])).strict_model_name is False
    help_text = subprocess.run([sys.executable, "-m", "sgnb.cli", "serve", "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    assert "--served-model-name NAME" in help_text and "--strict-model-name" in help_text
    assert "model_not_found" in help_text


def test_tokenize_speaks_sglangs_protocol(server):
    """Bodies built with SGLang's own request models (they send every default, continue_final_message too) are
    answered, and the answers validate as SGLang's response models."""
    import requests

    proto = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
    body = proto.TokenizeRequest(prompt=[PROMPT, "Hi"]).model_dump(exclude_none=True)
    out = requests.post(server.url + "/v1/tokenize", json=body).json()
    assert proto.TokenizeResponse.model_validate(out).count == [5, 1]
    body = proto.TokenizeRequest(messages=[{"role": "user", "content": "Hi"}]).model_dump(exclude_none=True)
    assert proto.TokenizeResponse.model_validate(requests.post(server.url + "/tokenize", json=body).json()).count > 1
    body = proto.DetokenizeRequest(tokens=out["tokens"]).model_dump(exclude_none=True)
    text = proto.DetokenizeResponse.model_validate(requests.post(server.url + "/detokenize", json=body).json()).text
    assert text == [PROMPT, "Hi"]
    body = proto.TokenizeRequest(messages=[{"role": "user", "content": "Hi"}], continue_final_message=True)
    r = requests.post(server.url + "/tokenize", json=body.model_dump(exclude_none=True))
    assert r.status_code == 400 and "continue_final_message" in r.json()["error"]["message"]
