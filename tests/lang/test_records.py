"""The records that cross a boundary are what travels: a small program on the default model in-process, its program
events (sgnb.program_events), its gens' and select's meta_info (sgnb.engine.meta_info) and the engine's events
(sgnb.engine.events), each checked against its TypedDict: no key the type does not name, every required key there."""

from __future__ import annotations

from typing import Any

import llava_fixtures as FX  # tests/llava_fixtures.py (tests/ is on sys.path: conftest)
import pytest

import sgnb as sgl
from sgnb.backends.base import Backend
from sgnb.engine import events as engine_events
from sgnb.engine.meta_info import FINISHED_KEYS, FinishReason, MetaInfo
from sgnb.program_events import EVENT_TYPES

ENGINE = "default"  # its assertions hold for any model: the quantized engine (tests/conftest.py)


def _check(record: Any, d: dict[str, Any], what: str) -> None:
    keys, named = set(d), set(record.__annotations__)
    assert keys <= named, f"{what}: {sorted(keys - named)} not in {record.__name__}"
    assert record.__required_keys__ <= keys, f"{what}: {sorted(record.__required_keys__ - keys)} missing"


def _check_meta(meta: dict[str, Any], what: str) -> None:
    _check(MetaInfo, meta, what)
    if meta.get("finish_reason") is not None:
        _check(FinishReason, meta["finish_reason"], f"{what}'s finish_reason")
        assert "type" in meta["finish_reason"]
    for sample in meta.get("samples") or []:
        _check_meta(sample, f"{what}'s sample")


@sgl.function
def everything(s, topic):
    s += sgl.system("Answer in one word.")
    s += sgl.user("Name a " + topic + ".")
    s += sgl.assistant(sgl.separate_reasoning(sgl.gen("answer", max_tokens=4, return_logprob=True,
                                                      top_logprobs_num=2), model_type="deepseek-r1"))
    s += " It is " + sgl.select("colour", choices=["red", "blue"]) + "."
    s += sgl.gen("two", max_tokens=2, n=2)
    for f in s.fork(2):
        f += " Or " + sgl.gen("other", max_tokens=2)
        f["other"]


@sgl.function
def more(s):
    s += " Again: " + sgl.gen("again", max_tokens=2)


@sgl.function
def fails(s):
    s += "Hello"
    raise ValueError("a failing body")


@sgl.function
def media(s, image, video):
    s += sgl.user(sgl.image(image) + sgl.video(video, num_frames=2) + "What is it?")


class _MediaOnly(Backend):
    """Takes images and videos (their events need no model): the media program makes no request."""

    image_token, video_token = "<image>", "<video>"

    def get_model_name(self) -> str:
        return "media-only"


@pytest.fixture(scope="module")
def runtime(engine):
    return sgl.Runtime(engine=engine)


def test_program_events_match_their_records(runtime, engine, tmp_path):
    program_events: list[dict[str, Any]] = []
    tree_events: list[dict[str, Any]] = []
    unsubscribe = engine.subscribe(tree_events.append)
    try:
        state = everything.run("fruit", backend=runtime, stream=True, temperature=0,
                               subscribers=[program_events.append])
        assert state.error() is None, state.error()
        first = state.executor.id  # (run_on continues it under a new id)
        more.run_on(state, subscribers=[program_events.append]).sync()
        engine.flush_cache()
    finally:
        unsubscribe()
    fails.run(backend=runtime, subscribers=[program_events.append]).error()
    video = FX.write_video(tmp_path / "clip.mp4", frames=4)
    shown = media.run(FX.smooth_image(20, 24), str(video), backend=_MediaOnly(), subscribers=[program_events.append])
    assert shown.error() is None, shown.error()

    for e in program_events:
        assert e["type"] in EVENT_TYPES, e["type"]
        _check(EVENT_TYPES[e["type"]], e, f"the {e['type']} event")
        if "meta_info" in e:
            _check_meta(e["meta_info"], f"the {e['type']} event's meta_info")
        if "progress" in e:
            _check_meta(e["progress"], "a text event's progress")
    assert set(EVENT_TYPES) == {e["type"] for e in program_events}  # every kind came
    assert any("progress" in e for e in program_events if e["type"] == "text")  # streamed pieces
    assert any("continues" in e for e in program_events if e["type"] == "program_begin")  # the continuation
    forked = {c for e in program_events if e["type"] == "fork" for c in e["children"]}
    assert forked and {e["parent"] for e in program_events if e["program"] in forked} == {first}

    for e in tree_events:
        assert e["type"] in engine_events.EVENT_TYPES, e["type"]
        _check(engine_events.EVENT_TYPES[e["type"]], e, f"the engine's {e['type']} event")
    kinds = {e["type"] for e in tree_events}
    assert {"insert", "lock", "unlock", "hit", "request", "reset"} <= kinds, kinds
    assert {e["state"] for e in tree_events if e["type"] == "request"} == {"queued", "finished"}


def test_a_finished_gens_meta_info_matches_meta_info(runtime):
    state = everything.run("colour", backend=runtime, temperature=0)
    assert state.error() is None, state.error()
    answer = state.get_meta_info("answer")
    _check_meta(answer, "a gen's meta_info")
    assert FINISHED_KEYS <= set(answer), sorted(FINISHED_KEYS - set(answer))
    assert {"input_token_logprobs", "output_token_logprobs", "output_top_logprobs", "cached_chars"} <= set(answer)
    _check_meta(state.get_meta_info("two"), "a gen(n=2)'s meta_info")
    assert len(state.get_meta_info("two")["samples"]) == 2
    _check_meta(state.get_meta_info("colour"), "a select's meta_info")
    assert state.get_meta_info("colour")["choices"] == ["red", "blue"]
    # a stream chunk's, on the engine itself
    chunks = list(runtime.engine.generate("Hi", {"max_new_tokens": 3}, stream=True))
    for chunk in chunks:
        _check_meta(chunk["meta_info"], "a stream chunk's meta_info")
    assert FINISHED_KEYS <= set(chunks[-1]["meta_info"])
