"""Interop with a client nobody here wrote: SGLang's own frontend (`sglang.lang`, installed with --no-deps)
drives `sgnb serve` through its RuntimeEndpoint, running an SGLang program unchanged."""

from __future__ import annotations

import pytest

sglang = pytest.importorskip("sglang", reason="install sglang --no-deps (make test does)")


@pytest.fixture(scope="module")
def sglang_endpoint(engine):
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    from sgnb.server import start_server_thread

    handle = start_server_thread(engine, "127.0.0.1", 0)
    yield RuntimeEndpoint(handle.url)
    handle.stop()


def test_sglang_frontend_program_on_sgnb_serve(sglang_endpoint, engine):
    sgl = sglang

    @sgl.function
    def qa(s, question):
        s += "Answer with one word.\nQ: What is frozen water? A: Ice\nQ: " + question + " A:"
        s += sgl.gen("answer", max_tokens=8, stop="\n", temperature=0)
        s += "\nIs that right? Answer:" + sgl.select("ok", choices=[" yes", " no"])

    state = qa.run(question="What color is grass?", backend=sglang_endpoint)
    assert "\n" not in state["answer"]
    assert state["ok"] in (" yes", " no")
    # the same program through sgnb's own in-process backend generates the same greedy answer
    import sgnb

    @sgnb.function
    def qa2(s, question):
        s += "Answer with one word.\nQ: What is frozen water? A: Ice\nQ: " + question + " A:"
        s += sgnb.gen("answer", max_tokens=8, stop="\n", temperature=0)

    mine = qa2.run(question="What color is grass?", backend=sgnb.Runtime(engine=engine))
    assert mine["answer"] == state["answer"]


def test_sglang_frontend_batch_fork_and_chat(sglang_endpoint):
    sgl = sglang

    @sgl.function
    def tips(s, topic):
        s += f"Two tips about {topic}:\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"{i + 1}." + sgl.gen("tip", max_tokens=8, stop="\n", temperature=0)
        forks.join()

    states = tips.run_batch([{"topic": "sleep"}, {"topic": "food"}], backend=sglang_endpoint)
    for st in states:
        assert len(st["tip"]) == 2 and all("\n" not in t for t in st["tip"])

    @sgl.function
    def chat(s):
        s += sgl.user("Say hi.")
        s += sgl.assistant(sgl.gen("reply", max_tokens=8, temperature=0))

    st = chat.run(backend=sglang_endpoint)
    assert isinstance(st["reply"], str) and st.messages()[-1]["role"] == "assistant"


def test_sglang_frontend_concate_and_append(sglang_endpoint):
    """SGLang's test_parallel_encoding shape: forks += lambda i: ..., join("concate_and_append") (it posts
    /concate_and_append_request, a 404 here once: the program then never finished), then a gen over the joined
    text."""
    import threading

    sgl = sglang

    @sgl.function
    def encode(s, docs):
        s += "Read these notes.\n"
        forks = s.fork(len(docs))
        forks += lambda i: f"Note {i + 1}: {docs[i]}\n"
        forks.join("concate_and_append")
        s += "The notes are about" + sgl.gen("topic", max_tokens=6, stop="\n", temperature=0)

    box: dict = {}
    t = threading.Thread(target=lambda: box.update(st=encode.run(docs=["cats purr", "dogs bark"],
                                                                 backend=sglang_endpoint)), daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the SGLang program hung"
    st = box["st"]
    assert "Note 1: cats purr" in st.text() and "Note 2: dogs bark" in st.text()
    assert isinstance(st["topic"], str)


# ---- SGLang idioms through sgnb itself (`import sgnb as sgl`) --------------------------------------------------
def test_regex_constants_are_sglangs():
    import sglang.lang.ir as sglang_ir

    import sgnb

    for name in ("REGEX_INT", "REGEX_FLOAT", "REGEX_BOOL", "REGEX_STR"):
        assert getattr(sgnb, name) == getattr(sglang_ir, name), name


def test_sglang_fork_idioms_run_unchanged(engine):
    """`forks[i] += ...` (SGLang's test_parallel_decoding) and `forks += lambda i: ...` (test_parallel_encoding),
    REGEX_INT and global_config.default_backend, as SGLang programs write them."""
    import re

    import sgnb as sgl

    @sgl.function
    def tips(s, topic):
        s += "Here are two tips for " + topic + ".\n"
        forks = s.fork(2)
        for i in range(2):
            forks[i] += f"Tip {i + 1}:" + sgl.gen("tip", max_tokens=8, stop="\n", temperature=0)
        forks += lambda i: f"\nThat was tip number {i + 1}."
        forks.join()
        s += "Count of tips:" + sgl.gen("count", max_tokens=4, regex=sgl.REGEX_INT, temperature=0)
        return forks

    before = sgl.global_config.default_backend
    sgl.global_config.default_backend = sgl.Runtime(engine=engine)
    try:
        assert sgl.get_default_backend() is sgl.global_config.default_backend
        st = tips.run(topic="sleep")
    finally:
        sgl.global_config.default_backend = before
    assert st.error() is None, st.error()
    assert isinstance(st["tip"], list) and len(st["tip"]) == 2
    forks = st.ret_value
    for i in range(2):
        assert forks[i].text().endswith(f"That was tip number {i + 1}.")
    assert re.fullmatch(sgl.REGEX_INT, st["count"]), st["count"]

    @sgl.function
    def pick(s, method):
        s += "Is ice cold? Answer:" + sgl.select("a", choices=[" yes", " no"], choices_method=method)

    for method in (sgl.token_length_normalized, sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized):
        assert pick.run(method=method, backend=sgl.Runtime(engine=engine))["a"] in (" yes", " no")
    with pytest.raises(TypeError, match="cannot be replaced"):
        forks[0] = forks[1]
