"""sgnb.widgets, Python side: traits reflect real programs and the real engine's tree; updates are throttled;
the engine's scheduler thread does nothing for a view but append to a deque."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import deque

import pytest

import sgnb as sgl
from sgnb.widgets import EngineStats, ProgramView, RadixTreeView, esm_path
from sgnb.widgets._batch_view import BatchTable, BatchView
from sgnb.widgets._engine_stats import _point
from sgnb.widgets._esm import bundle
from sgnb.widgets._program_view import align_tokens, cached_chars, estimate_tokens

PREFIX = "You are a helpful assistant. Answer each question in one short sentence, please.\n"


@pytest.fixture(scope="module")
def runtime(engine):
    return sgl.Runtime(engine=engine)


def wait_until(cond, timeout=20.0, step=0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()


def settle(view: ProgramView) -> None:
    """Flush until every program the view knows has ended (the `end` event follows the last node)."""
    assert wait_until(lambda: not view.flush() and all(p["status"] != "running" for p in view.programs))


def segs(program: dict, kind: str) -> list[dict]:
    return [s for s in program["segments"] if s["k"] == kind]


# ---- packaging of the frontend code ------------------------------------------------------------------------
def test_import_is_light():
    code = "import sys, sgnb.widgets; assert 'torch' not in sys.modules and 'sgnb.engine.engine' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("widget", [ProgramView, RadixTreeView, EngineStats, BatchView])
def test_esm_is_one_module(widget, tmp_path):
    esm = widget._esm
    assert "export default" in esm
    assert not re.search(r"^import .* from", esm, re.M), "relative imports must be inlined"
    assert not re.search(r"\.innerHTML\s*=|insertAdjacentHTML", esm), "text goes in via textContent"
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: syntax not checked")
    f = tmp_path / "widget.mjs"
    f.write_text(esm)
    subprocess.run([node, "--check", str(f)], check=True)


def test_drawing_modules_stand_alone():
    for name in ("radix_tree_draw.js", "stats_draw.js"):
        text = esm_path(name).read_text()
        assert "export function draw" in text and not re.search(r"^import ", text, re.M)
    assert "drawTree" in bundle("radix_tree.js") and "drawStats" in bundle("engine_stats.js")


# ---- ProgramView -----------------------------------------------------------------------------------------
@sgl.function
def showcase(s, question):
    s += sgl.system("You are terse.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=6, temperature=0))
    s += "\nVerdict:" + sgl.select("verdict", choices=[" yes", " no", " maybe"])
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"\nIdea {i + 1}:" + sgl.gen("idea", max_tokens=4, temperature=0)
    forks.join()
    s += "\n" + sgl.gen("year", max_tokens=12, regex=r"The year is (19|20)[0-9]{2}\.", temperature=0)


def test_program_view_reflects_a_real_program(runtime):
    view = ProgramView(title="showcase")
    state = view.run(showcase, "What is a radix tree?", backend=runtime)
    assert state.view is view
    state.sync()
    settle(view)
    programs = {p["id"]: p for p in view.programs}
    (top,) = [p for p in programs.values() if p["parent"] is None]
    assert top["name"] == "showcase" and top["status"] == "done" and "question" in top["arguments"]
    assert [s["role"] for s in segs(top, "role_begin")] == ["system", "user", "assistant"]
    assert any(s["tmpl"] for s in segs(top, "text")), "role markers are told apart"

    gens = {s["var"]: s for s in segs(top, "gen")}
    assert gens["answer"]["text"] == state["answer"] and gens["answer"]["done"]
    meta = gens["answer"]["meta"]
    assert meta["completion_tokens"] >= 1 and "cached_tokens" in meta and meta["e2e_latency"] > 0

    (sel,) = segs(top, "select")
    assert sel["var"] == "verdict" and sel["text"] == state["verdict"]
    assert [c["text"] for c in sel["choices"]] == [" yes", " no", " maybe"]
    assert sum(c["p"] for c in sel["choices"]) == pytest.approx(1.0, abs=1e-3)
    best = max(sel["choices"], key=lambda c: c["p"])
    assert best["chosen"] and best["text"] == state["verdict"]
    # its metrics as for gens: the prompt its choices were scored after (the conversation so far, cached)
    vmeta = state.get_meta_info("verdict")
    assert sel["meta"]["prompt_tokens"] == vmeta["prompt_tokens"] > 0 and sel["elapsed"] > 0
    assert sel["meta"]["cached_tokens"] == vmeta["cached_tokens"] > 0

    (fork,) = segs(top, "fork")
    assert len(fork["children"]) == 2 and top["children"] == fork["children"]
    for i, cid in enumerate(fork["children"]):
        child = programs[cid]
        assert child["parent"] == top["id"] and child["status"] == "done"
        (idea,) = segs(child, "gen")
        assert idea["var"] == "idea" and idea["text"] == state["idea"][i]

    year = gens["year"]
    assert "year is" in year["constraint"]
    tokens = year["tokens"]
    assert tokens and "".join(t[0] for t in tokens) == year["text"] == state["year"]
    forced = sum(t[1] for t in tokens)
    assert 0 < forced < len(tokens), "jump-forward tokens and sampled ones are both marked"
    assert year["meta"]["forced_tokens"] == forced

    assert view.summary["gens"] == 4 and view.summary["selects"] == 1 and view.summary["programs"] == 3
    assert set(top["variables"]) >= {"answer", "verdict", "idea", "year"}


def test_program_view_streams_token_by_token(runtime):
    @sgl.function
    def tell(s):
        s += PREFIX + "Tell me about caches.\nAnswer:"
        s += sgl.gen("story", max_tokens=24, temperature=0, ignore_eos=True)

    view = ProgramView()
    lengths: list[int] = []

    def record(change):
        for p in change["new"]:
            for s in segs(p, "gen"):
                lengths.append(len(s["text"]))

    view.observe(record, names=["programs"])
    state = view.run(tell, stream=True, backend=runtime)
    story = state["story"]
    settle(view)
    (gen,) = segs(view.programs[0], "gen")
    assert gen["text"] == story and gen["chunks"] > 1 and gen["ttft"] is not None
    growing = sorted(set(lengths))
    assert len(growing) >= 3 and growing[-1] == len(story), f"the span grew in steps: {growing}"


THINKING = r"<think>[a-z ]{5,40}</think>The answer is [0-9]"  # the default model thinks when a regex makes it


@sgl.function
def thinker(s, question, temperature):
    s += sgl.user(question)
    s += sgl.separate_reasoning(
        sgl.assistant(sgl.gen("answer", regex=THINKING, max_tokens=60, temperature=temperature)), model_type="qwen3")
    s += sgl.user("Thanks.")


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_program_view_folds_a_gens_reasoning(runtime, stream):
    """A gen inside separate_reasoning carries its reasoning apart from its answer: the text between the markers
    (the same as NAME_reasoning_content), its token count (markers included, up to where the answer starts) and
    its time; streamed, the reasoning grows piece by piece before the answer starts."""
    view = ProgramView()
    seen: list[tuple[str, object]] = []  # (reasoning so far, where the answer starts) per sync

    def record(change):
        for p in change["new"]:
            for g in segs(p, "gen"):
                if "think" in g:
                    seen.append((g["think"]["text"], g["think"]["end"]))

    view.observe(record, names=["programs"])

    def at_once(event):  # a sync per event (the view's own ticker would merge pieces that come fast)
        view.on_event(event)
        view.flush()

    # every step's piece (the Runtime's default coalescing can deliver a fast engine's short reasoning in one)
    state = thinker.run("What is 2 + 3?", 0.8, backend=runtime, stream=stream, subscribers=[at_once],
                        stream_interval_s=0)
    state.sync()
    settle(view)
    (gen,) = segs(view.programs[0], "gen")
    think = gen["think"]
    reasoning = state["answer_reasoning_content"]
    assert len(reasoning) >= 5 and state["answer"].startswith("The answer is")
    assert think["format"] == "qwen3" and think["done"] and think["text"] == reasoning
    assert gen["text"] == f"<think>{reasoning}</think>{state['answer']}"  # the raw reply, as the model wrote it
    assert gen["text"][think["end"]:] == state["answer"]
    tokens = gen["tokens"]
    assert tokens and think["tokens"] == len([t for t in _starts(tokens) if t < think["end"]])
    assert 0 < think["tokens"] < gen["meta"]["completion_tokens"]
    assert 0 < think["seconds"] <= gen["meta"]["e2e_latency"] + 1e-6
    if stream:
        partial = [t for t, end in seen if end is None and t]
        assert len(set(partial)) >= 2, f"the reasoning streamed in pieces: {sorted(set(partial))}"
        assert all(reasoning.startswith(t) for t in partial)


def _starts(tokens: list) -> list[int]:
    out, pos = [], 0
    for part, *_ in tokens:
        out.append(pos)
        pos += len(part)
    return out


def test_program_view_throttles_updates():
    """2,000 events from 4 threads in about half a second become a handful of messages."""
    view = ProgramView()
    sent: list[dict] = []
    view._send = lambda msg, buffers=None: sent.append(msg)  # every comm message the widget would send
    view.on_event({"program": "p", "parent": None, "type": "program_begin", "name": "load", "arguments": {}})
    view.on_event({"program": "p", "parent": None, "type": "gen_begin", "var": "x", "rid": "r", "where": None,
                   "constraint": None})

    def feed(k):
        for i in range(500):
            view.on_event({"program": "p", "parent": None, "type": "text", "text": f"{k}.{i} ", "var": "x"})
            if i % 50 == 0:
                time.sleep(0.01)

    t0 = time.monotonic()
    threads = [threading.Thread(target=feed, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    view.on_event({"program": "p", "parent": None, "type": "gen_end", "var": "x", "rid": "r", "meta_info": {}})
    view.on_event({"program": "p", "parent": None, "type": "end"})
    view.flush()
    assert view.events_seen == 2004
    (gen,) = segs(view.programs[0], "gen")
    assert gen["chunks"] == 2000 and gen["done"]
    assert 1 <= len(sent) <= elapsed / 0.05 + 3, (len(sent), elapsed)
    assert all(m["method"] == "update" and {"programs", "summary"} >= set(m["state"]) for m in sent)


def _llava_fixtures():
    """tests/llava_fixtures.py (write_video), imported by path (the suite runs with --import-mode=importlib)."""
    import importlib.util
    from pathlib import Path

    if "llava_fixtures" not in sys.modules:
        spec = importlib.util.spec_from_file_location("llava_fixtures", Path(__file__).parents[1] / "llava_fixtures.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["llava_fixtures"] = module
        spec.loader.exec_module(module)
    return sys.modules["llava_fixtures"]


@pytest.fixture(scope="module")
def llava_engine():
    from sgnb.engine import Engine

    eng = Engine("dummy:tiny-llava-next-video")  # random weights: the answers are noise, the rest is real
    yield eng
    eng.shutdown()


def test_program_view_media_error_and_text_forms(runtime, llava_engine, tmp_path):
    """A real program with an image and a video: the view shows the image's thumbnail and the video's frame
    strip where the program added them; on a model that takes no images, the error at the image() line."""
    from PIL import Image

    img = tmp_path / "red.png"
    Image.new("RGB", (640, 480), (220, 30, 30)).save(img)
    clip = _llava_fixtures().write_video(tmp_path / "clip.mp4", frames=12)

    @sgl.function
    def looks(s, path, clip):
        s += "USER: Look at this: " + sgl.image(path) + " and this: " + sgl.video(clip, num_frames=4)
        s += "\nWhat is in both? ASSISTANT:" + sgl.gen("caption", max_tokens=3, temperature=0)

    view = ProgramView()
    state = view.run(looks, str(img), str(clip), backend=sgl.Runtime(engine=llava_engine))
    state.sync()
    settle(view)
    (p,) = view.programs
    assert p["status"] == "done", p["error"]
    assert [s["k"] for s in p["segments"]][:5] == ["text", "image", "text", "video", "text"]
    (image,) = segs(p, "image")
    assert image["name"] == "red.png" and max(_image_of(image["thumb"]).size) <= 72
    (video,) = segs(p, "video")
    assert video["name"] == "clip.mp4" and video["num_frames"] == 4 and video["frames"]
    assert all(max(_image_of(f).size) <= 48 for f in video["frames"])
    (gen,) = segs(p, "gen")
    assert gen["meta"]["prompt_tokens"] > 100  # the image's and the video's tokens went to the engine

    failing = ProgramView()
    state = failing.run(looks, str(img), str(clip), backend=runtime)  # SmolLM2 takes no images
    assert state.error() is not None
    settle(failing)
    (p,) = failing.programs
    assert p["status"] == "error" and "images" in p["error"]["message"] and not segs(p, "image")
    assert "test_widgets.py" in segs(p, "error")[0]["where"]  # the image() line

    text = repr(view)
    assert text.startswith("<ProgramView") and "done" in text and len(text) < 200
    assert "error" in repr(failing)
    data, _ = view._repr_mimebundle_()
    assert data["text/plain"] == text  # (text/html is the static snapshot: widgets/_static.py)


def test_program_view_status_tells_a_body_error_and_an_interrupt(runtime):
    """A Python error in the body (a typo, a bad regex at the gen line) reads "error", not "done"; an aborted
    program (what an interrupted cell does) reads "interrupted", not an error of the request it aborted."""
    import sgnb

    @sgnb.function
    def typo(s):
        s += "Hi" + sgnb.gen("a", max_tokens=2)
        s += undefined_name  # noqa: F821

    view = ProgramView()
    state = view.run(typo, backend=runtime)
    assert "NameError" in str(state.error())
    settle(view)
    (p,) = view.programs
    assert p["status"] == "error" and "NameError" in p["error"]["message"]

    @sgnb.function
    def long(s):
        s += "Count to a thousand:" + sgnb.gen("n", max_tokens=400, ignore_eos=True)

    view = ProgramView()
    state = view.run(long, backend=runtime)
    assert wait_until(lambda: runtime.engine.get_stats()["running"] > 0)
    state.executor.abort()  # what KeyboardInterrupt in a waiting cell calls
    state.error()
    settle(view)
    (p,) = view.programs
    assert p["status"] == "interrupted", p


def test_program_view_a_finished_copy_is_not_left_running(runtime):
    """A `s.copy()` (or a fork) that is never joined ends with its program: its status reads "done"."""
    import sgnb

    @sgnb.function
    def copies(s):
        s += "Hello" + sgnb.gen("a", max_tokens=2)
        c = s.copy()
        c += " copy" + sgnb.gen("b", max_tokens=2)
        forks = s.fork(2)
        forks += sgnb.gen("c", max_tokens=2)

    view = ProgramView()
    state = view.run(copies, backend=runtime)
    state.sync()
    settle(view)
    assert len(view.programs) == 4
    assert [p["status"] for p in view.programs] == ["done"] * 4, view.programs
    assert view.summary["running"] == 0


def test_program_view_shows_a_continued_state(runtime):
    """A finished state that goes on: the view that showed it (fed by `run_on`) grows it in place; a new view
    (a later cell's) starts with the earlier text, collapsed, then the new turn."""
    import sgnb

    @sgnb.function
    def turn(s, q):
        s += sgnb.user(q) + sgnb.assistant(sgnb.gen("a", max_tokens=2))

    view = ProgramView()
    state = view.run(turn, "Hi", backend=runtime)
    state.sync()
    settle(view)
    turn.run_on(state, "Again", subscribers=[view.on_event])
    state.sync()
    settle(view)
    (p,) = view.programs  # the same program, grown
    assert p["status"] == "done" and len(segs(p, "gen")) == 2 and not segs(p, "prior")

    later = ProgramView()
    before = state.executor.id
    turn.run_on(state, "Once more", subscribers=[later.on_event])
    state.sync()
    settle(later)
    (q,) = later.programs
    prior = segs(q, "prior")
    assert len(prior) == 1 and q["segments"][0]["k"] == "prior"
    assert "Again" in prior[0]["text"] and prior[0]["from"] == before
    assert len(segs(q, "gen")) == 1 and q["status"] == "done"


def _data_url(img, fmt="PNG") -> str:
    import base64
    import io

    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _image_of(url: str):
    import base64
    import io

    from PIL import Image

    assert url.startswith("data:image/jpeg;base64,")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


def test_program_view_shows_thumbnails_and_frame_strips(tmp_path):
    """Image and video events as the interpreter sends them (a thumbnail / frames in any input form) and as
    it did before (a path only): small JPEGs in the segments, in program order, whatever size arrived."""
    from PIL import Image

    red = Image.new("RGB", (640, 480), (220, 30, 30))
    blue_path = tmp_path / "blue.png"
    Image.new("RGB", (300, 300), (30, 30, 220)).save(blue_path)
    frames = [_data_url(Image.new("RGB", (96, 72), (10 * i, 200, 0))) for i in range(20)]

    def ev(type_, **kw):
        return {"program": "p", "parent": None, "type": type_, **kw}

    view = ProgramView()
    for e in [ev("program_begin", name="look", arguments={}), ev("text", text="USER: "),
              ev("image", path="<PIL.Image.Image image mode=RGB size=640x480>", thumbnail=_data_url(red)),
              ev("text", text=" and "), ev("image", path=str(blue_path)),  # no thumbnail: read from the path
              ev("video", path=str(tmp_path / "clip.mp4"), num_frames=20, frames=frames),
              ev("video", path=str(tmp_path / "gone.mp4"), num_frames=4),  # nothing to show but its name
              ev("image", path="https://example.com/cat.png"),  # not readable here: its name
              ev("end")]:
        view.on_event(e)
    view.flush()
    (p,) = view.programs
    kinds = [s["k"] for s in p["segments"]]
    assert kinds == ["text", "image", "text", "image", "video", "video", "image"]
    red_seg, blue_seg, url_seg = segs(p, "image")
    for seg, rgb in ((red_seg, (220, 30, 30)), (blue_seg, (30, 30, 220))):
        im = _image_of(seg["thumb"])
        assert max(im.size) <= 72 and all(abs(a - b) < 12 for a, b in zip(im.convert("RGB").getpixel((5, 5)), rgb))
    assert url_seg["thumb"] == "" and url_seg["name"] == "cat.png"
    strip, bare = segs(p, "video")
    assert strip["num_frames"] == 20 and len(strip["frames"]) == 16  # evenly spread, first and last kept
    shrunk = [_image_of(f) for f in strip["frames"]]
    assert all(max(im.size) <= 48 for im in shrunk)
    assert [round(im.convert("RGB").getpixel((2, 2))[0] / 10) for im in (shrunk[0], shrunk[-1])] == [0, 19]
    assert bare["frames"] == [] and bare["thumb"] == "" and bare["name"] == "gone.mp4"
    assert len(json.dumps(view.programs)) < 30_000  # what the notebook saves stays small


def test_program_view_run_batch_and_classmethod(runtime):
    @sgl.function
    def qa(s, q):
        s += PREFIX + "Q: " + q + "\nA:" + sgl.gen("a", max_tokens=3, temperature=0)

    view = ProgramView()
    states = view.run_batch(qa, [{"q": "one?"}, {"q": "two?"}, {"q": "three?"}], backend=runtime)
    settle(view)
    shown = {p["arguments"]["q"]: segs(p, "gen")[0]["text"] for p in view.programs}
    assert shown == {repr(q): s["a"] for q, s in zip(("one?", "two?", "three?"), states)}
    state = ProgramView.run(qa, "four?", backend=runtime)  # a new view (displayed only under IPython)
    assert isinstance(state.view, ProgramView) and state.view is not view
    state.sync()
    settle(state.view)
    assert state.view.summary["gens"] == 1


def test_program_view_timings_agree_on_constrained_gens(runtime):
    """TTFT and latency come from one clock (the engine's, from the request's arrival), so TTFT <= latency, on a
    grammar gen too (whose wall time in the program includes compiling the grammar); a gen that was not streamed
    and whose backend reports no TTFT shows none (its first text is its result)."""

    @sgl.function
    def rate(s):
        s += PREFIX + "Rate caches from 1 to 5.\nRating: "
        s += sgl.gen("stars", regex=r"[1-5] stars?", max_tokens=8, temperature=0)
        s += "\nJSON: " + sgl.gen("js", max_tokens=24, temperature=0,
                                  regex=r'\{"name": "[a-z]{2,6}", "age": [0-9]{1,2}\}')

    for stream in (False, True):
        view = ProgramView()
        view.run(rate, backend=runtime, stream=stream).sync()
        settle(view)
        for g in segs(view.programs[0], "gen"):
            m = g["meta"]
            assert g["ttft"] == pytest.approx(m["ttft"], abs=1e-4), g
            assert 0 < g["ttft"] <= m["e2e_latency"] <= g["elapsed"] + 0.05, g

    view = ProgramView()  # no engine TTFT, not streamed: unknown rather than the whole wall time
    for e in [{"type": "gen_begin", "var": "x", "rid": "r"}, {"type": "text", "text": "hi", "var": "x"},
              {"type": "gen_end", "var": "x", "rid": "r", "meta_info": {"e2e_latency": 0.2}}, {"type": "end"}]:
        view.on_event({"program": "q", "parent": None, **e})
    view.flush()
    (g,) = segs(view.programs[0], "gen")
    assert g["ttft"] is None and g["meta"]["e2e_latency"] == 0.2


def test_align_tokens():
    assert align_tokens("hello world", ["hel", "lo", " world", "<|im_end|>"]) == ["hel", "lo", " world"]
    assert align_tokens("a\u4f60b", ["a", "\ufffd", "\ufffd", "b"]) == ["a", "\u4f60", "", "b"]
    assert align_tokens("a \u4f60", ["a", " \ufffd", "\ufffd"]) == ["a", " \u4f60", ""]
    assert align_tokens("abc", ["x"]) is None and align_tokens("abc", ["a"]) is None


def test_program_view_token_detail_with_logprobs(runtime):
    """With logprobs asked for, every token of a gen has its text (they concatenate to the value), its logprob
    and its top alternatives; a grammar gen's forced tokens are marked and have no logprob (nothing sampled)."""

    @sgl.function
    def detail(s):
        s += PREFIX + "Colours: red, green," + sgl.gen("colour", max_tokens=6, temperature=0, ignore_eos=True)
        s += "\nJSON: " + sgl.gen("js", max_tokens=24, temperature=0,
                                  regex=r'\{"name": "[a-z]{2,6}", "age": [0-9]{1,2}\}')

    view = ProgramView()
    state = view.run(detail, backend=runtime, return_logprob=True, top_logprobs_num=3,
                     return_text_in_logprobs=True)
    state.sync()
    settle(view)
    gens = {g["var"]: g for g in segs(view.programs[0], "gen")}
    for name, g in gens.items():
        assert g["logprobs"] and "".join(t[0] for t in g["tokens"]) == g["text"] == state[name]
        for _text, forced, lp, alts in g["tokens"]:
            if forced:
                assert lp is None
            else:
                assert lp <= 0 and len(alts) == 3 and all(isinstance(a, str) and b <= 0 for a, b in alts)
                assert alts[0][1] >= lp - 1e-3, "the top alternative is at least as likely as the sampled token"
    js = gens["js"]["tokens"]
    assert 0 < sum(t[1] for t in js) == gens["js"]["meta"]["forced_tokens"] < len(js)
    assert len(json.dumps(view.programs)) < 30_000


def test_program_view_marks_the_cached_prompt(runtime):
    """The text segments a gen read get how many of their characters the cache served: a fork's shared prefix
    (cached for the branches) is marked in full; the first, cold prompt is not."""

    @sgl.function
    def branches(s, topic):
        s += f"{PREFIX}Unique {topic} {time.time_ns()}:" + sgl.gen("a", max_tokens=2, temperature=0)
        s += "\nTwo ideas follow, one per line, about the topic given above.\n"
        forks = s.fork(2)
        forks += sgl.gen("idea", max_tokens=3, temperature=0)
        forks.join()

    view = ProgramView()
    view.run(branches, "tries", backend=runtime).sync()
    settle(view)
    top = next(p for p in view.programs if p["parent"] is None)
    first, second = segs(top, "text")[:2]
    (a,) = segs(top, "gen")
    assert 0 <= first.get("cached", 0) < len(first["text"]) and a["meta"]["cached_tokens"] < a["meta"]["prompt_tokens"]
    assert second["cached"] == len(second["text"]), second  # the fork prefix, cached for the branches
    for child in (p for p in view.programs if p["parent"] == top["id"]):
        (g,) = segs(child, "gen")
        assert g["meta"]["cached_tokens"] >= g["meta"]["prompt_tokens"] - 2 and g["cached_chars"] > 0


def test_program_view_takes_the_reported_cached_chars():
    """A backend that says where the cache hit ends in the prompt's characters (the engine's cached_chars) is
    taken at its word, no estimate; a hit of all but the prompt's last token (the one the engine computes again
    for its logits) shades the whole prompt."""
    def run(cached_tokens: int, cached_chars: int) -> dict:
        view = ProgramView()
        meta = {"prompt_tokens": 6, "cached_tokens": cached_tokens, "completion_tokens": 1,
                "cached_chars": cached_chars, "output_tokens": [("!", False)]}
        for e in [{"type": "text", "text": "Hello there, "}, {"type": "text", "text": "friend"},
                  {"type": "gen_begin", "var": "x", "rid": "r"}, {"type": "text", "text": "!", "var": "x"},
                  {"type": "gen_end", "var": "x", "rid": "r", "meta_info": meta, "prompt_chars": 19},
                  {"type": "end"}]:
            view.on_event({"program": "q", "parent": None, **e})
        view.flush()
        return view.programs[0]

    prog = run(3, 11)
    assert [s.get("cached") for s in segs(prog, "text")] == [11, 0]
    (g,) = segs(prog, "gen")
    assert g["cached_chars"] == 11 and g["cached_exact"] and g["tokens"] == [["!", False, None, None]]
    assert [s.get("cached") for s in segs(run(5, 13), "text")] == [13, 6]


def test_cached_chars_estimate():
    assert cached_chars([], [(0, 0)], 400, 100, 0) == (0, True)
    assert cached_chars([], [(0, 0), (120, 30)], 400, 100, 30) == (120, True)  # at an earlier gen's end
    assert cached_chars([], [(0, 0), (120, 30)], 400, 100, 65) == (260, False)  # no text known: by characters
    # a prefix of 16 estimated tokens in 63 characters, then "Way 1:" of 4 in 6: 16 of 20 cached ends at 63
    text = "Three ways to learn chess, one per line, each a full sentence.\n"
    assert estimate_tokens(text) == 16 and estimate_tokens("Way 1:") == 4
    assert cached_chars([(0, 63, 16), (63, 69, 4)], [(0, 0)], 69, 20, 16) == (63, False)


def test_a_batch_streams_into_a_program_view_at_a_batchs_pace(runtime):
    """ProgramView.run_batch streams its programs' gens in pieces at most every BATCH_INTERVAL seconds (a gen
    of `elapsed` seconds comes in at most elapsed / interval + 2 pieces), then at the view's own pace again."""
    from sgnb.widgets._ticker import BATCH_INTERVAL

    @sgl.function
    def tale(s, i):
        s += PREFIX + f"Tale {i}:" + sgl.gen("t", max_tokens=48, temperature=0, ignore_eos=True)

    pieces: dict[str, list[float]] = {}
    spans: dict[str, list[float]] = {}

    def record(e):
        now = time.monotonic()
        if e["type"] == "gen_begin":
            spans[e["program"]] = [now]
        elif e["type"] == "text" and e.get("var") == "t":
            pieces.setdefault(e["program"], []).append(now)
        elif e["type"] == "gen_end":
            spans[e["program"]].append(now)

    view = ProgramView()
    own = view._ticker.interval
    states = view.run_batch(tale, [{"i": i} for i in range(3)], backend=runtime, stream=True,
                            subscribers=[record])
    assert {st.executor.stream_interval_s for st in states} == {BATCH_INTERVAL}
    assert len(pieces) == 3 and view._ticker.interval == own
    for program, times in pieces.items():
        elapsed = spans[program][1] - spans[program][0]
        assert len(times) <= elapsed / BATCH_INTERVAL + 2, (len(times), elapsed)
    settle(view)
    assert [segs(p, "gen")[0]["text"] for p in view.programs] == [st["t"] for st in states]


@pytest.mark.parametrize("delay", [0.0, 600.0], ids=["live", "when-it-ends"])
def test_run_batch_shows_a_batch_view_in_a_notebook(runtime, monkeypatch, delay):
    """run_batch under a kernel with a frontend displays a BatchView (one row per program, in batch order: its
    arguments, variables, status, progress); a failing program reads "error"; elsewhere nothing is displayed.
    A batch still running after BatchTable.delay gets its table then (a live BatchView); one that ended sooner
    gets its final table when it ends (a BatchSnapshot: static HTML, no widget)."""
    import IPython

    from sgnb.widgets import _batch_view
    from sgnb.widgets._batch_view import BatchSnapshot
    from sgnb.widgets._ticker import BATCH_INTERVAL

    function = importlib.import_module("sgnb.function")  # (`sgnb.function` the attribute is the decorator)

    @sgl.function
    def qa(s, q):
        s += PREFIX + "Q: " + q + "\nA:" + sgl.gen("a", max_tokens=3, temperature=0)
        s += " Sure?" + sgl.select("sure", choices=[" yes", " no"])
        if q == "boom":
            raise ValueError("boom")

    assert function._batch_table("qa", [{}]) is None  # no kernel here: the script path is unchanged
    shown: list = []
    finished_when_shown: list[bool] = []
    monkeypatch.setattr(BatchTable, "delay", delay)
    monkeypatch.setattr(IPython, "get_ipython", lambda: type("Kernel", (), {"kernel": object()})())

    def record(view):
        shown.append(view)
        finished_when_shown.append(isinstance(view, BatchSnapshot) or view._batch.t_end is not None)

    monkeypatch.setattr(_batch_view, "show", record)
    questions = ["one?", "two?", "boom", "four?"]
    states = qa.run_batch([{"q": q} for q in questions], backend=runtime, progress_bar=True)
    (view,) = shown
    assert isinstance(view, BatchView if delay == 0 else BatchSnapshot)
    assert finished_when_shown == [delay > 0]  # (the live one is shown before finish(), whatever the timing)
    if isinstance(view, BatchView):
        view.flush()
    else:  # its output: the table as HTML, a row per program, and a short text form
        data, _ = view._repr_mimebundle_()
        assert "application/vnd.jupyter.widget-view+json" not in data
        assert data["text/html"].count("<tr>") == 1 + len(questions) and "boom" in data["text/html"]
        assert data["text/plain"] == "<BatchSnapshot 'qa': 3/4 done, 0 running, 1 failed>"
    assert view.columns == ["q", "a", "sure"]
    assert [r["arguments"]["q"] for r in view.rows] == [repr(q) for q in questions]
    assert [r["status"] for r in view.rows] == ["done", "done", "error", "done"]
    for r, st in zip(view.rows, states):
        if r["status"] == "done":
            assert r["values"] == {k: " ".join(st[k].split()) for k in ("a", "sure")}  # whitespace as one space
            # timed from the events' own arrival, not from the flush that applied them (which read 0.0)
            assert r["gens"] == r["gens_done"] == 1 and r["tokens"] >= 1 and r["elapsed"] > 0
    assert "boom" in view.rows[2]["error"]
    assert view.summary["total"] == 4 and view.summary["done"] == 3 and view.summary["error"] == 1
    # the table's gens stream at its refresh pace (a program's thread wakes no more often than the table syncs)
    assert {st.executor.stream_interval_s for st in states} == {BATCH_INTERVAL} and BATCH_INTERVAL >= 0.25
    shown.clear()
    qa.run_batch([{"q": "x"}], backend=runtime, subscribers=[lambda e: None])  # a caller's own view: no table
    assert shown == []


def test_batch_arguments_read_as_what_they_are():
    import numpy as np
    from PIL import Image

    from sgnb.widgets._batch_view import argument_text

    assert argument_text(Image.new("RGB", (64, 32))) == "[image 64x32 RGB]"
    assert argument_text(np.zeros((4, 5, 3), np.uint8)) == "[array (4, 5, 3) uint8]"
    assert argument_text(b"abc") == "[3 bytes]" and argument_text("q?") == "'q?'"
    assert "0x" not in argument_text(object())
    view = BatchView("t", [{"img": Image.new("L", (8, 8)), "q": "x"}])
    assert view.rows[0]["arguments"] == {"img": "[image 8x8 L]", "q": "'x'"}


def test_sgl_logprobs_switch_asks_every_gen(engine, monkeypatch):
    """`%%sgl --logprobs [K]` asks every gen of the cell for logprobs and K alternatives (5 by default), with
    their texts, and the cell's view gets them."""
    from IPython.testing.globalipapp import get_ipython, start_ipython

    from sgnb.kernel_ext import display as show
    from sgnb.kernel_ext import get_session

    ip = start_ipython() or get_ipython()  # the test shell is made once per process
    ip.run_line_magic("load_ext", "sgnb")
    ip.user_ns["lp_runtime"] = sgl.Runtime(engine=engine)
    ip.run_line_magic("sgl", "backend lp_runtime")
    views: list = []

    def live_view(name, *args, **kwargs):
        views.append(ProgramView(*args, **kwargs))
        return views[-1]

    monkeypatch.setattr(show, "live_view", live_view)
    monkeypatch.setattr(get_session(ip), "use_widgets", True)
    try:
        ip.run_cell_magic("sgl", "--logprobs --max-tokens 4 -o lp", 's += "Hello," + gen("a", temperature=0)')
        meta = ip.user_ns["lp"].executor.meta_info["a"]
        assert all(len(top) == 5 and top[0][2] is not None for top in meta["output_top_logprobs"])
        (view,) = views
        settle(view)
        (g,) = segs(view.programs[0], "gen")
        assert g["logprobs"] and all(len(t[3]) == 5 for t in g["tokens"])
        ip.run_cell_magic("sgl", "--logprobs 2 --no-widget -o lp2", 's += "Hi," + gen("a", max_tokens=2)')
        assert all(len(top) == 2 for top in ip.user_ns["lp2"].executor.meta_info["a"]["output_top_logprobs"])
        ip.run_cell_magic("sgl", "--no-widget -o plain", 's += "Hi," + gen("a", max_tokens=2)')
        assert "output_top_logprobs" not in ip.user_ns["plain"].executor.meta_info["a"]
    finally:
        ip.run_line_magic("unload_ext", "sgnb")
        sgl.set_default_backend(None)


# ---- RadixTreeView -----------------------------------------------------------------------------------------
def mirror_matches_engine(view: RadixTreeView, engine) -> None:
    snap = {n["id"]: n for n in engine.tree_snapshot(max_key_tokens=0)["nodes"]}
    mine = {n.id: n for n in view._nodes.values() if n.evicted_t is None}
    assert set(mine) == set(snap)
    for i, n in snap.items():
        m = mine[i]
        assert (m.parent, m.tokens, m.hits, m.locked) == (n["parent"], n["tokens"], n["hit_count"], n["lock_ref"] > 0)


def test_tree_view_follows_the_engine_and_marks_evictions(engine):
    engine.flush_cache()
    view = RadixTreeView(engine, fade_seconds=0.3)
    counts: list[int] = []
    view.observe(lambda ch: counts.append(ch["new"].get("nodes", 0)), names=["summary"])
    prompts = [PREFIX + f"Question {i}: what is {i} plus {i}?\nAnswer:" for i in range(10)]
    for i in range(0, 10, 2):  # in small batches, so the tree grows in steps
        engine.generate(prompts[i:i + 2], {"max_new_tokens": 4, "temperature": 0})
    view.flush()
    assert len(set(counts)) >= 4, f"the node count passed through intermediate states: {counts}"
    mirror_matches_engine(view, engine)
    rows = view.nodes
    assert view.summary["nodes"] == len(engine.tree_snapshot()["nodes"]) == len(rows)
    assert {r["state"] for r in rows} & {"new", "hit"}
    root = next(r["id"] for r in rows if r["parent"] is None)
    shared = [r for r in rows if r["parent"] == root]
    assert len(shared) == 1 and shared[0]["hits"] >= 4 and "helpful assistant" in shared[0]["text"]

    before = view.summary["nodes"]
    engine.flush_cache()
    view.flush()
    evicted = [r for r in view.nodes if r["state"] == "evicted"]
    assert len(evicted) == before - 1 and view.summary["nodes"] == 1 and view.summary["evicting"] == before - 1
    assert wait_until(lambda: (view.flush() or True) and len(view.nodes) == 1, timeout=5)
    assert view.nodes[0]["parent"] is None
    view.detach()
    assert not view.attached and view._callback not in engine.events._subscribers


def test_tree_view_details_name_the_requests_sharing_a_node(engine):
    engine.flush_cache()
    view = RadixTreeView(engine)
    engine.generate(PREFIX + "First question?", {"max_new_tokens": 3, "temperature": 0}, rid="req-one")
    engine.generate(PREFIX + "Second question?", {"max_new_tokens": 3, "temperature": 0}, rid="req-two")
    view.flush()
    root = next(r["id"] for r in view.nodes if r["parent"] is None)
    (shared,) = [r for r in view.nodes if r["parent"] == root]
    view.selected = shared["id"]  # what a click in the frontend does
    d = view.details
    assert d["id"] == shared["id"] and "helpful assistant" in d["text"]
    assert {"req-one", "req-two"} <= set(d["rids"]), d["rids"]
    leaf = next(r for r in view.nodes if r["kids"] == 0 and r["parent"] is not None)
    view.selected = leaf["id"]
    assert view.details["prefix"].startswith(d["text"]) and view.details["rids"]

    view.collapsed = [shared["id"]]  # fold: the subtree leaves the rows, the node says how much it hides
    rows = {r["id"]: r for r in view.nodes}
    assert rows[shared["id"]]["collapsed"] and rows[shared["id"]]["hidden"] >= 2
    assert not any(r["parent"] == shared["id"] for r in view.nodes)
    view.detach()


def test_tree_view_aggregates_above_max_nodes(engine):
    engine.flush_cache()
    view = RadixTreeView(engine, max_nodes=12)
    prompts = [PREFIX + f"Topic {i}: " + ("cats" if i % 2 else "dogs") + f" number {i}." for i in range(24)]
    engine.generate(prompts, {"max_new_tokens": 1, "temperature": 0})
    view.flush()
    total = view.summary["nodes"]
    assert total > 24
    nodes = [r for r in view.nodes if not r.get("group")]
    groups = [r for r in view.nodes if r.get("group")]
    assert len(view.nodes) <= 12 and groups and view.summary["groups"] == len(groups)
    # every node is drawn, or counted in a group, or below a node the overview folded
    assert len(nodes) + sum(g["count"] for g in groups) + sum(r.get("below", 0) for r in nodes) == total
    shown = {r["id"] for r in nodes}
    assert all(g["parent"] in shown for g in groups)

    g = max(groups, key=lambda g: g["children"])
    view.expanded = [g["parent"]]  # a click on the "+N nodes" group
    kids = [r for r in view.nodes if r["parent"] == g["parent"] and not r.get("group")]
    assert len(kids) == len([c for c in view._nodes.values() if c.parent == g["parent"]])
    assert len([r for r in view.nodes if not r.get("group")]) <= 2 * 12
    view.detach()


def test_tree_view_shows_an_image_node_as_a_chip(llava_engine):
    """The image's hundreds of pad ids read "[image]" once, the text after it stays in the label, and the
    node carries a small thumbnail chip (the engine's own, larger, in the details)."""
    from PIL import Image

    eng = llava_engine
    eng.flush_cache()
    view = RadixTreeView(eng)
    red, green = Image.new("RGB", (64, 48), (220, 30, 30)), Image.new("RGB", (64, 48), (30, 200, 30))
    params = {"max_new_tokens": 2, "temperature": 0}
    eng.generate("USER: <image>\nWhat is in it? ASSISTANT:", params, image_data=red)
    again = eng.generate("USER: <image>\nWhat colour is it? ASSISTANT:", params, image_data=red)
    eng.generate("Compare <image> and <image>.", params, image_data=[green, red])
    view.flush()
    snap = {n["id"]: n for n in eng.tree_snapshot(max_key_tokens=10**6)["nodes"]}
    held = [r for r in view.nodes if r.get("media")]
    assert {r["id"] for r in held} == {i for i, n in snap.items() if n.get("media")}
    for r in held:  # the chips are the snapshot's media, their thumbnails shrunk
        assert [(m["kind"], m["hash"], m["tokens"]) for m in r["media"]] == \
            [(m["kind"], m["hash"], m["tokens"]) for m in snap[r["id"]]["media"]]
        assert all(max(_image_of(m["thumbnail"]).size) <= 48 for m in r["media"])
        assert r["text"].count("[image]") == len(r["media"]) and "<image>" not in r["text"]
    (one,) = [r for r in held if r["text"].startswith("USER: [image]")]  # prefilled once, then reused
    assert again["meta_info"]["cached_tokens"] >= one["media"][0]["tokens"] > 1
    (two,) = [r for r in held if r["text"].startswith("Compare")]
    assert two["text"] == "Compare [image] and [image]."  # the text between and after the images stays
    assert [m["hash"] for m in two["media"]][1] == one["media"][0]["hash"] != two["media"][0]["hash"]

    view.selected = one["id"]
    (m,) = view.details["media"]
    assert m["thumbnail"] == snap[one["id"]]["media"][0]["thumbnail"]  # the engine's own thumbnail
    assert "[image]" in view.details["text"]
    view.detach()


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _SyntheticEngine:
    """The engine's real RadixCache and EventBus with no model: lets a test grow a tree of thousands of nodes."""

    def __init__(self):
        from sgnb.engine.events import EventBus
        from sgnb.engine.radix_cache import RadixCache

        self.events = EventBus()
        self.tree = RadixCache(lambda slots: None, emit=self.events.emit)
        self.tokenizer = _Tokenizer()

    def subscribe(self, callback, replay=False):
        return self.events.subscribe(callback, replay=replay)

    def tree_snapshot(self, max_key_tokens=64):  # the view API of sgnb.engine.Engine
        return {"nodes": self.tree.snapshot(None, max_key=max_key_tokens)}

    def node_key(self, node_id):
        node = self.tree.nodes.get(node_id)
        return None if node is None else node.key


def test_tree_view_stays_small_and_fast_at_5000_nodes():
    import random

    import numpy as np

    eng = _SyntheticEngine()
    view = RadixTreeView(eng, max_nodes=300)
    rng = random.Random(0)
    while len(eng.tree.nodes) < 5200:  # random branching keys: inserts split nodes, the tree grows fast
        key = [rng.randrange(4) for _ in range(3)] + [rng.randrange(50) for _ in range(rng.randrange(1, 8))]
        eng.tree.insert(key, np.arange(len(key)))
    n = len(eng.tree.nodes)
    t0 = time.perf_counter()
    view.flush()
    took = time.perf_counter() - t0
    assert view.summary["nodes"] == n
    counted = sum(r.get("count", 0) + r.get("below", 0) for r in view.nodes)  # in groups, folded into a node
    assert len(view.nodes) <= 2 * 300 and counted + view.summary["shown"] == n and view.summary["overview"]
    # guards against a blow-up (a flush or layout that walks the whole tree per node), not speed targets: those
    # live in the widget-overhead benchmark (a flush took ~0.3-0.5 s here, and twice that on a busy machine)
    assert took < 10, f"a flush of {n} nodes took {took:.2f}s"
    t0 = time.perf_counter()
    view.layout()
    took = time.perf_counter() - t0
    assert took < 5, f"a layout of a {n}-node tree took {took:.2f}s"
    view.detach()


def test_a_slow_view_keeps_to_its_cpu_budget():
    """A tick that costs 10 ms of CPU (a huge tree) is followed by a wait of at least 10 ms * (1 / max_share
    - 1): the view's thread never holds more than max_share (2%) of the GIL the engine's scheduler needs."""
    from sgnb.widgets._ticker import Ticker

    starts: list[float] = []

    def tick() -> bool:
        starts.append(time.monotonic())
        end = time.thread_time() + 0.01
        while time.thread_time() < end:
            pass
        return True

    ticker = Ticker(tick, 0.05, "sgnb-test-ticker")
    assert ticker.max_share == 0.02
    ticker.start()
    time.sleep(1.3)
    ticker.stop()
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 2 and min(gaps) >= 0.01 * (1 / 0.02 - 1), gaps
    assert ticker.cpu_seconds <= ticker.wall_seconds + 1e-3 and ticker.cpu_seconds / ticker.ticks >= 0.01


def test_tree_view_does_no_work_on_the_scheduler_thread(engine):
    """The engine's callback is a deque's C-level append; everything else runs on the view's own thread, and
    the view thread's CPU time is a tiny share of the workload's time (what it could take from the engine)."""
    engine.flush_cache()
    view = RadixTreeView(engine)
    cb = view._callback
    assert type(cb).__name__ == "builtin_function_or_method" and cb.__self__ is view._events
    assert cb == view._events.append and cb in engine.events._subscribers

    # count and time the appends on the scheduler thread with a recording deque (test-only instrumentation)
    calls: list[tuple[str, float]] = []

    class Recording(deque):
        def append(self, event):
            t = time.perf_counter()
            super().append(event)
            calls.append((threading.current_thread().name, time.perf_counter() - t))

    recording = Recording()
    view._unsubscribe()
    view._events, view._callback = recording, recording.append
    view._unsubscribe = engine.subscribe(recording.append)

    ran_on: set[str] = set()
    real_layout = view.layout

    def layout():
        ran_on.add(threading.current_thread().name)
        return real_layout()

    view.layout = layout
    seq0 = len(engine.event_history())
    cpu0 = view._ticker.cpu_seconds
    prompts = [PREFIX + f"Question {i}: what is {i} plus {i}?\nAnswer:" for i in range(16)]
    t0 = time.perf_counter()
    engine.generate(prompts, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    wall = time.perf_counter() - t0
    time.sleep(0.15)
    view.flush()
    cpu = view._ticker.cpu_seconds - cpu0

    assert calls and {name for name, _ in calls} == {"sgnb-scheduler"}
    assert len(calls) == len(engine.event_history()) - seq0 or len(engine.event_history()) == 10_000
    per_call = sorted(d for _, d in calls)[len(calls) // 2]
    assert per_call < 20e-6, f"median append took {per_call * 1e6:.1f} us"
    assert "sgnb-scheduler" not in ran_on and ran_on
    assert cpu / wall < 0.03, f"the view thread used {100 * cpu / wall:.2f}% of the workload's time"
    view.detach()


# ---- EngineStats ---------------------------------------------------------------------------------------
def test_engine_stats_update(engine):
    stats = EngineStats(engine, interval=0.25)
    assert stats.attached and stats.stats["kv_total"] > 0
    before = stats.stats["requests_finished"]
    engine.generate([PREFIX + "Hi?", PREFIX + "Hello?"], {"max_new_tokens": 4, "temperature": 0})
    assert wait_until(lambda: stats.stats["requests_finished"] >= before + 2, timeout=5)
    h = stats.history
    assert set(h) == {"hit_rate", "gen_tokens_per_s", "prefill_tokens_per_s", "kv_used_frac", "kv_cached_frac",
                      "waiting", "running"}
    assert len(h["gen_tokens_per_s"]) >= 2 and max(h["gen_tokens_per_s"]) > 0
    assert all(0 <= v <= 1 for k in ("hit_rate", "kv_used_frac", "kv_cached_frac") for v in h[k])
    assert max(h["hit_rate"]) > 0.5, "the second request hit the shared prefix"
    assert "hit rate" in repr(stats)
    stats.detach()
    assert not stats.attached
    polls = stats.polls
    time.sleep(0.6)
    assert stats.polls == polls


def test_stats_hit_rate_is_per_interval():
    prev = {"prompt_tokens": 100, "cached_tokens": 10, "kv_total": 100, "kv_used": 5}
    cur = {"prompt_tokens": 200, "cached_tokens": 90, "kv_total": 100, "kv_used": 50, "kv_cached": 20}
    p = _point(prev, cur, 0.3)
    assert p["hit_rate"] == pytest.approx(0.8) and p["kv_used_frac"] == 0.5 and p["kv_cached_frac"] == 0.2
    assert _point(cur, cur, 0.3)["hit_rate"] == 0.3  # no new prompt: the last rate holds
