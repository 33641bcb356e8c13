"""The shared program suite on every backend (the in-process Runtime here; remote backends join via
`program_backend` params once their servers are up in this session)."""

from __future__ import annotations

import pytest

import sgnb as sgl

from . import programs as P  # noqa: N812

ENGINE = "default"  # its assertions hold for any model: the quantized engine (tests/conftest.py)


@pytest.fixture(scope="module", params=["runtime", "endpoint", "openai"])
def backend(request, engine):
    """The same programs in-process, over SGLang's native HTTP API, and over the OpenAI API (official client)."""
    if request.param == "runtime":
        return sgl.Runtime(engine=engine)
    server = request.getfixturevalue("server")
    if request.param == "endpoint":
        return sgl.RuntimeEndpoint(server.url)
    return sgl.OpenAI(engine.model_name, base_url=server.url + "/v1", api_key="local", is_chat_model=False)


def test_few_shot_qa(backend):
    states = P.few_shot_qa.run_batch([{"question": q} for q in ("What is hot?", "What barks?", "What flies?")],
                                     backend=backend)
    for st in states:
        P.check_few_shot_qa(st)
    # the few-shot prefix was cached once: later programs hit it
    assert sum(st.get_meta_info("answer")["cached_tokens"] for st in states) >= 2 * 30


def test_select(backend):
    P.check_pick_letter(P.pick_letter.run(question="What color is grass?", backend=backend))


def test_fork_join_parallel_decoding(backend):
    P.check_parallel_tips(P.parallel_tips.run(topic="sleep", backend=backend))


def test_concate_and_append(backend):
    docs = ["cats purr", "dogs bark", "birds sing"]
    P.check_parallel_encode(P.parallel_encode.run(docs=docs, backend=backend), docs)


def test_multi_turn_chat(backend):
    turns = ["Hi!", "Name a fruit."]
    P.check_chat(P.chat.run(turns=turns, backend=backend), turns)


def test_react_loop(backend):
    P.check_react(P.react.run(question="Who wrote Hamlet?", backend=backend))


def test_tool_use_var_scope(backend):
    P.check_tool_use(P.tool_use.run(city="Paris", backend=backend), "Paris")


def test_error_in_one_program_of_a_batch(backend):
    states = P.may_fail.run_batch([{"i": i} for i in range(4)], backend=backend)
    assert states[2].error() is not None and "item 2 is broken" in str(states[2].error())
    assert "programs.py" in str(states[2].error())  # names the program line
    for i in (0, 1, 3):
        assert states[i].error() is None and isinstance(states[i]["out"], str)
    with pytest.raises(sgl.ProgramError, match="item 2"):
        states[2]["out"]


def test_streaming_text_iter(backend):
    # every step's text as it comes (the Runtime's default coalesces to one piece per 0.05 s: on a CPU that
    # decodes the 16 tokens in ~0.2 s that made 3-5 pieces, and this test flaky)
    state = P.streamed.run(stream=True, stream_interval_s=0, backend=backend)
    pieces = list(state.text_iter("rest"))
    assert len(pieces) > 3 and "".join(pieces) == state["rest"]
    full = "".join(state.text_iter())
    assert full == state.text()
    # SGLang's return_meta_data: (text, meta_info) pairs; the token count grows, the last is the gen's whole meta
    pairs = list(state.text_iter("rest", return_meta_data=True))
    assert "".join(t for t, _ in pairs) == state["rest"]
    if not isinstance(backend, sgl.OpenAI):  # OpenAI's stream chunks carry no token counts
        counts = [m["completion_tokens"] for _, m in pairs]
        assert counts == sorted(counts) and counts[-1] == state.get_meta_info("rest")["completion_tokens"]


def test_streamed_logprobs_arrive_per_chunk(backend):
    """SGLang's contract (its test_stream_logprobs): with logprobs asked for, each streamed (text, meta) pair
    carries its new tokens' logprobs only, and output_token_logprobs_length the count so far."""
    if isinstance(backend, sgl.OpenAI):
        pytest.skip("OpenAI's chat stream carries no SGLang meta_info")

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", return_logprob=True, max_tokens=12, temperature=0))

    state = qa.run(question="Name three colors.", stream=True, backend=backend)
    pairs = list(state.text_iter("answer", return_meta_data=True))
    assert pairs and "".join(t for t, _ in pairs) == state["answer"]
    seen = 0
    for _text, meta in pairs:
        new = meta["output_token_logprobs"]
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"] == seen + len(new)
        seen += len(new)
    assert seen == state.get_meta_info("answer")["completion_tokens"]
    assert len(state.get_meta_info("answer")["output_token_logprobs"]) == seen  # the gen's own meta: all of them


def test_gen_n_samples(backend):
    """SGLang's gen(n=k): the variable holds the k samples (each converted by dtype), the text goes on with the
    first, and the meta_info is the first's with every sample's ("samples")."""

    @sgl.function
    def fruits(s):
        s += "Name a fruit:" + sgl.gen("fruit", n=3, max_tokens=6, stop="\n", temperature=1.0)
        s += "\nA number:" + sgl.gen("number", n=2, dtype=int, max_tokens=4, temperature=1.0)

    st = fruits.run(backend=backend)
    assert st.error() is None, st.error()
    assert isinstance(st["fruit"], list) and len(st["fruit"]) == 3
    assert all(isinstance(f, str) and "\n" not in f for f in st["fruit"])
    assert st.text().startswith("Name a fruit:" + st["fruit"][0] + "\nA number:")
    assert len(st.get_meta_info("fruit")["samples"]) == 3
    assert len(st["number"]) == 2 and all(isinstance(k, int) for k in st["number"])
    assert int(st.text().rsplit("A number:", 1)[1]) == st["number"][0]


def test_gen_errors_at_the_call_site():
    with pytest.raises(ValueError, match="temperature"):
        sgl.gen("x", temperature=-1)
    with pytest.raises(TypeError, match="max_new_token"):
        sgl.gen("x", max_new_token=3)  # a typo names itself
    with pytest.raises(ValueError, match="choices"):
        sgl.select("x", choices=[])
    with pytest.raises(ValueError, match=r"gen\(n=\.\.\.\) must be an int >= 1"):
        sgl.gen("x", n=0)


def test_backend_error_surfaces_with_program_line(backend):
    @sgl.function
    def too_long(s):
        s += "word " * 9000
        s += sgl.gen("x", max_tokens=2)

    st = too_long.run(backend=backend)
    err = st.error()
    assert err is not None and "context length" in str(err) and "test_programs.py" in str(err)


def test_frontend_hint_caches_prefix_before_batch(engine, backend):
    if isinstance(backend, sgl.OpenAI):
        pytest.skip("the OpenAI API has no cache-prefix call")
    engine.flush_cache()
    P.few_shot_qa.run_batch([{"question": f"Q{i}?"} for i in range(4)], backend=backend)
    prefix_tokens = len(engine.tokenizer.encode(P.FEW_SHOT + "Q: "))
    stats = engine.get_stats()
    # with the hint the prefix is prefilled once (by the hint) and every program hits it
    assert stats["cached_tokens"] >= 4 * (prefix_tokens - 2)


def test_trace_constant_prefix(backend):
    if not isinstance(backend, sgl.Runtime):
        pytest.skip("backend-independent")
    traced = P.few_shot_qa.trace(backend)
    assert traced.constant_prefix == P.FEW_SHOT + "Q: "
    assert any(type(n).__name__ == "Gen" for n in traced.nodes)


async def _async_run(backend):
    state = await P.few_shot_qa.run_async(question="What is cold?", backend=backend)
    chunks = [c async for c in P.streamed.run(stream=True, stream_interval_s=0, backend=backend)
              .text_async_iter("rest")]  # every step's text: more than one piece whatever the decode speed
    return state, chunks


def test_async_apis_inside_a_running_loop(backend):
    import asyncio

    state, chunks = asyncio.run(_async_run(backend))
    P.check_few_shot_qa(state)
    assert len(chunks) > 1


def test_typed_gens_and_regex(backend):
    if isinstance(backend, sgl.OpenAI):
        pytest.skip("regex constraints are not part of the OpenAI API")
    P.check_typed_values(P.typed_values.run(temperature=0, backend=backend))


def test_json_schema_extraction(backend):
    P.check_extract_json(P.extract_json.run(text="Ana, 34, lives in Rome.", backend=backend))


def test_pydantic_schema_and_invalid_constraints_at_gen_line():
    import pydantic

    class Point(pydantic.BaseModel):
        x: int
        y: int

    node = sgl.gen("p", json_schema=Point)
    assert '"x"' in node.params.json_schema
    with pytest.raises(ValueError, match="invalid regex"):
        sgl.gen("x", regex="(unclosed")
    with pytest.raises(ValueError, match="json_schema"):
        sgl.gen("x", json_schema="{not json")


def test_interrupting_run_batch_aborts_every_program(engine):
    """Ctrl-C in a plain cell running run_batch: every program stops, no request keeps a cache lock."""
    import signal
    import threading
    import time

    backend = sgl.Runtime(engine=engine)

    @sgl.function
    def long_story(s, i):
        s += f"Story {i}:" + sgl.gen("a", max_tokens=400, ignore_eos=True, temperature=0.7)
        s += "\nNext:" + sgl.gen("b", max_tokens=400, ignore_eos=True)

    # a real SIGINT, like a kernel interrupt, once the programs are decoding (a timer fired blind could come
    # before the batch ran or after it ended); sent to the main thread, as the kernel's interrupt reaches it
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # (tests/conftest.py keeps it so)
    main = threading.main_thread().ident
    fired = threading.Event()

    def interrupt_when_running() -> None:
        deadline = time.time() + 60
        while engine.get_stats()["running"] < 3 and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        fired.set()
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt_when_running, daemon=True).start()
    t0 = time.time()
    with pytest.raises(KeyboardInterrupt):
        long_story.run_batch([{"i": i} for i in range(6)], backend=backend, num_threads=3)
    assert fired.is_set(), "run_batch returned before the interrupt: its programs did not run"
    assert time.time() - t0 < 60
    deadline = time.time() + 20
    while (engine.scheduler.busy or engine.tree.protected_size) and time.time() < deadline:
        time.sleep(0.05)
    assert engine.get_stats()["running"] == 0 and engine.tree.protected_size == 0
    assert engine.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_reading_a_variable_nothing_sets_fails_at_once(engine):
    """`s["missing"]` raised nothing and waited forever (a %%sgl cell sat at [*]); now it raises KeyError at once,
    naming the variables there are, inside the program and after it, while a variable still being generated
    is waited for as before."""
    import threading

    backend = sgl.Runtime(engine=engine)
    seen: dict = {}

    @sgl.function
    def prog(s):
        s += "Say hi:" + sgl.gen("a", max_tokens=3, temperature=0)
        seen["a"] = s["a"]  # appended just now: waited for
        try:
            s["nope"]
        except KeyError as e:
            seen["inside"] = str(e)

    box: dict = {}

    def run() -> None:
        st = prog.run(backend=backend)
        try:
            st["missing"]
        except KeyError as e:
            box["after"] = str(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "reading an unset variable hung"
    assert isinstance(seen["a"], str)
    assert "'nope'" in seen["inside"] and "['a']" in seen["inside"]
    assert "'missing'" in box["after"] and "['a']" in box["after"]

    @sgl.function
    def typo(s):
        s += "Say hi:" + sgl.gen("a", max_tokens=24, temperature=0, ignore_eos=True)
        try:
            s["answer"]  # read at once: "a" is still being generated
        except KeyError as e:
            seen["typo"] = str(e)

    typo.run(backend=backend).sync()
    assert "being generated: ['a']" in seen["typo"] and "did you mean 'a'?" in seen["typo"], seen["typo"]


def test_select_temperature_draws_from_the_choices_scores(engine):
    """select(temperature=) was validated, passed to every backend and used by none: now 0 takes the best
    choice and > 0 draws from softmax(score / temperature), with the probabilities in meta_info."""
    import math
    import random

    backend = sgl.Runtime(engine=engine)
    choices = [" red", " green", " blue"]

    @sgl.function
    def pick(s, t):
        s += "The colour of grass is" + sgl.select("c", choices=choices, temperature=t)

    best = pick.run(0.0, backend=backend)["c"]
    assert pick.run(1e-6, backend=backend)["c"] == best  # a tiny temperature is the argmax
    state = pick.run(1.0, backend=backend)
    meta = state.get_meta_info("c")
    scores = meta["normalized_prompt_logprobs"]
    expect = [math.exp(v - max(scores)) for v in scores]
    assert meta["choice_probs"] == pytest.approx([e / sum(expect) for e in expect])
    random.seed(7)
    drawn = {pick.run(1000.0, backend=backend)["c"] for _ in range(24)}  # near-uniform: all three come up
    assert drawn == set(choices)
    random.seed(3)
    first = [pick.run(2.0, backend=backend)["c"] for _ in range(5)]
    random.seed(3)
    assert [pick.run(2.0, backend=backend)["c"] for _ in range(5)] == first  # seeded: the same draws
    with pytest.raises(ValueError, match="greedy_token_selection"):
        sgl.select("c", choices=choices, temperature=0.5, choices_method="greedy_token_selection")
    with pytest.raises(ValueError, match=">= 0"):
        sgl.select("c", choices=choices, temperature=-1)
