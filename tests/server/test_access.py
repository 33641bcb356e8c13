"""Who may drive `sgnb serve`, and how much one request may ask for (issue 14): API keys, Host and Origin
checks against DNS rebinding and cross-site pages, JSON-only POSTs, the body's size, n and top_logprobs_num.
A real server on loopback, real clients (http.client, raw sockets, the official openai client)."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from sgnb.server import ServerOptions, start_server_thread

ENGINE = "default"  # its assertions hold for any model: the quantized engine (tests/conftest.py)

PROMPT = "The capital of France is"
BODY = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def _call(port: int, method: str, path: str, body=None, headers: dict | None = None,
          raw: bytes | None = None) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        text = resp.read()
        try:
            out = json.loads(text)
        except json.JSONDecodeError:
            out = {"raw": text.decode(errors="replace")}
        return resp.status, out, dict(resp.getheaders())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def open_server(engine):
    handle = start_server_thread(engine, "127.0.0.1", 0, options=ServerOptions(
        allowed_hosts=("notebook.lan",), max_request_bytes=64 << 10, max_n=4, max_top_logprobs_num=5))
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def keyed_server(engine):
    handle = start_server_thread(engine, "127.0.0.1", 0, options=ServerOptions(api_key="k-user",
                                                                               admin_api_key="k-admin"))
    yield handle
    handle.stop()


def test_without_a_key_only_this_host_is_answered(open_server):
    port = open_server.port
    assert _call(port, "POST", "/generate", BODY)[0] == 200
    for host in ("localhost", f"127.0.0.1:{port}", "notebook.lan:8888"):
        assert _call(port, "POST", "/generate", BODY, {"Host": host})[0] == 200, host
    status, out, _ = _call(port, "POST", "/generate", BODY, {"Host": "attacker.example"})  # DNS rebinding
    assert status == 403 and "Host 'attacker.example' is not allowed" in out["error"]["message"]
    status, out, _ = _call(port, "GET", "/get_server_info", headers={"Host": "attacker.example:30000"})
    assert status == 403


def test_without_a_key_cross_site_requests_are_refused(open_server):
    port = open_server.port
    status, out, _ = _call(port, "POST", "/generate", BODY, {"Origin": "https://evil.example"})
    assert status == 403 and "cross-origin" in out["error"]["message"]
    assert _call(port, "POST", "/generate", BODY, {"Origin": f"http://localhost:{port}"})[0] == 200
    # a page can POST text/plain without a preflight: the body is JSON all the same, the answer is 415
    status, out, _ = _call(port, "POST", "/abort_request", {"abort_all": True}, {"content-type": "text/plain"})
    assert status == 415 and "application/json" in out["error"]["message"]


def test_keys(keyed_server):
    port = keyed_server.port
    status, out, headers = _call(port, "POST", "/generate", BODY)
    assert status == 401 and "API key" in out["error"]["message"] and headers.get("www-authenticate") == "Bearer"
    assert _call(port, "POST", "/generate", BODY, {"Authorization": "Bearer wrong"})[0] == 401
    assert _call(port, "POST", "/generate", BODY, {"Authorization": "Bearer k-user"})[0] == 200
    assert _call(port, "POST", "/generate", BODY, {"Authorization": "Bearer k-admin"})[0] == 200
    assert _call(port, "GET", "/health")[0] == 200  # open: readiness checks carry no key
    assert _call(port, "POST", "/flush_cache", {}, {"Authorization": "Bearer k-user"})[0] == 401
    assert _call(port, "POST", "/flush_cache", {}, {"Authorization": "Bearer k-admin"})[0] == 200
    # with a key, the Host check is the key's job: a remote client with the key is served
    assert _call(port, "POST", "/generate", BODY, {"Authorization": "Bearer k-user", "Host": "gpu-box:30000"})[0] == 200


def test_official_client_and_runtime_endpoint_with_a_key(keyed_server):
    openai = pytest.importorskip("openai")
    import sgnb as sgl

    client = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="k-user", max_retries=0)
    assert client.completions.create(model="any", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="nope", max_retries=0).completions.create(
            model="any", prompt=PROMPT, max_tokens=2)
    backend = sgl.RuntimeEndpoint(keyed_server.url, api_key="k-user")

    @sgl.function
    def ask(s):
        s += PROMPT + sgl.gen("a", max_tokens=2, temperature=0)

    assert ask.run(backend=backend)["a"] is not None


def test_body_size_limit(open_server):
    port = open_server.port
    big = {"text": "x " * 40_000, "sampling_params": {"max_new_tokens": 1}}  # ~80 KB > 64 KB
    status, out, _ = _call(port, "POST", "/generate", big)
    assert status == 413 and "--max-request-bytes" in out["error"]["message"]
    # chunked (no Content-Length): counted while it is read
    payload = json.dumps(big).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(payload[i:i + 8192]), payload[i:i + 8192])
                      for i in range(0, len(payload), 8192))
    sock.sendall(head + chunks + b"0\r\n\r\n")
    reply = sock.recv(65536).decode(errors="replace")
    sock.close()
    assert reply.startswith("HTTP/1.1 413"), reply[:200]
    assert _call(port, "POST", "/generate", BODY)[0] == 200  # and it keeps serving


@pytest.mark.parametrize("body, needle", [
    ({"text": PROMPT, "sampling_params": {"n": 5, "max_new_tokens": 1}}, "--max-n"),
    ({"text": PROMPT, "return_logprob": True, "top_logprobs_num": 6}, "--max-top-logprobs-num"),
])
def test_request_caps(open_server, body, needle):
    status, out, _ = _call(open_server.port, "POST", "/generate", body)
    assert status == 400 and needle in out["error"]["message"]


def test_openai_n_cap(open_server):
    body = {"model": "any", "prompt": PROMPT, "max_tokens": 1, "n": 5}
    status, out, _ = _call(open_server.port, "POST", "/v1/completions", body)
    assert status == 400 and "--max-n" in out["error"]["message"]


def test_deeply_nested_json_is_400(open_server):
    raw = b'{"text": "hi", "sampling_params": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    status, out, _ = _call(open_server.port, "POST", "/generate", raw=raw)
    assert status == 400 and "nested too deeply" in out["error"]["message"]


def _raw(port: int, head: bytes) -> bytes:
    """One request as raw bytes on its own connection: the status line and the rest of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


def test_a_bare_post_is_answered_and_bodies_still_need_json(open_server):
    """`curl -X POST .../flush_cache` (no body, no Content-Type, no Origin) flushes (it was a 415), as SGLang's
    server answers it. What keeps a page from driving the server stays: a page's bodiless POST carries its
    Origin (403), and a body without Content-Type: application/json is a 415, chunked or not."""
    import shutil
    import subprocess

    port = open_server.port
    if shutil.which("curl"):
        run = subprocess.run(["curl", "-s", "-X", "POST", "-w", "%{http_code}", f"http://127.0.0.1:{port}/flush_cache"],
                             capture_output=True, text=True, timeout=60)
        assert run.stdout == "Cache flushed.\n200", run.stdout
    import requests

    assert requests.post(f"http://127.0.0.1:{port}/flush_cache", timeout=60).status_code == 200  # Content-Length: 0
    out = _raw(port, b"POST /flush_cache HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"Cache flushed.\n"), out
    out = _raw(port, b"POST /flush_cache HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200"), out
    # a route that needs a body says so
    out = _raw(port, b"POST /abort_request HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400") and b"the request body is empty" in out, out

    out = _raw(port, b"POST /flush_cache HTTP/1.1\r\nHost: localhost\r\nOrigin: https://evil.example\r\n"
                     b"Connection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 403") and b"cross-origin" in out, out
    out = _raw(port, b"POST /flush_cache HTTP/1.1\r\nHost: localhost\r\nOrigin: null\r\nConnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 403"), out  # a sandboxed page's POST
    body = b'{"abort_all": true}'
    out = _raw(port, b"POST /abort_request HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (len(body), body))
    assert out.startswith(b"HTTP/1.1 415") and b"application/json" in out, out
    out = _raw(port, b"POST /abort_request HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    assert out.startswith(b"HTTP/1.1 415"), out
    out = _raw(port, b"POST /flush_cache HTTP/1.1\r\nHost: localhost\r\nContent-Type: text/plain\r\n"
                     b"Content-Length: 0\r\nConnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 415"), out  # a form's POST has a Content-Type, even with nothing in it
