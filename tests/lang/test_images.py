"""Images and videos in programs, on every backend: the in-process Runtime, RuntimeEndpoint -> sgnb serve, and
OpenAI (chat, official client) -> sgnb serve, all over one tiny random LLaVA-NeXT-Video engine (images and
videos). The same program through each backend is the same computation on the same engine: greedy outputs agree
token for token. Also: the radix cache reuses an image's KV across questions (forks, run_batch), thumbnails in
the events whatever form the image came in, and errors at the image()/video() line.
"""

from __future__ import annotations

import base64
import io

import llava_fixtures as FX  # tests/llava_fixtures.py (tests/ is on sys.path: conftest)
import pytest

import sgnb as sgl

GREEDY = {"max_tokens": 6, "temperature": 0}


IMAGE = FX.smooth_image(40, 50, 0)
OTHER = FX.smooth_image(40, 50, 1)


@pytest.fixture(scope="module")
def mm_server(mm_engine):
    from sgnb.server import start_server_thread

    handle = start_server_thread(mm_engine, "127.0.0.1", 0)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def backends(mm_engine, mm_server):
    """name -> backend; every one runs on mm_engine."""
    return {"runtime": sgl.Runtime(engine=mm_engine),
            "endpoint": sgl.RuntimeEndpoint(mm_server.url),
            "openai": sgl.OpenAI("tiny-llava", base_url=mm_server.url + "/v1", api_key="x", is_chat_model=True,
                                 max_retries=0)}


@pytest.fixture(scope="module")
def video_path(tmp_path_factory):
    return FX.write_video(tmp_path_factory.mktemp("video") / "clip.mp4", frames=12)


def _image_positions(engine, image) -> int:
    """How many prompt positions `image` fills (its image token becomes that many pad ids)."""
    meta = engine.generate("<image>", {"max_new_tokens": 0}, image_data=image)["meta_info"]
    return meta["prompt_tokens"] - len(engine.tokenizer.encode("<image>")) + 1


# ---- the programs ---------------------------------------------------------------------------------------------
@sgl.function
def questions_by_fork(s, image, questions):
    s += sgl.user(sgl.image(image) + "Look at this picture.")
    forks = s.fork(len(questions))
    for f, q in zip(forks, questions):
        f += sgl.user(q)
        f += sgl.assistant(sgl.gen("answer", **GREEDY))
    forks.join()
    return list(forks)


@sgl.function
def one_question(s, image, question):
    s += sgl.user(sgl.image(image) + question)
    s += sgl.assistant(sgl.gen("answer", **GREEDY))


@sgl.function
def two_images(s, first, second):
    s += sgl.user("Compare " + sgl.image(first) + " with " + sgl.image(second) + ".")
    s += sgl.assistant(sgl.gen("answer", **GREEDY))


@sgl.function
def no_image(s):
    s += sgl.user("Compare  with .")
    s += sgl.assistant(sgl.gen("answer", **GREEDY))


@sgl.function
def about_a_video(s, path):
    s += sgl.user(sgl.video(path, num_frames=4) + "What happens?")
    s += sgl.assistant(sgl.gen("answer", **GREEDY))


@sgl.function
def yes_or_no(s, image):
    s += sgl.user(sgl.image(image) + "Is it mostly red?")
    s += sgl.assistant(sgl.select("verdict", choices=["Yes", "No", "Maybe"]))


# ---- the same program through every backend ------------------------------------------------------------------
def test_questions_about_one_image_through_fork(backends, mm_engine):
    questions = ["What colours do you see?", "Is there a person in it?"]
    answers = {}
    for name, backend in backends.items():
        mm_engine.flush_cache()
        events: list[dict] = []
        state = questions_by_fork.run(image=IMAGE, questions=questions, backend=backend,
                                      subscribers=[events.append])
        assert state.error() is None, state.error()
        answers[name] = state["answer"]
        assert len(answers[name]) == 2 and all(answers[name])
        assert state.text().count("<image>") == 1  # the parent's text: the image inside the user message
        assert {"role": "user", "content": "<image>Look at this picture."} in state.messages()
        images = [e for e in events if e["type"] == "image"]
        assert len(images) == 1 and images[0]["text"] == "<image>" and images[0]["index"] == 0
        assert images[0]["thumbnail"].startswith("data:image/png;base64,")
    assert answers["endpoint"] == answers["runtime"] == answers["openai"]  # token for token: the same computation


def test_fork_branches_hit_the_image_in_the_cache(backends, mm_engine):
    n_image = _image_positions(mm_engine, IMAGE)
    assert n_image > 100  # this anyres image fills hundreds of positions
    for name in ("runtime", "endpoint"):  # (OpenAI has no cache-prefix call)
        mm_engine.flush_cache()
        state = questions_by_fork.run(image=IMAGE, questions=["Colours?", "People?"], backend=backends[name])
        shared = len(mm_engine.tokenizer.encode(state.text())) - 1 + n_image  # the prefix the fork cached
        for branch in state.ret_value:  # both branches found the prefix and its image cached
            meta = branch.get_meta_info("answer")
            assert meta["cached_tokens"] >= shared - 1, (name, meta, shared)
            assert meta["prompt_tokens"] > shared


def test_the_image_reaches_the_model(backends):
    """Another image, none, or the same two in the other order change what the greedy model writes."""
    runtime = backends["runtime"]
    a = one_question.run(image=IMAGE, question="What is it?", backend=runtime)["answer"]
    b = one_question.run(image=OTHER, question="What is it?", backend=runtime)["answer"]
    assert a != b
    both = two_images.run(first=IMAGE, second=OTHER, backend=runtime)["answer"]
    swapped = two_images.run(first=OTHER, second=IMAGE, backend=runtime)["answer"]
    assert both != no_image.run(backend=runtime)["answer"] and both != swapped


def test_two_images_in_one_request_on_every_backend(backends, mm_engine):
    answers = {}
    for name, backend in backends.items():
        state = two_images.run(first=IMAGE, second=OTHER, backend=backend)
        assert state.error() is None, state.error()
        answers[name] = state["answer"]
        assert state.text().count("<image>") == 2
    assert answers["endpoint"] == answers["runtime"] == answers["openai"]


def test_a_video_on_every_backend(backends, video_path):
    answers = {}
    for name, backend in backends.items():
        events: list[dict] = []
        state = about_a_video.run(path=str(video_path), backend=backend, subscribers=[events.append])
        assert state.error() is None, state.error()
        answers[name] = state["answer"]
        (video,) = [e for e in events if e["type"] == "video"]
        assert video["text"] == "<video>" and video["num_frames"] == 4 and video["source"] == str(video_path)
        assert 2 <= len(video["frames"]) <= 4 and video["thumbnail"] == video["frames"][0]
    assert answers["endpoint"] == answers["runtime"] == answers["openai"]
    image_answer = one_question.run(image=IMAGE, question="What happens?", backend=backends["runtime"])["answer"]
    assert answers["runtime"] != image_answer


def test_streaming_with_an_image(backends):
    expected = one_question.run(image=IMAGE, question="What is it?", backend=backends["runtime"])["answer"]
    for name, backend in backends.items():
        state = one_question.run(image=IMAGE, question="What is it?", stream=True, backend=backend)
        assert "".join(state.text_iter("answer")) == state["answer"] == expected, name
        assert "".join(state.text_iter()) == state.text()  # the image token is part of the stream too


def test_select_over_an_image_prefix(backends):
    local = yes_or_no.run(image=IMAGE, backend=backends["runtime"])
    remote = yes_or_no.run(image=IMAGE, backend=backends["endpoint"])
    assert remote["verdict"] == local["verdict"]
    assert remote.get_meta_info("verdict")["normalized_prompt_logprobs"] == pytest.approx(
        local.get_meta_info("verdict")["normalized_prompt_logprobs"], abs=1e-3)
    other = yes_or_no.run(image=OTHER, backend=backends["runtime"])
    assert other.get_meta_info("verdict")["normalized_prompt_logprobs"] != pytest.approx(
        local.get_meta_info("verdict")["normalized_prompt_logprobs"], abs=1e-3)


def test_run_batch_questions_share_the_cached_image(backends, mm_engine):
    for name in ("runtime", "endpoint", "openai"):
        mm_engine.flush_cache()
        first = one_question.run(image=IMAGE, question="What is it?", backend=backends[name])
        assert first.error() is None
        states = one_question.run_batch([{"image": IMAGE, "question": q} for q in ("Colours?", "People?", "Time?")],
                                        backend=backends[name])
        n_image = _image_positions(mm_engine, IMAGE)
        for st in states:
            meta = st.get_meta_info("answer")
            assert meta["cached_tokens"] >= n_image, (name, meta)  # the image's KV is reused, not recomputed


# ---- images in any form, thumbnails ---------------------------------------------------------------------------
def test_every_input_form_is_the_same_image(backends, tmp_path):
    from PIL import Image

    png = FX.png_bytes(IMAGE)
    path = tmp_path / "picture.png"
    path.write_bytes(png)
    forms = {"array": IMAGE, "pil": Image.open(io.BytesIO(png)), "bytes": png, "path": str(path), "Path": path,
             "data_url": "data:image/png;base64," + base64.b64encode(png).decode()}
    answers, thumbs = {}, {}
    for name, value in forms.items():
        events: list[dict] = []
        state = one_question.run(image=value, question="What is it?", backend=backends["runtime"],
                                 subscribers=[events.append])
        answers[name] = state["answer"]
        (event,) = [e for e in events if e["type"] == "image"]
        thumbs[name] = event["thumbnail"]
        assert event["source"]
    assert len(set(answers.values())) == 1  # the same pixels: the same computation
    small = Image.open(io.BytesIO(base64.b64decode(thumbs["path"].split(",", 1)[1])))
    assert max(small.size) <= 96 and small.size == (50, 40)  # already small: kept
    big = one_question.run(image=FX.smooth_image(300, 200, 3), question="?", backend=backends["runtime"])
    assert big.error() is None
    # the same picture through the endpoint (a file read and sent as a data: URL by the client)
    assert one_question.run(image=path, question="What is it?", backend=backends["endpoint"])["answer"] == \
        answers["path"]


def test_thumbnails_are_small(tmp_path):
    from sgnb.media import Media, thumbnail

    url = thumbnail(Media("image", FX.smooth_image(300, 200, 3)))
    from PIL import Image

    img = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert img.size == (64, 96)
    assert thumbnail(Media("image", "https://example.com/cat.png")) is None  # never fetched


def test_forks_and_copies_carry_images(backends):
    @sgl.function
    def copies(s):
        s += sgl.user(sgl.image(IMAGE) + "What is it?")
        c = s.copy()
        c += sgl.assistant(sgl.gen("answer", **GREEDY))
        s += sgl.assistant(sgl.gen("answer", **GREEDY))
        s["copied"] = c["answer"]

    state = copies.run(backend=backends["runtime"])
    assert state["copied"] == state["answer"]
    assert len(state.executor.images_) == 1

    @sgl.function
    def image_in_branch(s):
        s += sgl.user("Two pictures follow.")
        forks = s.fork(2)
        for f, (image, words) in zip(forks, ((IMAGE, "First."), (OTHER, "Second."))):
            f += sgl.user(sgl.image(image) + words)
        forks.join("concate_and_append")
        s += sgl.assistant(sgl.gen("answer", **GREEDY))

    state = image_in_branch.run(backend=backends["runtime"])
    assert state.error() is None and state.text().count("<image>") == 2
    assert [m.data is IMAGE for m in state.executor.images_] == [True, False]


# ---- errors at the image() / video() line ---------------------------------------------------------------------
def _error_at_line(state, needle: str) -> str:
    err = state.error()
    assert isinstance(err, sgl.ProgramError), err
    assert needle in str(err), err
    assert "test_images.py" in str(err), err  # points at the user's line
    return str(err)


def test_text_only_model_fails_at_the_image_line(engine):
    from sgnb.server import start_server_thread

    @sgl.function
    def looks(s):
        s += sgl.user("Hi")
        s += sgl.user(sgl.image(IMAGE) + "What is it?")  # the failing line
        s += sgl.assistant(sgl.gen("answer", max_tokens=2))

    err = _error_at_line(looks.run(backend=sgl.Runtime(engine=engine)), "takes no images")
    assert "sgl.image(IMAGE)" in err
    handle = start_server_thread(engine, "127.0.0.1", 0)
    try:
        endpoint = sgl.RuntimeEndpoint(handle.url)
        assert endpoint.image_token is None
        _error_at_line(looks.run(backend=endpoint), "takes no images")
    finally:
        handle.stop()
    completion = sgl.OpenAI("gpt-3.5-turbo-instruct", base_url="http://127.0.0.1:9/v1", api_key="x")
    _error_at_line(looks.run(backend=completion), "completion model")


def test_backends_without_videos_or_urls_fail_at_the_line(backends, video_path):
    anthropic = sgl.Anthropic("claude-test", api_key="k", base_url="http://127.0.0.1:9", max_retries=0)
    _error_at_line(about_a_video.run(path=str(video_path), backend=anthropic), "takes no videos")
    state = one_question.run(image="https://example.com/cat.png", question="?", backend=backends["runtime"])
    _error_at_line(state, "does not fetch URLs")


def test_unreadable_images_fail_at_the_image_line(backends, tmp_path):
    runtime = backends["runtime"]
    _error_at_line(one_question.run(image=str(tmp_path / "missing.png"), question="?", backend=runtime),
                   "does not exist")
    _error_at_line(one_question.run(image=b"not an image at all", question="?", backend=runtime),
                   "not a readable image")
    _error_at_line(one_question.run(image="data:image/png;base64,@@@", question="?", backend=runtime), "corrupt")
    _error_at_line(about_a_video.run(path=str(tmp_path / "missing.mp4"), backend=runtime), "does not exist")
    with pytest.raises(TypeError, match="image"):
        sgl.image(42)
    with pytest.raises(ValueError, match="num_frames"):
        sgl.video("clip.mp4", num_frames=0)
    assert one_question.run(image=IMAGE, question="?", backend=runtime).error() is None  # still fine


# ---- the chat backends' content parts --------------------------------------------------------------------------
def test_openai_and_anthropic_content_parts():
    from sgnb.backends import GenContext
    from sgnb.backends.anthropic import Anthropic
    from sgnb.backends.openai import OpenAI
    from sgnb.media import Media

    png = FX.png_bytes(IMAGE)
    media = [Media("image", png), Media("image", "https://example.com/b.jpg")]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "<image>Compare with <image>"}, {"role": "assistant", "content": ""}]
    ctx = GenContext("", messages, "r", media, in_role="assistant")
    sent = OpenAI("gpt-4o", api_key="x")._chat_messages(ctx)
    assert sent[0] == messages[0] and len(sent) == 2
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert sent[1]["content"] == [{"type": "image_url", "image_url": {"url": url}},
                                  {"type": "text", "text": "Compare with "},
                                  {"type": "image_url", "image_url": {"url": "https://example.com/b.jpg"}}]
    kw = Anthropic("claude", api_key="x")._request(ctx, sgl.gen("a", max_tokens=3).params)
    assert kw["system"] == "Be brief."
    assert kw["messages"][0]["content"] == [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(png).decode()}},
        {"type": "text", "text": "Compare with "},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/b.jpg"}}]
    outside = GenContext("", messages[:1] + [{"role": "user", "content": "no marker"}], "r", media[:1])
    with pytest.raises(sgl.BackendError, match="outside every chat message"):
        OpenAI("gpt-4o", api_key="x")._chat_messages(outside)


# ---- SGLang's own frontend ---------------------------------------------------------------------------------------
def test_sglang_frontend_image_program_on_sgnb_serve(mm_server, mm_engine, tmp_path):
    sglang = pytest.importorskip("sglang", reason="install sglang --no-deps (make test does)")
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    path = tmp_path / "picture.png"
    path.write_bytes(FX.png_bytes(IMAGE))

    @sglang.function
    def describe(s, image_path):
        s += sglang.user(sglang.image(image_path) + "What is it?")
        s += sglang.assistant(sglang.gen("answer", max_tokens=6, temperature=0))

    state = describe.run(image_path=str(path), backend=RuntimeEndpoint(mm_server.url))
    assert state["answer"]
    prompt = state.text()[: state.text().rindex(state["answer"])]
    assert prompt.count("<image>") == 1  # SGLang's frontend sent the file as plain base64 in image_data
    out = mm_engine.generate(prompt, {"max_new_tokens": 6, "temperature": 0}, image_data=IMAGE)
    assert state["answer"] == out["text"]
