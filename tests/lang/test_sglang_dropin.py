"""The last SGLang frontend differences (issue 35): each program or call below is written as SGLang documents it
(compared with sglang 0.5.23's frontend, installed here) and failed with sgnb before."""

from __future__ import annotations

import asyncio
import json
import logging
import warnings
from pathlib import Path

import pytest

import sgnb as sgl

ENGINE = "default"  # its assertions hold for any model: the quantized engine (tests/conftest.py)


@pytest.fixture(scope="module")
def backend(engine):
    return sgl.Runtime(engine=engine)


# ---- the language -----------------------------------------------------------------------------------------------
def test_copy_is_sglangs_context_manager(backend):
    @sgl.function
    def two_ways(s):
        s += "Q: Name a fruit.\nA:"
        with s.copy() as c:  # SGLang's documented form: joined back when the block ends
            c += sgl.gen("alt", max_tokens=4, temperature=0)
        s += sgl.gen("main", max_tokens=4, temperature=0)

    state = two_ways.run(backend=backend)
    alt = state["alt"]
    assert isinstance(alt, list) and len(alt) == 1 and alt[0] == state["main"]  # same prefix, greedy
    assert "Q: Name a fruit." in state.text() and state.stream_executor is state.executor
    assert state.stream_executor.variable_event["main"].is_set()  # SGLang's names for the executor's fields


def test_run_batch_takes_sglangs_forms(backend):
    @sgl.function
    def say(s, word, n_tokens=2):
        s += f"Repeat: {word}\n" + sgl.gen("out", max_tokens=n_tokens, temperature=0)

    by_position = say.run_batch([["cat"], ["dog", 3]], backend=backend)  # argument lists by position
    by_name = say.run_batch([{"word": "cat"}, {"word": "dog", "n_tokens": 3}], backend=backend)
    assert [s["out"] for s in by_position] == [s["out"] for s in by_name]
    gen = say.run_batch([{"word": w} for w in ("a", "b", "c")], backend=backend, generator_style=True)
    assert not isinstance(gen, list)
    states = list(gen)  # one by one, in batch order
    assert [s.executor.variables["out"] for s in states] == [s["out"] for s in
                                                             say.run_batch([["a"], ["b"], ["c"]], backend=backend)]
    with pytest.raises(TypeError, match="missing"):
        say.run_batch([[]], backend=backend)


def test_cache_and_run_n(backend, engine):
    @sgl.function
    def story(s, topic):
        s += "You are a storyteller who writes one short line. " * 6 + f"Topic: {topic}\n"
        s += sgl.gen("line", max_tokens=3)

    engine.flush_cache()
    prefix = story.cache(backend)
    assert prefix.startswith("You are a storyteller") and engine.get_stats()["kv_cached"] > 0
    state = story.run("cats", n=2, temperature=0.9, backend=backend)  # run()'s n: every gen's default
    assert isinstance(state["line"], list) and len(state["line"]) == 2


def test_string_dtypes_and_sglangs_choice_objects(backend):
    from sglang.lang import choices as sglang_choices

    @sgl.function
    def typed(s):
        s += "2 + 2 = " + sgl.gen("n", dtype="int", max_tokens=4, temperature=0)
        s += "\nIs the sky blue?" + sgl.select("yes", choices=[" yes", " no"],
                                                 choices_method=sglang_choices.greedy_token_selection)

    state = typed.run(backend=backend)
    assert isinstance(state["n"], int) and state["yes"] in (" yes", " no")
    for method in (sglang_choices.token_length_normalized, sglang_choices.unconditional_likelihood_normalized):
        sgl.select("x", choices=["a", "b"], choices_method=method)  # accepted
    with pytest.raises(ValueError, match="int, float, str, bool"):
        sgl.gen("x", dtype="decimal")

    class Custom(sglang_choices.ChoicesSamplingMethod):
        def __call__(self, **kwargs):
            raise NotImplementedError

    with pytest.raises(ValueError, match="not one of SGLang's three methods"):
        sgl.select("x", choices=["a", "b"], choices_method=Custom())


def test_sglang_module_paths_import():
    from sgnb.lang.backend.base_backend import BaseBackend
    from sgnb.lang.backend.openai import OpenAI
    from sgnb.lang.backend.runtime_endpoint import RuntimeEndpoint
    from sgnb.lang.choices import greedy_token_selection
    from sgnb.lang.global_config import global_config
    from sgnb.lang.interpreter import ProgramState
    from sgnb.lang.ir import REGEX_FLOAT, REGEX_INT

    assert (REGEX_INT, REGEX_FLOAT) == (sgl.REGEX_INT, sgl.REGEX_FLOAT)
    assert BaseBackend is sgl.Backend and OpenAI is sgl.OpenAI and RuntimeEndpoint is sgl.RuntimeEndpoint
    assert ProgramState is sgl.ProgramState and global_config is sgl.global_config
    assert greedy_token_selection == "greedy_token_selection"


def test_global_config_settings(backend, engine, capsys):
    from sglang.lang.global_config import GlobalConfig as SGLangConfig

    ours = sgl.global_config
    theirs = SGLangConfig()
    for name in ("verbosity", "skip_special_tokens_in_output", "spaces_between_special_tokens_in_out",
                 "enable_precache_with_tracing", "enable_parallel_encoding"):
        assert getattr(ours, name) == getattr(theirs, name), name  # the same settings, the same defaults

    @sgl.function
    def hi(s, w):
        s += f"Say {w}:" + sgl.gen("x", max_tokens=2, temperature=0)

    try:
        ours.verbosity = 2  # SGLang's level for printing each batch program's text
        hi.run_batch([{"w": "one"}, {"w": "two"}], backend=backend)
        printed = capsys.readouterr().out
        assert "Say one:" in printed and "Say two:" in printed
        ours.verbosity = 0
        ours.enable_precache_with_tracing = False  # run_batch no longer caches the traced prefix first
        engine.flush_cache()
        before = engine.get_stats()["requests_finished"]
        hi.run_batch([{"w": "a"}, {"w": "b"}], backend=backend)
        assert engine.get_stats()["requests_finished"] - before == 2  # no precache request
        with pytest.warns(UserWarning, match="changes nothing"):
            ours.enable_parallel_encoding = False
        with pytest.warns(UserWarning, match="no setting"):
            ours.made_up_setting = 1
    finally:
        ours.verbosity = 0
        ours.enable_precache_with_tracing = True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours.enable_parallel_encoding = True


def test_flush_cache_answers_as_sglangs(backend):
    previous = sgl.get_default_backend()
    try:
        sgl.set_default_backend(None)
        assert sgl.flush_cache() is False  # no backend
        sgl.set_default_backend(backend)
        assert sgl.flush_cache() is None
    finally:
        sgl.set_default_backend(previous)


def test_trace_lists_flat_nodes(backend):
    @sgl.function
    def qa(s, q):
        s += sgl.system("sys")
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen("a", max_tokens=4))

    traced = qa.trace(backend=backend)
    kinds = [type(n).__name__ for n in traced.nodes]
    assert "Sequence" not in kinds and kinds.count("RoleBegin") == 3 and kinds[-2] == "Gen"


def test_openai_token_usage(server, engine):
    backend = sgl.OpenAI(engine.model_name, base_url=server.url + "/v1", api_key="local", is_chat_model=False)

    @sgl.function
    def short(s):
        s += "Hello" + sgl.gen("x", max_tokens=2)

    short.run(backend=backend).sync()
    usage = backend.token_usage  # SGLang's name and shape
    assert usage.prompt_tokens > 0 and usage.completion_tokens == 2
    usage.reset()
    assert usage.prompt_tokens == usage.completion_tokens == 0


# ---- sgnb.Runtime as SGLang's Runtime, sgnb.Engine as its offline Engine ------------------------------------------
def test_runtime_takes_sglangs_arguments_and_calls(tmp_path, monkeypatch):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    with pytest.warns(UserWarning, match="trust_remote_code"), pytest.warns(UserWarning, match="launch_timeout"):
        rt = sgl.Runtime(model_path="dummy:tiny", log_level="error", port=0, trust_remote_code=True,
                         chat_template=str(template), mem_fraction_static=0.5, max_total_tokens=512,
                         launch_timeout=60)
    try:
        assert rt.engine.config.mem_fraction_static == 0.5 and logging.getLogger("sgnb").level == logging.ERROR
        assert rt.engine.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n[assistant] "
        out = json.loads(rt.generate("Hello", {"max_new_tokens": 3, "temperature": 0}))  # a JSON string
        assert out["meta_info"]["completion_tokens"] == 3
        tok = rt.get_tokenizer()
        assert tok("Hello")["input_ids"] == rt.engine.tokenizer.encode("Hello")
        pieces = asyncio.run(_collect(rt.async_generate("Hello", {"max_new_tokens": 4, "temperature": 0,
                                                                  "ignore_eos": True})))
        assert "".join(pieces) == json.loads(rt.generate("Hello", {"max_new_tokens": 4, "temperature": 0,
                                                                   "ignore_eos": True}))["text"]
        with pytest.raises(ValueError, match="embedding model"):
            rt.encode("Hello")
        monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path / "traces"))  # SGLang's setting
        rt.start_profile()
        rt.generate("Hi", {"max_new_tokens": 2})
        trace = rt.stop_profile()
        assert Path(trace).parent == tmp_path / "traces"
        ops = [e for e in json.loads(open(trace).read())["traceEvents"] if e.get("cat") == "cpu_op"]
        assert any(e["name"] == "aten::embedding" for e in ops), "the trace missed the scheduler thread's ops"
        assert rt.url.startswith("http://127.0.0.1:")  # the engine over HTTP, started on first use
        remote = rt.endpoint.get_server_info()
        assert remote and sgl.RuntimeEndpoint is type(rt.endpoint)
    finally:
        rt.shutdown()
        logging.getLogger("sgnb").setLevel(logging.NOTSET)  # log_level="error" set it for the process
    assert logging.getLogger("sgnb").getEffectiveLevel() != logging.ERROR
    with pytest.raises(TypeError, match="unknown engine option"):
        sgl.Runtime(model_path="dummy:tiny", max_totl_tokens=5)  # a typo is still refused


async def _collect(agen) -> list[str]:
    return [piece async for piece in agen]


def test_engine_as_sglangs_offline_engine():
    with sgl.Engine(model_path="dummy:tiny", max_total_tokens=512, random_seed=3) as engine:
        info = engine.get_server_info()
        assert info["model_path"] == "dummy:tiny" and info["random_seed"] == 3 and "version" in info
        outs = engine.generate(["Hi", "Hello there"], {"max_new_tokens": 2, "temperature": 0})
        assert [o["meta_info"]["completion_tokens"] for o in outs] == [2, 2]
        chunks = list(engine.generate("Hi", {"max_new_tokens": 4, "ignore_eos": True}, stream=True))
        assert chunks[-1]["meta_info"]["completion_tokens"] == 4
        assert engine.flush_cache() is True
    assert not engine.is_alive
