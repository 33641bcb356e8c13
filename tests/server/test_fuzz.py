"""A bounded, seeded fuzz of the HTTP routes (issue 14): random bodies built from the real field names with values of
every JSON type. Whatever comes in: no 5xx, the server stays healthy, no KV slot leaks or stays locked, and a fixed
greedy prompt gives the same output before and after."""

from __future__ import annotations

import http.client
import json
import time

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sgnb.server import start_server_thread  # noqa: E402

PROMPT = "The capital of France is"
GREEDY = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
SAMPLING = ["max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
            "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "stop_regex", "ignore_eos", "n",
            "seed", "regex", "json_schema", "skip_special_tokens", "no_stop_trim"]
NATIVE = ["text", "input_ids", "return_logprob", "logprob_start_len", "top_logprobs_num", "rid", "stream",
          "return_text_in_logprobs", "image_data"]
OPENAI = ["model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "logprobs", "echo", "seed",
          "stream", "frequency_penalty", "presence_penalty", "response_format", "user", "best_of", "suffix"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.integers(-3, 70),
                    st.floats(allow_nan=False, allow_infinity=False, width=32), st.text(max_size=12),
                    st.sampled_from(["", "Hi", "\n", "[0-9]+", "(", "{}", "Paris"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=6)


def _bodies(fields: list[str], with_sampling: bool):
    body = st.dictionaries(st.sampled_from(fields), values, max_size=5)
    if with_sampling:
        sampling = st.dictionaries(st.sampled_from(SAMPLING), values, max_size=4).map(
            lambda d: {**d, "max_new_tokens": 2} if isinstance(d.get("max_new_tokens"), int) else d)
        body = st.tuples(body, sampling).map(lambda t: {**t[0], "sampling_params": t[1]})
    return body


def _post(port: int, path: str, body) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def _greedy(port: int) -> list[int]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/generate", body=json.dumps(GREEDY), headers={"Content-Type": "application/json"})
    out = json.loads(conn.getresponse().read())
    conn.close()
    return out["output_ids"]


def _cap(body: dict) -> dict:
    """Keep a random body cheap on 2 CPU cores: few new tokens, few samples (validation is what is fuzzed)."""
    sp = body.get("sampling_params")
    if isinstance(sp, dict):
        if isinstance(sp.get("max_new_tokens"), int) and sp["max_new_tokens"] > 4:
            sp["max_new_tokens"] = 4
        if isinstance(sp.get("n"), int) and sp["n"] > 3:
            sp["n"] = 3
        sp.setdefault("max_new_tokens", 3)
    for key in ("max_tokens",):
        if isinstance(body.get(key), int) and body[key] > 4:
            body[key] = 4
    if isinstance(body.get("n"), int) and body["n"] > 3:
        body["n"] = 3
    return body


@pytest.fixture(scope="module")
def fuzz_server(engine):
    handle = start_server_thread(engine, "127.0.0.1", 0)
    yield handle
    handle.stop()


def test_fuzzed_requests_never_break_the_server(fuzz_server, engine):
    port = fuzz_server.port
    before = _greedy(port)
    statuses: list[int] = []

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(_bodies(NATIVE, True).map(lambda b: ("/generate", b)),
                     _bodies(OPENAI, False).map(lambda b: ("/v1/completions", b))))
    def check(case):
        path, body = case
        if path == "/generate" and "text" not in body and "input_ids" not in body:
            body["text"] = PROMPT
        if path == "/v1/completions":
            body.setdefault("prompt", PROMPT)
            body.setdefault("max_tokens", 2)
        status = _post(port, path, _cap(body))
        statuses.append(status)
        assert status < 500, (path, body, status)

    check()
    deadline = time.time() + 30
    while engine.scheduler.busy and time.time() < deadline:
        time.sleep(0.05)
    assert engine.tree.protected_size == 0, "a fuzzed request left cache nodes locked"
    pool = engine.runner.kv_pool
    assert pool.available + engine.tree.total_size == pool.size
    assert engine.scheduler.fatal is None
    assert _greedy(port) == before
    print("fuzz statuses:", {s: statuses.count(s) for s in sorted(set(statuses))})
    assert 200 in statuses and 400 in statuses  # the fuzz reached both the engine and the validators


def test_64_clients_with_streams_and_disconnects_lose_nothing(fuzz_server, engine):
    """64 concurrent clients over shared prefixes: a third stream, every eighth hangs up mid-request. Every
    client that stays gets its whole answer; the hung-up ones are aborted; nothing leaks."""
    import socket
    import threading

    port = fuzz_server.port
    prefixes = [f"Question {k}: name a famous landmark in country number {k}. Answer:" for k in range(4)]
    results: dict[int, object] = {}
    lock = threading.Lock()
    aborted0 = engine.get_stats()["requests_aborted"]

    def client(i: int) -> None:
        body = {"text": prefixes[i % 4] + f" (client {i})",
                "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
        if i % 8 == 7:  # hangs up: send, read nothing, close
            body["sampling_params"]["max_new_tokens"] = 400
            payload = json.dumps(body).encode()
            sock = socket.create_connection(("127.0.0.1", port), timeout=60)
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
            time.sleep(0.5)
            sock.close()
            out: object = "hung up"
        else:
            if i % 3 == 0:
                body["stream"] = True
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
            conn.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
            if body.get("stream"):
                events = [json.loads(x[6:]) for x in data.split(b"\n\n") if x.startswith(b"data: {")]
                out = (resp.status, events[-1]["meta_info"]["completion_tokens"] if events else None)
            else:
                out = (resp.status, json.loads(data)["meta_info"]["completion_tokens"])
        with lock:
            results[i] = out

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert len(results) == 64
    stayed = {i: r for i, r in results.items() if r != "hung up"}
    assert len(stayed) == 56 and all(r == (200, 6) for r in stayed.values()), stayed
    deadline = time.time() + 60
    while engine.scheduler.busy and time.time() < deadline:
        time.sleep(0.05)
    assert engine.get_stats()["requests_aborted"] - aborted0 == 8
    assert engine.tree.protected_size == 0
    pool = engine.runner.kv_pool
    assert pool.available + engine.tree.total_size == pool.size
