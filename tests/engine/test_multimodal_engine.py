"""Images and videos through the whole engine: HF transformers as the oracle, the radix cache keyed by image
content, the encoder cache, chunked prefill and cached prefixes that end inside an image, and bad inputs.

Tiny random LLaVA checkpoints come from tests/llava_fixtures.py (fp32, CPU). Logprobs are compared with a
tolerance at every text position (an image's own positions have no logprob: they are not tokens).
"""

from __future__ import annotations

import base64
import io
import time
from pathlib import Path

import llava_fixtures as FX  # tests/llava_fixtures.py (tests/ is on sys.path: conftest)
import pytest
import torch

TOL = 2e-4


PROMPT = "Look at this: <image> Now say what you see, briefly."


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava-engine")
    return {kind: FX.make_llava(root, kind) for kind in FX.KINDS}


@pytest.fixture(scope="module")
def hf(ckpts):
    return {kind: FX.hf_model_class(kind).from_pretrained(str(path)).eval() for kind, path in ckpts.items()}


@pytest.fixture(scope="module")
def engines(ckpts):
    from sgnb.engine import Engine

    made = {kind: Engine(str(path), device="cpu", max_total_tokens=8192, quantization="none")  # HF oracle: exact
            for kind, path in ckpts.items()}
    yield made
    for e in made.values():
        e.shutdown()


def _idle(engine) -> None:
    deadline = time.time() + 10
    while engine.scheduler.busy and time.time() < deadline:
        time.sleep(0.01)
    assert engine.tree.protected_size == 0
    assert engine.runner.kv_pool.available + engine.tree.total_size == engine.runner.kv_pool.size


def _hf_sequence(engine, text: str, items: list, output_ids: list[int]) -> list[int]:
    """The ids HF's model takes: our tokenization, each image token repeated as many times as its features."""
    counts = iter(it.num_tokens for it in items)
    ids: list[int] = []
    for t in engine.tokenizer.encode(text):
        if t in (FX.IMAGE_TOKEN_ID, FX.VIDEO_TOKEN_ID):
            ids.extend([t] * next(counts))
        else:
            ids.append(t)
    return ids + list(output_ids)


def _hf_logprobs(model, kind: str, ids: list[int], images: list = (), video=None) -> torch.Tensor:
    inputs: dict = {"input_ids": torch.tensor([ids])}
    if images:
        inputs["pixel_values"] = (torch.cat([it.pixel_values for it in images]) if kind == "llava"
                                  else torch.stack([it.pixel_values for it in images]))
        if kind != "llava":
            inputs["image_sizes"] = torch.tensor([it.extra["image_size"] for it in images])
    if video is not None:
        inputs["pixel_values_videos"] = video.pixel_values[None]
    with torch.no_grad():
        return model(**inputs).logits[0].double().log_softmax(-1)


def _check(out: dict, ref: torch.Tensor, ids: list[int], start: int = 0) -> None:
    """Every text position's prompt logprob (asked from `start`) and every output logprob equal HF's."""
    meta = out["meta_info"]
    n_prompt = len(ids) - len(out["output_ids"])
    inp = meta.get("input_token_logprobs") or []
    checked = 0
    for pos, (lp, tok, _) in enumerate(inp, start=start):
        if lp is None:
            continue
        assert tok == ids[pos], pos
        assert abs(lp - ref[pos - 1, tok].item()) < TOL, pos
        checked += 1
    for j, (lp, tok, _) in enumerate(meta["output_token_logprobs"]):
        assert abs(lp - ref[n_prompt - 1 + j, tok].item()) < TOL, j
    assert checked >= (5 if inp else 0)


def _generate(engine, text, images=(), video=None, **kw):
    sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True, **kw.pop("sp", {})}
    return engine.generate(text, sp, return_logprob=True, image_data=list(images) or None,
                           video_data=video, **kw)


@pytest.mark.parametrize("kind", ["llava", "llava_next"])
def test_image_question_matches_hf(engines, hf, kind):
    eng = engines[kind]
    eng.flush_cache()
    img = FX.smooth_image(30, 22, seed=1)
    item = eng.media_processor().image(img)
    out = _generate(eng, PROMPT, [img], logprob_start_len=0)
    ids = _hf_sequence(eng, PROMPT, [item], out["output_ids"])
    assert out["meta_info"]["prompt_tokens"] == len(ids) - 5
    _check(out, _hf_logprobs(hf[kind], kind, ids, [item]), ids)
    _idle(eng)


def test_second_question_hits_the_image_in_the_cache(engines, hf):
    """N questions about one image prefill it once: the second request's cache covers the image and no second
    vision-tower pass runs; its logprobs (decode over a cached image prefix) still equal HF's."""
    kind = "llava_next"
    eng = engines[kind]
    eng.flush_cache()
    img = FX.smooth_image(26, 40, seed=2)
    item = eng.media_processor().image(img)
    head = "Look at this: <image>"
    image_end = len(_hf_sequence(eng, head, [item], []))
    _generate(eng, head + " What color is it?", [img])
    encoded = eng.scheduler.counters.encoded_items
    out = _generate(eng, head + " What shape is it?", [img])
    assert out["meta_info"]["cached_tokens"] >= image_end
    assert eng.scheduler.counters.encoded_items == encoded
    ids = _hf_sequence(eng, head + " What shape is it?", [item], out["output_ids"])
    _check(out, _hf_logprobs(hf[kind], kind, ids, [item]), ids)


def test_same_image_in_any_form_hits_and_another_image_misses(engines, tmp_path):
    from PIL import Image

    eng = engines["llava"]
    eng.flush_cache()
    arr = FX.smooth_image(20, 20, seed=3)
    pil = Image.fromarray(arr)
    buf = io.BytesIO()
    pil.save(buf, format="PNG")
    raw = buf.getvalue()
    path = tmp_path / "img.png"
    path.write_bytes(raw)
    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    item = eng.media_processor().image(arr)
    image_end = len(_hf_sequence(eng, "Look at this: <image>", [item], []))
    _generate(eng, PROMPT, [str(path)])
    encoded = eng.scheduler.counters.encoded_items
    for form in (pil, arr, raw, url, path):
        out = _generate(eng, PROMPT, [form])
        assert out["meta_info"]["cached_tokens"] >= image_end, type(form)
    assert eng.scheduler.counters.encoded_items == encoded  # one vision pass for all six
    other = _generate(eng, PROMPT, [FX.smooth_image(20, 20, seed=4)])  # same text, another image
    assert other["meta_info"]["cached_tokens"] < image_end - item.num_tokens + 1
    _idle(eng)


def test_encoder_outputs_outlive_the_kv_cache(engines):
    eng = engines["llava"]
    img = FX.smooth_image(18, 24, seed=5)
    _generate(eng, PROMPT, [img])
    encoded = eng.scheduler.counters.encoded_items
    eng.flush_cache()  # the image's KV is gone, its features are not
    out = _generate(eng, PROMPT, [img])
    assert out["meta_info"]["cached_tokens"] == 0
    assert eng.scheduler.counters.encoded_items == encoded


def test_chunks_and_cached_prefixes_that_end_inside_an_image(ckpts, hf):
    """Chunked prefill cuts through the image; a later request's cached prefix ends inside it (prompt
    logprobs from a position inside the image make the engine recompute from there). Both equal HF."""
    from sgnb.engine import Engine

    kind = "llava_next"
    eng = Engine(str(ckpts[kind]), device="cpu", chunked_prefill_size=7, max_prefill_tokens=7,
                 max_total_tokens=4096, quantization="none")
    try:
        img = FX.smooth_image(40, 28, seed=6)
        item = eng.media_processor().image(img)
        assert item.num_tokens > 14
        out = _generate(eng, PROMPT, [img], logprob_start_len=0)
        ids = _hf_sequence(eng, PROMPT, [item], out["output_ids"])
        ref = _hf_logprobs(hf[kind], kind, ids, [item])
        _check(out, ref, ids)
        image_start = len(eng.tokenizer.encode("Look at this: "))
        inside = image_start + item.num_tokens // 2
        again = _generate(eng, PROMPT, [img], logprob_start_len=inside)
        assert image_start < again["meta_info"]["cached_tokens"] < image_start + item.num_tokens
        assert again["output_ids"] == out["output_ids"]
        _check(again, ref, ids, start=inside)
        _idle(eng)
    finally:
        eng.shutdown()


def test_two_images_and_a_video_in_one_request(engines, hf, tmp_path):
    kind = "llava_next_video"
    eng = engines[kind]
    video_path = FX.write_video(tmp_path / "clip.mp4", frames=12)
    a, b = FX.smooth_image(24, 36, seed=7), FX.smooth_image(36, 24, seed=8)
    proc = eng.media_processor()
    items = [proc.image(a), proc.image(b)]
    video = proc.video(video_path, 4)
    text = "Compare <image> with <image>, then watch <video> and answer."
    out = eng.generate(text, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}, return_logprob=True,
                       logprob_start_len=0, image_data=[a, b], video_data=(str(video_path), 4))
    counts = iter([items[0].num_tokens, items[1].num_tokens])
    ids: list[int] = []
    for t in eng.tokenizer.encode(text):
        ids.extend([t] * (next(counts) if t == FX.IMAGE_TOKEN_ID else video.num_tokens if t == FX.VIDEO_TOKEN_ID
                          else 1))
    ids += out["output_ids"]
    _check(out, _hf_logprobs(hf[kind], kind, ids, items, video), ids)


def test_select_over_an_image_prefix(engines):
    eng = engines["llava"]
    eng.flush_cache()
    img = FX.smooth_image(20, 28, seed=9)
    res = eng.score("Look at this: <image> It is", [" red", " blue", " a cat"], image_data=img)
    assert res["choice"] in (" red", " blue", " a cat")
    again = eng.score("Look at this: <image> It is", [" red", " blue", " a cat"], image_data=img)
    assert again["normalized_prompt_logprobs"] == pytest.approx(res["normalized_prompt_logprobs"], abs=1e-5)
    assert again["cached_tokens"] > res["cached_tokens"]


def test_unconditional_select_right_after_an_image(engines):
    """unconditional_likelihood_normalized scores each choice after the last shared token alone: when that token
    is the image, the context is the image."""
    eng = engines["llava"]
    res = eng.score("Which is it? <image>", [" a red square", " a blue circle"],
                    "unconditional_likelihood_normalized", image_data=FX.smooth_image(16, 20, seed=15))
    assert res["choice"] in (" a red square", " a blue circle") and len(res["unconditional_token_logprobs"]) == 2


def test_views_see_the_image_as_one_chip(engines):
    eng = engines["llava"]
    eng.flush_cache()
    _generate(eng, PROMPT, [FX.smooth_image(16, 16, seed=10)])
    nodes = [n for n in eng.tree_snapshot()["nodes"] if n.get("media")]
    assert nodes, "the image's node carries its media"
    media = nodes[0]["media"][0]
    assert media["kind"] == "image" and media["thumbnail"].startswith("data:image/png;base64,")
    assert "[image]" in nodes[0]["text"] and "\x00" not in nodes[0]["text"]


def test_penalties_and_pad_ids(engines):
    """A repetition penalty over a prompt with an image: the image's pad ids are not tokens to penalize."""
    eng = engines["llava"]
    out = _generate(eng, PROMPT, [FX.smooth_image(16, 16, seed=11)], sp={"repetition_penalty": 1.3})
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_bad_media_fail_at_the_call_and_harm_nothing(engines, tmp_path):
    from sgnb.engine import Engine

    eng = engines["llava_next_video"]
    img = FX.smooth_image(16, 16, seed=12)
    cases = [
        (dict(image_data="http://example.com/cat.png"), "network"),
        (dict(image_data=b"not an image at all"), "image 1 of 1"),
        (dict(image_data=str(tmp_path / "missing.png")), "image 1 of 1"),
        (dict(image_data=[img, img]), "2 image"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            eng.generate(PROMPT, {"max_new_tokens": 2}, **kwargs)
    empty = FX.write_video(tmp_path / "empty.mp4", frames=0)
    with pytest.raises(ValueError, match="video 1 of 1"):
        eng.generate("Watch <video>.", {"max_new_tokens": 2}, video_data=str(empty))
    with pytest.raises(ValueError, match="no image was given"):
        eng.generate(PROMPT, {"max_new_tokens": 2})
    small = Engine(str(Path(eng.source.path)), device="cpu", context_length=24, max_total_tokens=1024)
    try:
        with pytest.raises(ValueError, match="with its images"):
            small.generate(PROMPT, {"max_new_tokens": 2}, image_data=FX.smooth_image(64, 64, seed=13))
    finally:
        small.shutdown()
    text_only = Engine("dummy:tiny", device="cpu", max_total_tokens=256)
    try:
        with pytest.raises(ValueError, match="text-only"):
            text_only.generate("Hello", {"max_new_tokens": 2}, image_data=img)
    finally:
        text_only.shutdown()
    ok = _generate(eng, PROMPT, [img])  # the engine is intact
    assert ok["meta_info"]["finish_reason"]["type"] == "length"
    _idle(eng)


def test_dummy_tiny_llava_takes_text_and_images():
    """dummy:tiny-llava borrows SmolLM2's tokenizer; the image token is added to it."""
    from sgnb.engine import Engine

    eng = Engine("dummy:tiny-llava", device="cpu", max_total_tokens=2048)
    try:
        out = eng.generate("Describe <image> please.", {"max_new_tokens": 3, "ignore_eos": True},
                           image_data=FX.smooth_image(30, 30, seed=14))
        assert len(out["output_ids"]) == 3 and eng.image_token == "<image>"
    finally:
        eng.shutdown()
