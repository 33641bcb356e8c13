"""Issue 36's soak: `sgnb serve` under mixed clients for minutes, with hostile requests at a low rate.

Starts `sgnb serve` (the default model) as a subprocess on loopback and records the greedy text of a few fixed
prompts. Then, for --minutes, --clients threads each loop over a mix of ordinary requests: /generate and
/v1/chat/completions, streaming and not, a regex, a JSON schema, n=3, and streams the client drops after a couple
of chunks. One more thread sends a hostile request every --hostile-every seconds, in turn: a catastrophic stop
regex, a 64-bit-overflowing seed, lone surrogates, 3,000 prompts x n=64, a 7.8 MB chat message, 60,000 messages,
a schema over the size limit, a schema that compiles past the time limit, a trickled (slow-loris) connection;
each must get its expected answer. A prober asks /health every second; a sampler reads the server's RSS.
At the end the greedy text again, which must equal the first.

Reports (and writes to benchmarks/results/<date>-cpu-soak-server.json): ordinary requests ok / failed / aborted
by their client (and hung: no answer within the request timeout), latency p50 / p99 per kind and overall, the
hostile requests as expected / not, /health's worst latency and answers slower than 2 s, the RSS every 10 s and
its peak, and whether the greedy text is unchanged.

    nice .venv/bin/python benchmarks/soak_server.py --minutes 10
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

GREEDY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three colors of the rainbow are",
                  "Once upon a time, a small robot"]
TOPICS = ["the sea", "a library", "winter", "a train station", "bread", "the moon", "a chess game", "rain"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
REQUEST_TIMEOUT_S = 120.0
READ_TIMEOUT_S = 10.0  # the server's --request-read-timeout in the soak


# ---- the server ---------------------------------------------------------------------------------------------
class Server:
    def __init__(self, model: str, extra: list[str]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="sgnb-soak-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sgnb.cli", "serve", "--model", model, "--port", str(self.port),
             "--log-level", "warning", "--request-read-timeout", str(READ_TIMEOUT_S), *extra],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"sgnb serve exited: see {self.log.name}")
            if time.time() > deadline:
                raise SystemExit("sgnb serve did not answer /health in 300 s")
            try:
                if request(self.port, "GET", "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                time.sleep(0.5)

    def status(self, key: str) -> float:
        """VmRSS / VmHWM of the server process, in MB."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def request(port: int, method: str, path: str, body: object = None, raw: bytes | None = None,
            timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, object]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(payload)
    except json.JSONDecodeError:
        return resp.status, payload.decode(errors="replace")


def stream(port: int, path: str, body: dict, drop_after: int | None = None) -> str:
    """POST a streaming request and read its events: "ok" (ended with [DONE], no error event), "dropped" (the
    client closed after `drop_after` events) or a failure description."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return f"status {resp.status}: {resp.read()[:200]!r}"
        events = 0
        while True:
            line = resp.readline()
            if not line:
                return "stream ended without [DONE]"
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return "ok"
            if b'"error"' in data[:12]:
                return f"error event: {data[:200]!r}"
            events += 1
            if drop_after is not None and events >= drop_after:
                return "dropped"
    finally:
        conn.close()


# ---- ordinary clients -------------------------------------------------------------------------------------------
def benign(kind: str, rng: random.Random) -> tuple[str, dict | None]:
    """(path, body) of one ordinary request of `kind`."""
    topic = rng.choice(TOPICS)
    sp = {"max_new_tokens": rng.randint(8, 32), "temperature": 0.7}
    chat = [{"role": "user", "content": f"Write one sentence about {topic}."}]
    if kind == "generate":
        return "/generate", {"text": f"A short note about {topic}:", "sampling_params": sp}
    if kind == "generate_stream":
        return "/generate", {"text": f"A short note about {topic}:", "sampling_params": sp, "stream": True}
    if kind == "regex":
        return "/generate", {"text": f"How many words do you know about {topic}? Answer:",
                             "sampling_params": {**sp, "regex": r" [0-9]{1,3} words"}}
    if kind == "n3":
        return "/generate", {"text": f"Three ideas about {topic}:", "sampling_params": {**sp, "n": 3}}
    if kind == "chat":
        return "/v1/chat/completions", {"messages": chat, "max_tokens": sp["max_new_tokens"]}
    if kind == "chat_stream":
        return "/v1/chat/completions", {"messages": chat, "max_tokens": sp["max_new_tokens"], "stream": True}
    if kind == "chat_json":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"A person who loves {topic}."}],
                                        "max_tokens": 40, "response_format": {
                                            "type": "json_schema", "json_schema": {"schema": SCHEMA}}}
    if kind == "drop":
        return "/generate", {"text": f"A long story about {topic}:", "stream": True,
                             "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    raise ValueError(kind)


KINDS = ["generate", "generate_stream", "regex", "n3", "chat", "chat_stream", "chat_json", "drop"]


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = defaultdict(int)
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.failures: list[str] = []

    def add(self, kind: str, outcome: str, seconds: float, detail: str = "") -> None:
        with self.lock:
            self.counts[outcome] += 1
            self.counts[f"{kind}:{outcome}"] += 1
            if outcome == "ok":
                self.latency[kind].append(seconds)
            elif outcome in ("failed", "hung") and len(self.failures) < 50:
                self.failures.append(f"{kind}: {detail[:300]}")


def client(port: int, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    while time.time() < until:
        kind = rng.choice(KINDS)
        path, body = benign(kind, rng)
        t0 = time.perf_counter()
        try:
            if body.get("stream"):
                result = stream(port, path, body, drop_after=2 if kind == "drop" else None)
                outcome = {"ok": "ok", "dropped": "aborted"}.get(result, "failed")
                detail = result
            else:
                status, out = request(port, "POST", path, body)
                outcome, detail = ("ok", "") if status == 200 else ("failed", f"{status} {str(out)[:300]}")
        except TimeoutError as e:
            outcome, detail = "hung", repr(e)
        except OSError as e:
            outcome, detail = "failed", repr(e)
        tally.add(kind, outcome, time.perf_counter() - t0, detail)


# ---- hostile requests ------------------------------------------------------------------------------------------------
def _big_schema(n: int, prefix: str) -> str:
    return json.dumps({"type": "object", "properties": {f"{prefix}{i}": {"type": "string",
                                                                         "pattern": "[a-z]{3,9}[0-9]+"}
                                                        for i in range(n)}})


def slow_loris(port: int, connections: int = 20) -> tuple[bool, str]:
    """Open connections that trickle a request's head; the server must close each within its read deadline."""
    socks = []
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sock.settimeout(READ_TIMEOUT_S + 30)
        socks.append(sock)
    closed = 0
    try:
        for sock in socks:
            try:
                sock.sendall(b"X")
                closed += sock.recv(64) == b""
            except (ConnectionResetError, BrokenPipeError):
                closed += 1
            except TimeoutError:
                pass
    finally:
        for sock in socks:
            sock.close()
    return closed == connections, f"{closed}/{connections} closed by the server"


def hostile_requests(rng: random.Random) -> list[tuple[str, object]]:
    """(name, spec) in turn: spec is (path, body or raw bytes, the statuses expected) or a callable."""
    prefix = rng.choice("pqr")  # three big schemas in turn: each compiles once past the limit, then is cached
    return [
        ("stop_regex", ("/generate", {"text": "Write a story:", "sampling_params": {
            "max_new_tokens": 40, "ignore_eos": True, "stop_regex": "(.+)+X"}}, {200})),
        ("seed", ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "seed": 2 ** 70}}, {400})),
        ("surrogate", ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', {400})),
        ("fan_out", ("/generate", {"text": ["a"] * 3000, "sampling_params": {"n": 64, "max_new_tokens": 1}}, {400})),
        ("huge_message", ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 7_800_000}],
                                                   "max_tokens": 2}, {400})),
        ("many_messages", ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 60_000,
                                                    "max_tokens": 2}, {400})),
        ("schema_too_big", ("/generate", {"text": "x", "sampling_params": {
            "max_new_tokens": 2, "json_schema": _big_schema(2000, "s")}}, {400})),
        ("schema_slow", ("/generate", {"text": "x", "sampling_params": {
            "max_new_tokens": 2, "json_schema": _big_schema(900, prefix)}}, {200, 400})),
        ("slow_loris", slow_loris),
    ]


def hostile(port: int, every: float, until: float, tally: Tally) -> None:
    rng = random.Random(36)
    k = 0
    while time.time() < until:
        time.sleep(every)
        name, spec = hostile_requests(rng)[k % 9]
        k += 1
        t0 = time.perf_counter()
        try:
            if callable(spec):
                good, detail = spec(port)
            else:
                path, body, expected = spec
                status, out = request(port, "POST", path, raw=body if isinstance(body, bytes) else None,
                                      body=None if isinstance(body, bytes) else body)
                good, detail = status in expected, f"{status} {str(out)[:200]}"
        except OSError as e:
            good, detail = False, repr(e)
        tally.add(f"hostile_{name}", "as_expected" if good else "unexpected", time.perf_counter() - t0, detail)
        if not good:
            with tally.lock:
                tally.failures.append(f"hostile {name}: {detail[:300]}")


# ---- probes ----------------------------------------------------------------------------------------------------------
def prober(port: int, until: float, out: dict) -> None:
    worst, slow, count = 0.0, 0, 0
    while time.time() < until:
        t0 = time.perf_counter()
        try:
            status, _ = request(port, "GET", "/health", timeout=30)
            dt = time.perf_counter() - t0 if status == 200 else float("inf")
        except OSError:
            dt = float("inf")
        worst, slow, count = max(worst, dt), slow + (dt > 2.0), count + 1
        time.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))
    out.update(health_probes=count, health_worst_s=round(worst, 3), health_over_2s=slow)


def sampler(server: Server, until: float, series: list) -> None:
    start = time.time()
    while time.time() < until:
        series.append((round(time.time() - start), round(server.status("VmRSS"), 1)))
        time.sleep(10)


def greedy(port: int) -> list[str]:
    texts = []
    for prompt in GREEDY_PROMPTS:
        status, out = request(port, "POST", "/generate", {"text": prompt, "sampling_params": {
            "max_new_tokens": 32, "temperature": 0}})
        texts.append(out["text"] if status == 200 else f"<{status}>")
    return texts


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--hostile-every", type=float, default=5.0, metavar="S")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--name", default="soak-server")
    args, extra = ap.parse_known_args()

    server = Server(args.model, extra)
    try:
        before = greedy(server.port)
        tally, health, series = Tally(), {}, []
        until = time.time() + args.minutes * 60
        threads = [threading.Thread(target=client, args=(server.port, i, until, tally)) for i in range(args.clients)]
        threads += [threading.Thread(target=hostile, args=(server.port, args.hostile_every, until, tally)),
                    threading.Thread(target=prober, args=(server.port, until, health)),
                    threading.Thread(target=sampler, args=(server, until, series))]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.time() - t0
        after = greedy(server.port)
        peak = server.status("VmHWM")
        rss_end = server.status("VmRSS")
        alive = server.proc.poll() is None
    finally:
        server.stop()

    counts = dict(tally.counts)
    every = [x for kind, xs in tally.latency.items() if not kind.startswith("hostile") for x in xs]
    result = {
        "minutes": args.minutes, "clients": args.clients, "hostile_every_s": args.hostile_every, "model": args.model,
        "wall_s": round(wall, 1), "server_alive_at_end": alive,
        "ok": counts.get("ok", 0), "failed": counts.get("failed", 0), "hung": counts.get("hung", 0),
        "aborted_by_client": counts.get("aborted", 0),
        "hostile_as_expected": counts.get("as_expected", 0), "hostile_unexpected": counts.get("unexpected", 0),
        "latency_p50_s": percentile(every, 0.5), "latency_p99_s": percentile(every, 0.99),
        "latency_by_kind": {k: {"n": len(v), "p50_s": percentile(v, 0.5), "p99_s": percentile(v, 0.99)}
                            for k, v in sorted(tally.latency.items())},
        "counts": dict(sorted(counts.items())),
        **health,
        "rss_mb_every_10s": series, "rss_mb_end": round(rss_end, 1), "peak_rss_mb": round(peak, 1),
        "greedy_unchanged": before == after, "greedy_before": before, "greedy_after": after,
        "failures": tally.failures, "server_log": server.log.name,
    }
    path = write_result("cpu", args.name, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("rss_mb_every_10s", "counts")}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
