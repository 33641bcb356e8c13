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
import tempfile
import threading
import time
from dataclasses import dataclass

import pytest

ENGINE = "default"  # its assertions hold for any model: the quantized engine (tests/conftest.py)

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
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            cwd=tempfile.gettempdir())  # not the checkout: its kernels/ would shadow HF's package
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


COMPILE_TIMEOUT_S = 3.0  # the served engine's grammar_compile_timeout
READ_TIMEOUT_S = 4.0  # the server's request_read_timeout


@pytest.fixture(scope="module")
def serve():
    served = start_serve("--model", "smollm2", "--grammar-compile-timeout", str(COMPILE_TIMEOUT_S),
                         "--request-read-timeout", str(READ_TIMEOUT_S))
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


def error_of(status: int, out: object) -> str:
    assert status == 400, out
    assert isinstance(out, dict), out
    return out["error"]["message"]


# ---- 3. grammar compiles: bounded, cancelled when unwanted, small ones never queue behind big ones ------------------
def _schema(n: int, prefix: str) -> str:
    """A JSON schema of n string properties with a pattern each: ~60 bytes and tens of ms of compile per property."""
    return json.dumps({"type": "object", "required": [f"{prefix}0"],
                       "properties": {f"{prefix}{i}": {"type": "string", "pattern": "[a-z]{3,9}[0-9]+"}
                                      for i in range(n)}})


def test_a_constraint_over_the_size_limit_is_400_naming_it(serve):
    """2,000 properties with a pattern compiled for ~20 s (40 s two at a time) before anything was checked."""
    for body in ({"text": "x", "sampling_params": {"max_new_tokens": 2, "json_schema": _schema(2000, "a")}},
                 {"text": "x", "sampling_params": {"max_new_tokens": 2, "regex": "a" * 70_000}}):
        message = error_of(*serve.request("POST", "/generate", body, timeout=STALL_S + 3))
        assert "65536" in message and "--max-grammar-bytes" in message, message
    status, out = serve.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"schema": json.loads(_schema(2000, "b"))}}},
        timeout=STALL_S + 3)
    assert "--max-grammar-bytes" in error_of(status, out)


def test_big_compiles_time_out_and_small_grammars_never_wait_behind_them(serve):
    """Two clients' big schemas shared the two compile workers with everyone: a third client's `[0-9]{3}` waited
    37 s. Now big grammars have their own lane, and a request waits at most grammar_compile_timeout for one."""
    bigs = [in_flight(serve, "POST", "/generate", {"text": "x", "sampling_params": {
        "max_new_tokens": 2, "json_schema": _schema(900, prefix)}}, timeout=60) for prefix in ("c", "d")]
    time.sleep(0.5)
    for digits in (3, 4, 5):  # each a fresh compile (not a cache hit): the small lane's
        t0 = time.perf_counter()
        status, out = serve.request("POST", "/generate", {"text": "Number:", "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "regex": f"[0-9]{{{digits}}}"}}, timeout=STALL_S + 3)
        took = time.perf_counter() - t0
        assert status == 200 and out["text"].isdigit() and len(out["text"]) == digits, out
        # the big compiles take 10+ s each and hold both cores: queued behind them, this waited that long;
        # beside them it shares the CPU (margin for a loaded box: twice the stall bound)
        assert took < 2 * STALL_S, f"a small grammar waited {took:.2f} s behind big ones"
    assert_others_served(serve, rounds=1)
    for thread, box in bigs:
        thread.join(60)
        message = error_of(*box["result"])
        assert "did not compile within 3 s" in message and "--grammar-compile-timeout" in message, message


def test_a_compile_nobody_waits_for_is_dropped():
    """The compiles kept running after their clients left. A queued compile whose requests are gone is dropped
    before it starts (one that already runs inside xgrammar cannot be stopped: it finishes, and is cached)."""
    from sgnb.engine import grammar as G
    from sgnb.engine.model_loader import load_tokenizer, resolve_model

    backend = G.GrammarBackend(load_tokenizer(resolve_model("smollm2")), 49152, max_workers=1)
    try:
        backend.validate("regex", "[a-z]{1,1500}")
        backend.validate("regex", "[a-z]{1,1400}")
        busy = backend.compile_async("regex", "[a-z]{1,1500}")  # the big lane's one worker, for ~0.5 s
        queued = backend.compile_async("regex", "[a-z]{1,1400}")  # behind it
        backend.release("regex", "[a-z]{1,1400}")  # its request left
        busy.result(timeout=120)
        with pytest.raises(G.CompileCancelled):
            queued.result(timeout=120)
        assert backend.compile_count == 2 and backend.cancelled_count == 1
        again = backend.compile_async("regex", "[a-z]{1,1400}")  # wanted again: compiled (not the dropped one)
        assert again is not queued and again.result(timeout=120) is not None
        backend.release("regex", "[a-z]{1,1400}")
    finally:
        backend.close()


# ---- 4. media memory: limits read from headers before anything is decoded ---------------------------------------------
@pytest.fixture(scope="module")
def mm_serve(tmp_path_factory):
    """`sgnb serve` on a tiny random LLaVA-NeXT-Video (images and videos on the CPU)."""
    import llava_fixtures as FX  # tests/llava_fixtures.py (tests/ is on sys.path: conftest)

    path = FX.make_llava(tmp_path_factory.mktemp("llava-hostile"), "llava_next_video")
    served = start_serve("--model", str(path), "--device", "cpu")
    yield served
    stop_serve(served)


def _png_url(width: int, height: int) -> str:
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (width, height)).save(buf, format="PNG")  # one colour: a few hundred KB, whatever the size
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_an_image_bomb_is_refused_from_its_header(mm_serve):
    """A 12,000 x 12,000 PNG of a few KB was decoded: 200 after 15 s and +1.9 GB of RSS at peak."""
    bomb = _png_url(12_000, 12_000)
    small = {"text": "Look: <image> What is it?", "image_data": _png_url(64, 48), "sampling_params": {"max_new_tokens": 2}}
    status, out = mm_serve.request("POST", "/generate", small)  # (loads the image processor first)
    assert status == 200, out
    before = mm_serve.peak_rss_mb()
    for body in ({"text": "Look: <image> What is it?", "image_data": bomb, "sampling_params": {"max_new_tokens": 2}},):
        thread, box = in_flight(mm_serve, "POST", "/generate", body)
        assert_others_served(mm_serve, rounds=1)
        thread.join(60)
        message = error_of(*box["result"])
        assert "12000 x 12000" in message and "--max-image-pixels" in message, message
    status, out = mm_serve.request("POST", "/v1/chat/completions", {"max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": bomb}}]}]})
    assert "--max-image-pixels" in error_of(status, out)
    grew = mm_serve.peak_rss_mb() - before
    assert grew < 150, f"the server's peak RSS grew {grew:.0f} MB for images it refused"
    status, out = mm_serve.request("POST", "/generate", small)
    assert status == 200, out


def test_num_frames_is_bounded_before_the_video_is_decoded(mm_serve, tmp_path):
    """num_frames=60000 on an 8-frame video decoded and preprocessed 60,000 frames before the token count was
    checked: 15 s and +1.45 GB kept."""
    import base64

    import llava_fixtures as FX

    video = "data:video/mp4;base64," + base64.b64encode(FX.write_video(tmp_path / "v.mp4", frames=8).read_bytes()).decode()
    fine = {"text": "<video> What happens?", "video_data": {"url": video, "num_frames": 4},
            "sampling_params": {"max_new_tokens": 2}}
    status, out = mm_serve.request("POST", "/generate", fine)  # (loads the video processor first)
    assert status == 200, out
    before = mm_serve.peak_rss_mb()
    thread, box = in_flight(mm_serve, "POST", "/generate", {"text": "<video> What happens?", "video_data": {
        "url": video, "num_frames": 60_000}, "sampling_params": {"max_new_tokens": 2}})
    assert_others_served(mm_serve, rounds=1)
    thread.join(60)
    message = error_of(*box["result"])
    assert "num_frames=60000" in message and "at most 64" in message and "--max-video-frames" in message, message
    grew = mm_serve.peak_rss_mb() - before
    assert grew < 150, f"the server's peak RSS grew {grew:.0f} MB for a video it refused"
    status, out = mm_serve.request("POST", "/generate", fine)
    assert status == 200, out


def test_video_frames_over_the_pixel_limit_are_refused_before_decoding(tmp_path):
    """The frame size comes from the container's stream header: no frame is decoded (in-process, a low limit)."""
    import llava_fixtures as FX

    from sgnb.engine.multimodal import read_video

    path = FX.write_video(tmp_path / "v.mp4", frames=4, h=24, w=32)
    with pytest.raises(ValueError, match=r"frame is 32 x 24 = 768 pixels, over this engine's limit of 700 .*"
                                         r"--max-image-pixels"):
        read_video(str(path), 2, max_pixels=700)
    frames, _, _ = read_video(str(path), 2, max_pixels=768)
    assert len(frames) == 2


# ---- 5. big chat requests are checked and tokenized off the event loop --------------------------------------------
@pytest.mark.parametrize("messages", [[{"role": "user", "content": "x" * 7_800_000}],
                                      [{"role": "user", "content": "hello there"}] * 60_000],
                         ids=["one 7.8 MB message", "60,000 messages"])
def test_a_huge_chat_request_stalls_no_one(serve, messages):
    """A 7.8 MB message was rendered and tokenized on the event loop: 7 s of nobody else being answered."""
    thread, box = in_flight(serve, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    time.sleep(0.2)
    assert_others_served(serve)
    thread.join(60)
    message = error_of(*box["result"])
    assert message.startswith("messages:") and "context length" in message, message


# ---- 6. samples per request -------------------------------------------------------------------------------------------
def test_samples_per_request_are_capped(serve):
    """3,000 prompts x n=64 (a 60 KB body) became 192,000 engine requests: 7 s of a blocked loop, 450 MB kept."""
    thread, box = in_flight(serve, "POST", "/generate", {"text": ["a"] * 3000,
                                                         "sampling_params": {"n": 64, "max_new_tokens": 1}})
    assert_others_served(serve, rounds=1)
    thread.join(60)
    message = error_of(*box["result"])
    assert "192000 samples" in message and "at most 512" in message and "--max-samples" in message, message
    status, out = serve.request("POST", "/v1/completions", {"prompt": ["a"] * 300, "n": 2, "max_tokens": 1})
    assert "--max-samples" in error_of(status, out)


# ---- 7. 400s that name the field and the rule, before any work ------------------------------------------------------
def test_a_seed_past_64_bits_is_400_naming_seed(serve):
    status, out = serve.request("POST", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2,
                                                                                         "seed": 2 ** 70}})
    assert "seed" in error_of(status, out) and "2**63" in out["error"]["message"], out
    status, out = serve.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                                 "max_tokens": 2, "seed": 2 ** 70})
    assert "seed" in error_of(status, out), out
    status, out = serve.request("POST", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2,
                                                                                         "seed": 2 ** 62}})
    assert status == 200, out


@pytest.mark.parametrize("path, raw, field", [
    ("/generate", rb'{"text": "Hi \ud800 there", "sampling_params": {"max_new_tokens": 2}}', "text"),
    ("/v1/completions", rb'{"prompt": ["ok", "bad \udfff"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}',
     "messages[0].content[0].text"),
    # the rid failed only once the whole generation had run
    ("/generate", rb'{"text": "Hi", "rid": "r\udc00", "sampling_params": {"max_new_tokens": 2000, '
                  rb'"ignore_eos": true}}', "rid"),
], ids=["prompt", "batch prompt", "message", "rid"])
def test_a_lone_surrogate_is_400_naming_its_field(serve, path, raw, field):
    status, out = serve.request("POST", path, raw=raw, timeout=STALL_S + 3)
    message = error_of(status, out)
    assert message.startswith(f"{field}: a lone UTF-16 surrogate"), message
    # a proper pair (an emoji) is fine
    status, out = serve.request("POST", "/generate", raw=rb'{"text": "Hi \ud83d\ude00", "sampling_params": '
                                                         rb'{"max_new_tokens": 2}}')
    assert status == 200, out


def test_the_engine_names_a_lone_surrogate_too(engine):
    with pytest.raises(ValueError, match="^prompt: a lone UTF-16 surrogate"):
        engine.generate("Hi \ud800", {"max_new_tokens": 2})
    with pytest.raises(ValueError, match="^rid: a lone UTF-16 surrogate"):
        engine.generate("Hi", {"max_new_tokens": 2}, rid="x\udc00")
    with pytest.raises(ValueError, match=r"seed=.*2\*\*63"):
        engine.generate("Hi", {"max_new_tokens": 2, "seed": -(2 ** 64)})


# ---- 8. slow clients, the same rid after an interrupt ---------------------------------------------------------------
def test_slow_loris_connections_are_dropped_and_hurt_no_one(serve):
    """No deadline for reading a request: 800 connections sending a byte now and then were held forever."""
    head = b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    body = head + b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"text\": \"Hi"
    slow = []
    for k in range(60):
        sock = socket.create_connection(("127.0.0.1", serve.port))
        sock.sendall(head if k % 2 else body)
        slow.append(sock)
    try:
        assert_others_served(serve)
        time.sleep(1.0)
        for sock in slow:  # a byte now and then does not keep a connection open past the deadline
            sock.sendall(b"X")
        for sock in slow:
            sock.settimeout(READ_TIMEOUT_S + 20)
            try:
                assert sock.recv(1024) == b"", "the server answered a request it never got whole"
            except ConnectionResetError:
                pass
        assert_others_served(serve, rounds=1)
        # a client that sends its request whole, however slow its answer, is not cut off
        status, out = serve.request("POST", "/generate", {"text": "Once upon a time", "sampling_params": {
            "max_new_tokens": 400, "ignore_eos": True, "temperature": 0}}, timeout=120)
        assert status == 200 and out["meta_info"]["completion_tokens"] == 400, out
    finally:
        for sock in slow:
            sock.close()


def test_the_same_rid_after_an_interrupt_works(serve):
    body = {"text": "Tell me a story:", "rid": "again", "stream": True,
            "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
    again = {"text": "Hi", "rid": "again", "sampling_params": {"max_new_tokens": 3}}
    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=60)
    conn.request("POST", "/generate", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data:")
    conn.close()  # the client leaves mid-stream: once the server sees it gone, the request is aborted
    for _ in range(300):
        status, out = serve.request("POST", "/generate", again)
        if status != 400 or "already in use" not in out["error"]["message"]:
            break
        time.sleep(0.1)
    assert status == 200 and out["meta_info"]["id"] == "again", out
    # /abort_request frees the rid at once: the same rid right after it is a new request, not refused
    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=60)
    conn.request("POST", "/generate", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data:")  # in flight
    try:
        assert serve.request("POST", "/abort_request", {"rid": "again"})[0] == 200
        status, out = serve.request("POST", "/generate", again)
        assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length", out
        rest = resp.read()
    finally:
        conn.close()
    assert b'"abort"' in rest and rest.endswith(b"data: [DONE]\n\n"), rest[-300:]


def test_the_same_rid_after_a_keyboard_interrupt_works_in_process(engine):
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            engine.generate("Tell me a story:", {"max_new_tokens": 1000, "ignore_eos": True}, rid="again")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    out = engine.generate("Hi", {"max_new_tokens": 3, "temperature": 0}, rid="again")  # at once: no wait
    assert out["meta_info"]["id"] == "again" and out["meta_info"]["finish_reason"]["type"] == "length", out
