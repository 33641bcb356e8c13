"""What a StreamExecutor shows of its run to the code around it (ProgramState, SglFunction, the `%%sgl` magic, the
batch view), so that only the interpreter assigns its fields: `failure`, `current_line`, `abort_all()`, and the
name and subscribers it starts with. No model: a backend that answers "ok", or fails."""

from __future__ import annotations

import sgnb as sgl
from sgnb.backends.base import Backend, BackendError
from sgnb.interpreter import Failure, StreamExecutor


class _Answers(Backend):
    """Answers every gen with "ok", or fails each one with a BackendError."""

    def __init__(self, down: bool = False) -> None:
        self.down = down

    def get_model_name(self) -> str:
        return "answers"

    def generate(self, ctx, params):
        if self.down:
            raise BackendError("the backend is down")
        return "ok", {}


@sgl.function
def _ask(s):
    s += "Q:"
    s += sgl.gen("a", max_tokens=3)


def test_a_finished_program_has_no_failure():
    state = _ask.run(backend=_Answers())
    assert state.error() is None
    assert state.executor.failure is None
    assert state.executor.current_line is None
    assert state.executor.name == "_ask"  # set when it was made: views show it from program_begin on


def test_a_failed_gen_is_the_failure_at_its_program_line():
    state = _ask.run(backend=_Answers(down=True))
    assert state.error() is not None
    failure = state.executor.failure
    assert isinstance(failure, Failure)
    assert isinstance(failure.error, BackendError) and not failure.interrupted
    assert failure.where is not None and "sgl.gen(" in failure.where  # the line that appended the gen
    assert state.executor.current_line == failure.where


def test_abort_all_interrupts_the_state_its_forks_and_theirs():
    events: list[dict] = []
    exe = StreamExecutor(_Answers(), name="prog", subscribers=[events.append])
    forks = exe.fork(2)
    nested = forks[0].fork(1)
    exe.abort_all()
    everyone = [exe, *forks, *nested]
    assert all(e.failure is not None and e.failure.interrupted for e in everyone)
    errors = [ev["program"] for ev in events if ev["type"] == "error"]
    assert sorted(errors) == sorted(e.id for e in everyone)  # forks inherit the subscribers
    assert {e.name for e in everyone} == {"prog"}
    # an interrupted state reads what it wrote until then; it does not raise
    assert sgl.ProgramState(exe).text() == ""
