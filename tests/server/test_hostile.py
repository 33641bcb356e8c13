"""One client never hurts another: hostile and careless requests against a real `sgnb serve` process on loopback
(the default model). Each test sends the bad request, checks that it gets a clear answer (a 400 naming the field,
or a normal completion), and that meanwhile `/health` and another client's small request answer within 2 s. The
server runs in its own process, so a request that freezes it fails the test instead of hanging the suite, and its
peak RSS (VmHWM) can be read."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest

STALL_S = 2.0  # another client's request and /health answer within this while the bad request is in flight
SMALL = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


@dataclass
class Served:
    proc: subprocess.Popen
    port: int

    def request(self, method: str, path: str, body: object = None, timeout: float = 120,
                raw: bytes | None = None, headers: dict | None = None) -> tuple[int, object]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = raw if raw is not None else None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            payload = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(payload)
        except json.JSONDecodeError:
            return resp.status, payload.decode(errors="replace")

    def peak_rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        raise AssertionError("no VmHWM")

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")


def start_serve(*args: str) -> Served:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "sgnb.cli", "serve", "--port", str(port), "--log-level", "warning",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    served = Served(proc, port)
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.time() < deadline, "sgnb serve did not answer /health in 120 s"
        try:
            if served.request("GET", "/health", timeout=2)[0] == 200:
                return served
        except OSError:
            time.sleep(0.2)


def stop_serve(served: Served) -> None:
    if served.proc.poll() is None:
        served.proc.kill()
    served.proc.wait()


@pytest.fixture(scope="module")
def serve():
    served = start_serve("--model", "smollm2")
    yield served
    stop_serve(served)


def in_flight(served: Served, method: str, path: str, body: object, timeout: float = 120) -> tuple[threading.Thread, dict]:
    """Send a request from a thread; its (status, body) lands in the returned dict's "result"."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = served.request(method, path, body, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - the test reads it
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def assert_others_served(served: Served, rounds: int = 3) -> list[float]:
    """/health and another client's small generate each answer within STALL_S; returns their latencies."""
    took = []
    for _ in range(rounds):
        for method, path, body in (("GET", "/health", None), ("POST", "/generate", SMALL)):
            t0 = time.perf_counter()
            try:
                status, out = served.request(method, path, body, timeout=STALL_S + 3)
            except OSError as e:
                raise AssertionError(f"{path} did not answer while the bad request was in flight: {e!r}") from None
            dt = time.perf_counter() - t0
            assert status == 200, out
            assert dt < STALL_S, f"{path} took {dt:.2f} s while the bad request was in flight"
            took.append(dt)
    return took


# ---- 1. a stop regex cannot freeze the scheduler ---------------------------------------------------------------------
def test_a_catastrophic_stop_regex_stalls_no_one(serve):
    """Python's backtracking `re` took exponential time on "(.+)+X" over the growing output, on the scheduler
    thread, every step: the server froze for every client and ignored SIGTERM."""
    bad = {"text": "Write a story:",
           "sampling_params": {"max_new_tokens": 40, "ignore_eos": True, "stop_regex": "(.+)+X", "temperature": 0}}
    thread, box = in_flight(serve, "POST", "/generate", bad, timeout=60)
    time.sleep(0.3)
    assert_others_served(serve)
    thread.join(60)
    status, out = box["result"]
    assert status == 200, out
    assert out["meta_info"]["completion_tokens"] == 40 and out["meta_info"]["finish_reason"]["type"] == "length"
    # a stop regex that does match still stops, and is trimmed off
    status, out = serve.request("POST", "/generate", {"text": "Count: 1, 2, 3,", "sampling_params": {
        "max_new_tokens": 40, "temperature": 0, "ignore_eos": True, "stop_regex": r"(\d+,?\s?)+8"}})
    assert status == 200, out
    assert out["meta_info"]["finish_reason"]["type"] == "stop" and "8" not in out["text"], out


@pytest.mark.parametrize("pattern, needle", [(r"(a)\1", "invalid escape"), ("(?=a)b", "perl operator"),
                                             ("(?<!x)y", "perl operator"), ("a" * 5000, "at most")])
def test_stop_regexes_that_cannot_be_matched_in_linear_time_are_400(serve, pattern, needle):
    status, out = serve.request("POST", "/generate", {"text": "Hi", "sampling_params": {
        "max_new_tokens": 2, "stop_regex": pattern}}, timeout=STALL_S + 3)
    assert status == 400, out
    message = out["error"]["message"]
    assert "stop_regex" in message and needle in message, message
    status, out = serve.request("POST", "/v1/completions", {"model": "any", "prompt": "Hi", "max_tokens": 2,
                                                             "stop_regex": pattern}, timeout=STALL_S + 3)
    assert status == 400 and "stop_regex" in out["error"]["message"], out
