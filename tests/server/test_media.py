"""Images and videos over `sgnb serve`: SGLang's image_data / video_data on /generate, OpenAI content parts
(image_url, video_url) on /v1/chat/completions through the official client, what the info routes say, and 400s
for what the server must not do for a client (fetch URLs, read local files) or cannot (corrupt media, media
for a text-only model), each followed by a request that works. A tiny random LLaVA-NeXT-Video serves; results
equal the engine's own on the same input."""

from __future__ import annotations

import base64
import glob
import http.client
import json
import os
import tempfile

import llava_fixtures as FX  # tests/llava_fixtures.py (tests/ is on sys.path: conftest)
import pytest

from sgnb.server import start_server_thread

GREEDY = {"max_new_tokens": 6, "temperature": 0}


IMAGE = FX.smooth_image(40, 50, 0)
OTHER = FX.smooth_image(32, 32, 1)


B64 = base64.b64encode(FX.png_bytes(IMAGE)).decode()
URL = "data:image/png;base64," + B64
OTHER_URL = "data:image/png;base64," + base64.b64encode(FX.png_bytes(OTHER)).decode()


@pytest.fixture(scope="module")
def server(mm_engine):
    handle = start_server_thread(mm_engine, "127.0.0.1", 0)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    path = FX.write_video(tmp_path_factory.mktemp("video") / "clip.mp4", frames=12)
    return path, "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()


def _request(server, method: str, path: str, body=None) -> tuple[int, dict | list | str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                     headers={"content-type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(data)
    except json.JSONDecodeError:
        return resp.status, data.decode()


def _generate(server, body: dict) -> dict | list:
    status, out = _request(server, "POST", "/generate", {"sampling_params": GREEDY, **body})
    assert status == 200, out
    return out


def _leftover_videos() -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), "sgnb-video-*"))


# ---- what the server says about the model -------------------------------------------------------------------------
def test_info_routes_say_whether_the_model_takes_images(server, engine):
    status, info = _request(server, "GET", "/get_model_info")
    assert status == 200 and info["has_image_understanding"] is True
    assert (info["image_token"], info["video_token"]) == ("<image>", "<video>")
    server_info = _request(server, "GET", "/get_server_info")[1]
    assert server_info["has_image_understanding"] is True and server_info["image_token"] == "<image>"
    card = _request(server, "GET", "/v1/models")[1]["data"][0]
    assert card["input_modalities"] == ["text", "image", "video"] and card["has_image_understanding"] is True

    with start_server_thread(engine, "127.0.0.1", 0) as text_only:  # SmolLM2
        info = _request(text_only, "GET", "/get_model_info")[1]
        assert info["has_image_understanding"] is False and info["image_token"] is None
        assert _request(text_only, "GET", "/v1/models")[1]["data"][0]["input_modalities"] == ["text"]
        status, out = _request(text_only, "POST", "/generate", {"text": "<image>Hi", "image_data": URL})
        assert status == 400 and "text-only" in out["error"]["message"]
        status, out = _request(text_only, "POST", "/v1/chat/completions", {"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": URL}}]}]})
        assert status == 400 and "text-only" in out["error"]["message"]
        status, out = _request(text_only, "POST", "/generate", {"text": "Hi", "sampling_params": GREEDY})
        assert status == 200 and out["meta_info"]["completion_tokens"] >= 1


# ---- /generate ---------------------------------------------------------------------------------------------------
def test_generate_takes_data_urls_and_base64(server, mm_engine):
    prompt = "Look: <image> What is it?"
    mm_engine.generate(prompt, GREEDY, image_data=IMAGE)  # cache the image's KV: every request below hits it
    # (a cold prefill runs the dense copy, a cached one the packed kernels: on a CPU with native bf16 the dense
    # copy is bf16 and the two roundings can pick different greedy tokens on these random weights)
    expect = mm_engine.generate(prompt, GREEDY, image_data=IMAGE)
    for image_data in (URL, B64, [URL], "\n".join([B64[:60], B64[60:]])):  # a single item, a list of one, wrapped
        out = _generate(server, {"text": prompt, "image_data": image_data})
        assert out["output_ids"] == expect["output_ids"]
        assert out["meta_info"]["prompt_tokens"] == expect["meta_info"]["prompt_tokens"]
        assert out["meta_info"]["cached_tokens"] > 100  # the image's KV from the first request

    two = "Compare <image> and <image>."
    out = _generate(server, {"text": two, "image_data": [URL, OTHER_URL]})
    assert out["output_ids"] == mm_engine.generate(two, GREEDY, image_data=[IMAGE, OTHER])["output_ids"]
    assert out["output_ids"] != _generate(server, {"text": two, "image_data": [OTHER_URL, URL]})["output_ids"]

    # a batch: one entry (an item or a list) per prompt
    outs = _generate(server, {"text": [prompt, two], "image_data": [B64, [URL, OTHER_URL]]})
    expect_batch = mm_engine.generate([prompt, two], GREEDY, image_data=[IMAGE, [IMAGE, OTHER]])
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in expect_batch]



def test_generate_stream_with_an_image(server, mm_engine):
    prompt = "Look: <image> What is it?"
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/generate", body=json.dumps({"text": prompt, "image_data": URL, "stream": True,
                                                       "sampling_params": GREEDY}),
                 headers={"Content-Type": "application/json"})
    data = conn.getresponse().read()
    conn.close()
    events = [json.loads(line[6:]) for line in data.split(b"\n\n") if line.startswith(b"data: {")]
    assert events[-1]["text"] == mm_engine.generate(prompt, GREEDY, image_data=IMAGE)["text"]


def test_generate_with_a_video(server, mm_engine, video):
    path, url = video
    prompt = "<video> What happens?"
    expect8 = mm_engine.generate(prompt, GREEDY, video_data=str(path))
    expect4 = mm_engine.generate(prompt, GREEDY, video_data=(str(path), 4))
    assert _generate(server, {"text": prompt, "video_data": url})["output_ids"] == expect8["output_ids"]
    out = _generate(server, {"text": prompt, "video_data": {"url": url, "num_frames": 4}})
    assert out["output_ids"] == expect4["output_ids"]
    assert out["meta_info"]["prompt_tokens"] == expect4["meta_info"]["prompt_tokens"]
    both = _generate(server, {"text": "<image> then <video>", "image_data": B64,
                              "video_data": [{"data": base64.b64encode(path.read_bytes()).decode(), "num_frames": 4}]})
    assert both["output_ids"] == mm_engine.generate("<image> then <video>", GREEDY, image_data=IMAGE,
                                                    video_data=(str(path), 4))["output_ids"]
    assert not _leftover_videos()  # the temporary files are gone once the engine has read the frames


@pytest.mark.parametrize("body, needle", [
    ({"image_data": "http://example.com/cat.png"}, "not fetched"),
    ({"image_data": ["https://example.com/cat.png"]}, "not fetched"),
    ({"image_data": "/etc/hostname"}, "reads no local files"),
    ({"image_data": "cat.png"}, "reads no local files"),
    ({"image_data": "file:///etc/hostname"}, "local file"),
    ({"image_data": "data:image/png;base64,@@not-base64@@"}, "corrupt"),
    ({"image_data": "data:image/png;base64," + base64.b64encode(b"GIF89a-truncated").decode()}, "not a readable image"),
    ({"image_data": base64.b64encode(b"plain text, not an image").decode()}, "not a readable image"),
    ({"image_data": 42}, "must be a string"),
    ({"image_data": [URL, URL]}, "2 image(s)"),  # one image token in the prompt
    ({"text": "no token here", "image_data": URL}, "image token"),
    ({"text": ["<image> a", "<image> b"], "image_data": [URL, URL, URL]}, "3 entries for 2 prompts"),
    ({"text": "<video>", "video_data": "https://example.com/clip.mp4"}, "not fetched"),
    ({"text": "<video>", "video_data": "/tmp/clip.mp4"}, "reads no local files"),
    ({"text": "<video>", "video_data": {"path": "/tmp/clip.mp4"}}, "keys"),
    ({"text": "<video>", "video_data": {"url": "data:video/mp4;base64,AAAA", "num_frames": 0}}, "num_frames"),
    ({"text": "<video>", "video_data": "data:video/mp4;base64," + base64.b64encode(b"not a video").decode()},
     "video"),
])
def test_bad_media_is_400_and_the_server_keeps_serving(server, mm_engine, body, needle):
    status, out = _request(server, "POST", "/generate", {"text": "Look: <image>", "sampling_params": GREEDY,
                                                         **body})
    assert status == 400, out
    assert needle in out["error"]["message"], out["error"]["message"]
    assert not _leftover_videos()
    good = _generate(server, {"text": "Look: <image>", "image_data": URL})
    assert good["meta_info"]["completion_tokens"] == 6


# ---- /v1/chat/completions (the official client) ---------------------------------------------------------------------
def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_chat_content_parts(client, mm_engine, video):
    messages = [{"role": "user", "content": [_image_part(URL), {"type": "text", "text": "What is it?"}]}]
    prompt = mm_engine.apply_chat_template([{"role": "user", "content": "<image>What is it?"}])
    expect = mm_engine.generate(prompt, GREEDY, image_data=IMAGE)
    resp = client.chat.completions.create(model="any", messages=messages, max_tokens=6, temperature=0)
    assert resp.choices[0].message.content == expect["text"]
    assert resp.usage.prompt_tokens == expect["meta_info"]["prompt_tokens"]
    assert resp.usage.prompt_tokens_details.cached_tokens > 100  # the same image after the same text: cached

    stream = client.chat.completions.create(model="any", messages=messages, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expect["text"]

    two = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, _image_part(URL),
                                        {"type": "text", "text": "with"}, _image_part(OTHER_URL)]}]
    prompt = mm_engine.apply_chat_template([{"role": "user", "content": "Compare<image>with<image>"}])
    resp = client.chat.completions.create(model="any", messages=two, max_tokens=6, temperature=0)
    assert resp.choices[0].message.content == mm_engine.generate(prompt, GREEDY, image_data=[IMAGE, OTHER])["text"]

    path, url = video
    clip = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url, "num_frames": 4}},
                                         {"type": "text", "text": "What happens?"}]}]
    prompt = mm_engine.apply_chat_template([{"role": "user", "content": "<video>What happens?"}])
    resp = client.chat.completions.create(model="any", messages=clip, max_tokens=6, temperature=0)
    assert resp.choices[0].message.content == mm_engine.generate(prompt, GREEDY,
                                                                 video_data=(str(path), 4))["text"]
    assert not _leftover_videos()


def test_bad_chat_media_is_400(client):
    import openai

    for part, needle in [(_image_part("https://example.com/cat.png"), "not fetched"),
                         (_image_part("/etc/hostname"), "reads no local files"),
                         (_image_part("data:image/png;base64,%%%"), "corrupt"),
                         ({"type": "image_url", "image_url": {"detail": "low"}}, "url"),
                         ({"type": "input_audio", "input_audio": {}}, "not supported yet"),
                         ({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}, "not fetched")]:
        with pytest.raises(openai.BadRequestError, match=needle):
            client.chat.completions.create(model="any", max_tokens=2, messages=[
                {"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}])
        ok = client.chat.completions.create(model="any", max_tokens=2, messages=[
            {"role": "user", "content": [_image_part(URL), {"type": "text", "text": "What is it?"}]}])
        assert ok.usage.completion_tokens == 2


# ---- media that names other files (issue 36, item 2) -----------------------------------------------------------------
def _references(target: str) -> dict[str, bytes]:
    """Video data that makes FFmpeg's probing open another file: an HLS playlist and an ffconcat list."""
    return {"hls": f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\n{target}\n#EXT-X-ENDLIST\n".encode(),
            "concat": f"ffconcat version 1.0\nfile '{target}'\n".encode()}


def test_video_data_that_names_local_files_is_refused_alike(server, client, mm_engine, video, tmp_path):
    import openai

    path, _ = video
    messages = set()
    for target in (str(path), str(tmp_path / "missing.mp4")):  # an existing file and a missing one answer alike
        for kind, raw in _references(target).items():
            b64 = base64.b64encode(raw).decode()
            for value in ("data:application/vnd.apple.mpegurl;base64," + b64, b64,
                          {"url": "data:video/mp4;base64," + b64, "num_frames": 4}):
                status, out = _request(server, "POST", "/generate", {"text": "<video>", "video_data": value,
                                                                     "sampling_params": GREEDY})
                assert status == 400, (kind, target, out)
                assert "not a video this engine reads" in out["error"]["message"]
                messages.add(out["error"]["message"])
            with pytest.raises(openai.BadRequestError, match="not a video this engine reads"):
                client.chat.completions.create(model="any", max_tokens=2, messages=[{"role": "user", "content": [
                    {"type": "video_url", "video_url": {"url": "data:application/x-mpegURL;base64," + b64}},
                    {"type": "text", "text": "What happens?"}]}])
    assert len(messages) == 1, messages  # no existence oracle: the message never depends on the named file
    # in-process, a playlist on disk is refused the same way (a program's own files go through the same opener)
    playlist = tmp_path / "clip.m3u8"
    playlist.write_bytes(_references(str(path))["hls"])
    with pytest.raises(ValueError, match="not a video this engine reads"):
        mm_engine.generate("<video>", GREEDY, video_data=str(playlist))
    good = _generate(server, {"text": "<video>", "video_data": {
        "data": base64.b64encode(path.read_bytes()).decode(), "num_frames": 4}})
    assert good["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]


def test_video_containers_are_sniffed_not_probed():
    from sgnb.engine.image_io import video_container

    assert video_container(b"\x00\x00\x00\x1cftypisom" + bytes(20)) == "mov"
    assert video_container(b"\x1a\x45\xdf\xa3" + bytes(20)) == "matroska"
    assert video_container(b"RIFF\x00\x00\x00\x00AVI LIST") == "avi"
    assert video_container(bytes([0x47] + [0] * 187) * 3) == "mpegts"
    for raw in _references("/etc/passwd").values():
        assert video_container(raw) is None
    assert video_container(b"") is None
