"""A finished state continues (a new run from its text, its prefix hit in the radix cache); what cannot
continue says so at the append; copies end with their program; a multi-line statement is named whole."""

from __future__ import annotations

import pytest

import sgnb as sgl
from sgnb.backends.base import Backend

ENGINE = "default"  # its assertions hold for any model: the quantized engine (tests/conftest.py)


@pytest.fixture(scope="module")
def backend(engine):
    return sgl.Runtime(engine=engine)


@sgl.function
def first_turn(s, question):
    s += sgl.system("You are terse.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("a1", max_tokens=4, temperature=0))


def test_a_finished_state_continues_from_its_text_and_hits_the_cache(backend, engine):
    state = first_turn.run(question="Name a color.", backend=backend)
    assert state.executor.ended  # run() returned: the body is done
    before_text, before_messages = state.text(), state.messages()
    prompt1 = state.get_meta_info("a1")["prompt_tokens"]
    cached_before = engine.get_stats()["cached_tokens"]

    state += sgl.user("Another one.")
    state += sgl.assistant(sgl.gen("a2", max_tokens=4, temperature=0))
    assert isinstance(state["a2"], str)

    text = state.text()
    assert text.startswith(before_text) and "Another one." in text[len(before_text):]
    assert state["a2"] in text[len(before_text):]
    assert state.messages()[: len(before_messages)] == before_messages
    assert [m["role"] for m in state.messages()[len(before_messages):]] == ["user", "assistant"]
    assert state["a1"] and set(state.variables()) == {"a1", "a2"}  # the first run's variables are still there
    # the new request started from the old text: its prefix was in the radix cache
    meta = state.get_meta_info("a2")
    assert meta["cached_tokens"] >= prompt1, meta
    assert engine.get_stats()["cached_tokens"] - cached_before >= prompt1
    # and it goes on again, through a program run on the same state
    @sgl.function
    def third(s):
        s += sgl.user("And a third.")
        s += sgl.assistant(sgl.gen("a3", max_tokens=3, temperature=0))

    assert third.run_on(state) is state
    assert state["a3"] and state.get_meta_info("a3")["cached_tokens"] >= meta["prompt_tokens"]
    assert "".join(state.text_iter()) == state.text()  # a continued state's stream reads its whole text


def test_copies_and_forks_of_a_finished_state(backend):
    state = first_turn.run(question="Name a fruit.", backend=backend)
    a, b = state.copy(), state.copy()
    a += sgl.user("Red?") + sgl.gen("x", max_tokens=2)
    b += sgl.user("Green?") + sgl.gen("x", max_tokens=2)
    assert a["x"] and b["x"]
    assert a.text().startswith(state.text()) and "Green?" not in a.text() and "Red?" not in state.text()
    forks = state.fork(2)
    forks += sgl.gen("y", max_tokens=2)
    forks.join()
    state += "Done."  # the parent was finished: the join's values are in the continued state
    assert len(state["y"]) == 2 and state.text().endswith("Done.")


class _Calls(Backend):
    """Answers a constrained gen (a tool call) with a call to add, any other gen with "ok"."""

    def get_model_name(self) -> str:
        return "calls"

    def generate(self, ctx, params):
        return ('{"name": "add", "arguments": {"a": 2, "b": 3}}' if params.json_schema else "ok"), {}


ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


def test_forks_copies_and_continuations_inherit_the_open_role_and_its_calls():
    """What a new executor inherits from its state (one copy for the three): the open assistant message with its
    call, and, once it ended, the call a tool message answers next."""

    @sgl.function
    def asks(s):
        s += sgl.user("Add 2 and 3.")
        s += sgl.assistant_begin()
        s += sgl.gen("call", tools=[ADD], tool_choice="required")

    state = asks.run(backend=_Calls())
    (call,) = state.tool_calls("call")
    asked = {"role": "assistant", "content": "", "tool_calls": [call]}
    copy = state.copy()
    (fork,) = state.fork(1)
    for branch in (copy, fork, state):  # state: its continuation
        branch += sgl.assistant_end()
        branch += sgl.tool("5")
    for branch in (copy, fork, state):
        assert branch.messages()[1:] == [asked, {"role": "tool", "content": "5", "tool_call_id": call["id"]}]
        assert branch.text() == state.text()
    later = state.copy()  # the call was answered: a copy has none left to answer
    later += sgl.tool("again")
    assert "tool_call_id" not in later.messages()[-1]


def test_a_state_that_cannot_continue_says_so_at_the_append(backend):
    @sgl.function
    def broken(s):
        s += "x" + sgl.gen("a", max_tokens=2)
        s += sgl.image("no-such-file.png")  # the text model takes no images: fails on the program's thread

    state = broken.run(backend=backend)
    with pytest.raises(sgl.ProgramError, match="cannot continue: re-run") as info:
        state += "more"
    assert "failed" in str(info.value) and "takes no images" in str(info.value)

    @sgl.function
    def long(s):
        s += "Count:" + sgl.gen("n", max_tokens=400, ignore_eos=True)

    state = long.run(backend=backend)
    state.abort()
    with pytest.raises(sgl.ProgramError, match="was interrupted, so it cannot continue"):
        state += "more"
    assert "aborted: aborted" not in str(state.error())  # the abort, not its request's failure


def test_a_copy_ends_with_its_program(backend):
    """A `s.copy()` (or fork) never joined used to stay open forever: its view read "running"."""
    seen: list[dict] = []
    # the branches, held: a state keeps its forks and copies weakly (`children`), so one that has finished and
    # that nothing references may be collected before descendants() is read (a fresh-clone run saw 2 of 3)
    kept: list = []

    @sgl.function
    def with_copy(s):
        s += "Hello" + sgl.gen("a", max_tokens=2)
        c = s.copy()
        c += " copy" + sgl.gen("b", max_tokens=2)
        forks = s.fork(2)
        forks += sgl.gen("c", max_tokens=2)
        kept.extend([c, *forks])

    state = with_copy.run(backend=backend, subscribers=[seen.append])
    state.sync()
    branches = state.executor.descendants()
    assert len(branches) == 3
    for b in branches:
        b.wait(b.drained, "sync")
    assert all(b.ended and b.done for b in branches)
    ended = {e["program"] for e in seen if e["type"] == "end"}
    assert ended == {state.executor.id, *(b.id for b in branches)}


def test_an_error_in_a_multi_line_statement_names_the_whole_statement(backend):
    @sgl.function
    def multi(s):
        s += "Ideas:"
        forks = s.fork(2)
        i = 0
        forks[
            i] += sgl.gen("a",
                          max_tokens=2)  # a comment is not part of it
        forks[1] += sgl.image(
            "no-such-file.png")
        forks.join()

    import inspect

    lines, start = inspect.getsourcelines(multi.func)
    first = start + next(n for n, line in enumerate(lines) if line.strip() == "forks[")
    image_line = start + next(n for n, line in enumerate(lines) if "forks[1] +=" in line)
    state = multi.run(backend=backend)
    err = state.error()
    assert err is not None
    assert f'test_continuation.py:{image_line}: forks[1] += sgl.image("no-such-file.png")' in str(err), err
    # the location of every primitive names the statement's first line, the statement on one line
    where = sgl.gen("a", max_tokens=2).where
    assert where is not None and where.endswith('sgl.gen("a", max_tokens=2).where')
    from sgnb.user_code import location

    assert location(__file__, first + 2).endswith(f':{first}: forks[i] += sgl.gen("a", max_tokens=2)')


def test_a_python_error_in_a_multi_line_statement_names_it_too(backend):
    @sgl.function
    def typo(s):
        s += "Hi" + sgl.gen(
            "a", max_tokens=2,
            temperature=-1)

    import inspect

    lines, start = inspect.getsourcelines(typo.func)
    first = start + next(n for n, line in enumerate(lines) if 's += "Hi" + sgl.gen(' in line)
    err = typo.run(backend=backend).error()
    assert f':{first}: s += "Hi" + sgl.gen("a", max_tokens=2, temperature=-1))' in str(err), err
    assert "sampling" not in str(err).split("(at ")[-1]  # the user's line, not where sgnb raised it
