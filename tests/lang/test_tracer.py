"""The tracer runs a program body on a TracingState (a ProgramState over a recording executor): roles are built
once (sgnb.primitives.role) and the constant prefix is rendered by the interpreter itself, so it is exactly the
text a run starts with (role prefixes and the template's default system prompt included)."""

from __future__ import annotations

import pytest

import sgnb as sgl
from sgnb import ir
from sgnb.backends.base import Backend
from sgnb.chat_template import CHATML, PLAIN, ROLES, ChatTemplate
from sgnb.tracer import Placeholder, TracingState

WITH_SYSTEM = ChatTemplate("tags", {r: (f"<{r}>", f"</{r}>") for r in ROLES}, default_system_prompt="Be kind.")


class _Prompts(Backend):
    """Answers every gen with "ok"; keeps the text each gen was asked to continue."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        self.prompts: list[str] = []

    def get_model_name(self) -> str:
        return "prompts"

    def get_chat_template(self) -> ChatTemplate:
        return self.template

    def generate(self, ctx, params):
        self.prompts.append(ctx.text)
        return "ok", {}


@sgl.function
def _chat(s, question):
    s += sgl.user("Question: " + question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=4))


@sgl.function
def _scoped(s, question):
    s += "Intro. "
    with s.user():
        s += "Q: "
        s += question
    s.assistant(sgl.gen("answer", max_tokens=4))


@sgl.function
def _constant_turns(s, question):
    s.system("Terse.")
    s.user("Hi")
    s += sgl.assistant(sgl.gen("greeting", max_tokens=2))
    s += sgl.user(question)


@sgl.function
def _inner(s):
    s += sgl.user("shared instructions")


@sgl.function
def _outer(s, question):
    _inner(s)
    s += sgl.user(question) + sgl.assistant(sgl.gen("a", max_tokens=2))


@pytest.mark.parametrize("template", [PLAIN, CHATML, WITH_SYSTEM], ids=lambda t: t.name)
@pytest.mark.parametrize("program", [_chat, _scoped, _constant_turns, _outer], ids=lambda p: p.__name__)
def test_constant_prefix_is_what_a_run_starts_with(program, template):
    backend = _Prompts(template)
    prefix = program.trace(backend).constant_prefix
    program.run(question="Why?", backend=backend).sync()
    assert prefix and backend.prompts[0].startswith(prefix)
    if template is WITH_SYSTEM:  # a program that starts with a user turn gets the default system message
        assert prefix.startswith("<system>Be kind.</system>") == (program in (_chat, _outer))


def test_trace_records_nodes_and_placeholders():
    @sgl.function
    def program(s, topic):
        s += "About " + topic + ": "
        s += sgl.gen("fact", max_tokens=3)
        s += "So " + s["fact"]
        assert "fact" in s and isinstance(s["fact"], Placeholder)

    traced = program.trace(_Prompts(PLAIN))
    assert traced.constant_prefix == "About "
    assert any(isinstance(n, ir.Gen) for n in traced.nodes) and len(traced.nodes) == 3
    assert program.trace(_Prompts(PLAIN), topic="cats").constant_prefix == "About cats: "


def test_trace_stops_where_only_a_run_knows():
    @sgl.function
    def forks(s):
        s += "Shared. "
        branches = s.fork(2)
        branches += "never traced"

    @sgl.function
    def reads_text(s):
        s += "Before. "
        if s.text().endswith(" "):
            s += "after"

    assert forks.trace(_Prompts(PLAIN)).constant_prefix == "Shared. "
    assert reads_text.trace(_Prompts(PLAIN)).constant_prefix == "Before. "


def test_roles_are_built_once():
    """sgl.user(...) and s.user(...) append the same nodes; a traced state is a ProgramState."""
    node = sgl.user("hi")
    assert node == ir.Sequence((ir.RoleBegin("user"), ir.Text("hi"), ir.RoleEnd("user")))
    assert sgl.assistant() == ir.Sequence((ir.RoleBegin("assistant"), ir.RoleEnd("assistant")))
    state = TracingState(None, PLAIN)
    assert isinstance(state, sgl.ProgramState)
    state.user("hi")
    state += sgl.user("hi")
    assert state.executor.nodes == [node, node]
    assert state.executor.text_ == "hihi"
