"""Sampling parameter names have one definition (SamplingParams, and sgnb.sampling's tables of the frontends'
spellings): every place that spells them is derived from it or checked here against it, so adding or renaming a
sampling value fails here until gen(), run(), run_batch() and the OpenAI mappings agree."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest

import sgnb as sgl
from sgnb.backends.base import Backend, BackendError
from sgnb.engine.sampling_params import SamplingParams
from sgnb.sampling import (
    DEFAULT_PARAMS,
    GEN_NAMES,
    OPENAI_NAMES,
    OPENAI_STANDARD,
    REPORTING,
    SAMPLING_DEFAULTS,
    SAMPLING_FIELDS,
    GenParams,
)

ENGINE_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
GEN_FIELDS = [f.name for f in dataclasses.fields(GenParams)]
# SamplingParams fields that a gen does not set (nor does SGLang's gen): detokenization and the seed belong to the
# request (the server's /generate and /v1 routes take them)
NOT_PER_GEN = {"skip_special_tokens", "no_stop_trim", "seed"}
# gen()'s arguments that are not sampling values (tools: sgnb.tools)
GEN_OWN = {"name", "dtype", "choices", "choices_method", "tools", "tool_choice"}
# GenParams fields the interpreter sets, not gen(): where a tool call's grammar starts (after the reasoning)
NOT_A_GEN_KEYWORD = {"grammar_after"}
# SamplingParams fields that sgnb serve sets itself (from its --reasoning-parser), not read from a request
SERVER_SET = {"grammar_after"}
# run()'s arguments that are not sampling values
RUN_OWN = {"self", "args", "kwargs", "batch_kwargs", "stream", "backend", "use_thread", "subscribers", "num_threads",
           "progress_bar", "frontend_hints", "generator_style", "stream_interval_s"}


def _keywords(fn, own: set[str]) -> dict[str, inspect.Parameter]:
    return {name: p for name, p in inspect.signature(fn).parameters.items() if name not in own}


def test_genparams_mirrors_sampling_params():
    assert set(SAMPLING_FIELDS) == set(ENGINE_FIELDS) - NOT_PER_GEN
    assert set(GEN_FIELDS) == set(SAMPLING_FIELDS) | set(REPORTING)
    assert set(SAMPLING_DEFAULTS) == set(ENGINE_FIELDS)
    assert set(GEN_NAMES) <= set(GEN_FIELDS) and set(OPENAI_NAMES) <= set(ENGINE_FIELDS)
    assert set(OPENAI_STANDARD) <= set(ENGINE_FIELDS)
    assert all(f.default is None for f in dataclasses.fields(GenParams))  # None: inherit the program default


def test_gen_signature_is_genparams():
    """gen()'s keywords are GenParams' fields as SGLang's frontend spells them, each None (inherit) by default,
    and every one of them reaches its field."""
    keywords = _keywords(sgl.gen, GEN_OWN)
    assert set(keywords) == {GEN_NAMES.get(f, f) for f in GEN_FIELDS if f not in NOT_A_GEN_KEYWORD}
    assert all(p.default is None for p in keywords.values())
    values = {"max_tokens": 7, "min_tokens": 2, "stop": "x", "stop_token_ids": [5], "stop_regex": "a+",
              "temperature": 0.5, "top_p": 0.9, "top_k": 4, "min_p": 0.1, "frequency_penalty": 0.2,
              "presence_penalty": 0.3, "repetition_penalty": 1.1, "ignore_eos": True, "return_logprob": True,
              "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True, "n": 1}
    params = sgl.gen("v", **values).params
    assert params == GenParams(max_new_tokens=7, min_new_tokens=2, stop=("x",), stop_token_ids=(5,),
                               stop_regex=("a+",), temperature=0.5, top_p=0.9, top_k=4, min_p=0.1,
                               frequency_penalty=0.2, presence_penalty=0.3, repetition_penalty=1.1, ignore_eos=True,
                               return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
                               return_text_in_logprobs=True)
    assert sgl.gen("v", grammar='root ::= "a"').params.ebnf == 'root ::= "a"'
    assert sgl.gen("v", regex="[0-9]+").params.regex == "[0-9]+"
    assert sgl.gen("v", json_schema={"type": "object"}).params.json_schema == '{"type": "object"}'
    assert set(values) | {"grammar", "regex", "json_schema"} == set(keywords)  # every keyword was tried above


def test_run_and_run_batch_take_the_same_sampling_defaults():
    """run()'s and run_batch()'s sampling keywords: the same names, in the same order, whose defaults are
    DEFAULT_PARAMS' (what a program's gens inherit)."""
    run = _keywords(sgl.SglFunction.run, RUN_OWN)
    batch = _keywords(sgl.SglFunction.run_batch, RUN_OWN)
    assert list(run) == list(batch)
    assert set(run) <= set(GEN_FIELDS)
    for name, p in run.items():
        assert p.default == batch[name].default == getattr(DEFAULT_PARAMS, name), name
    assert {name for name in GEN_FIELDS if getattr(DEFAULT_PARAMS, name) is not None} <= set(run)


def test_sglang_names_are_all_taken():
    """Every keyword of SGLang's gen() and run()/run_batch() is one of ours."""
    ir = pytest.importorskip("sglang.lang.ir")
    api = pytest.importorskip("sglang.lang.api")
    assert set(inspect.signature(api.gen).parameters) <= set(inspect.signature(sgl.gen).parameters)
    ours = set(inspect.signature(sgl.SglFunction.run).parameters)
    theirs = set(inspect.signature(ir.SglFunction.run).parameters)
    assert theirs - ours == set()
    theirs_batch = set(inspect.signature(ir.SglFunction.run_batch).parameters)
    assert theirs_batch - set(inspect.signature(sgl.SglFunction.run_batch).parameters) == set()


class _Recording(Backend):
    """Answers every gen with "ok" and keeps the params it was asked with."""

    def __init__(self) -> None:
        self.params: list[GenParams] = []

    def get_model_name(self) -> str:
        return "recording"

    def generate(self, ctx, params):
        self.params.append(params)
        return "ok", {}


@sgl.function
def _one_gen(s):
    s += "Q:" + sgl.gen("a", max_tokens=3)


def test_run_arguments_reach_the_gens():
    backend = _Recording()
    _one_gen.run(backend=backend, temperature=0.25, top_k=5, stop="\n", return_logprob=True).sync()
    _one_gen.run_batch([{}], backend=backend, temperature=0.5, ignore_eos=True)[0].sync()
    first, second = backend.params
    assert first == dataclasses.replace(DEFAULT_PARAMS, max_new_tokens=3, temperature=0.25, top_k=5, stop=("\n",),
                                        return_logprob=True)
    assert second == dataclasses.replace(DEFAULT_PARAMS, max_new_tokens=3, temperature=0.5, ignore_eos=True)
    with pytest.raises(ValueError, match="temperature"):
        _one_gen.run(backend=backend, temperature=-1)


def test_openai_routes_map_every_sampling_field():
    """`sgnb serve`'s /v1 requests take every SamplingParams field (by its OpenAI name; max_tokens per route)."""
    from sgnb.server.protocol import _SAMPLING_NAMES, ChatCompletionRequest, CompletionRequest

    assert set(_SAMPLING_NAMES.values()) | {"max_new_tokens"} == set(ENGINE_FIELDS) - SERVER_SET
    wire = {"temperature": 0.5, "top_p": 0.9, "n": 2, "stop": ["x"], "seed": 3, "frequency_penalty": 0.1,
            "presence_penalty": 0.2, "top_k": 4, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 2,
            "stop_token_ids": [7], "stop_regex": "a+", "ignore_eos": True, "skip_special_tokens": False,
            "no_stop_trim": True, "regex": "[0-9]+", "model": "m", "user": "u"}
    expect = {"max_new_tokens": 11, **{k: v for k, v in wire.items() if k not in ("model", "user", "min_tokens")},
              "min_new_tokens": 2}
    completion = CompletionRequest(prompt="hi", max_tokens=5, **wire)
    assert completion.sampling_params(11) == expect
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=5, **wire)
    assert chat.sampling_params(11) == expect
    assert CompletionRequest(prompt="hi").sampling_params(16) == {"max_new_tokens": 16, "n": 1}


def test_openai_backend_sends_the_extras_by_their_openai_names():
    from sgnb.backends.openai import OpenAI

    params = GenParams.build(max_new_tokens=5, min_new_tokens=2, top_k=4, min_p=0.1, repetition_penalty=1.1,
                             ignore_eos=True, stop_token_ids=[7], temperature=0.5, top_p=0.9, frequency_penalty=0.1,
                             presence_penalty=0.2, stop="x", stop_regex="a+")
    other = OpenAI("m", base_url="http://127.0.0.1:9/v1", api_key="x", is_chat_model=False)
    assert other._kwargs(params) == {
        "max_tokens": 5, "stop": ["x"], "temperature": 0.5, "top_p": 0.9, "frequency_penalty": 0.1,
        "presence_penalty": 0.2, "extra_body": {"min_tokens": 2, "top_k": 4, "min_p": 0.1, "repetition_penalty": 1.1,
                                                "ignore_eos": True, "stop_token_ids": [7], "stop_regex": ["a+"]}}
    neutral = GenParams.build(**{k: SAMPLING_DEFAULTS[k] for k in ("min_new_tokens", "top_k", "min_p",
                                                                   "repetition_penalty", "ignore_eos")})
    assert other._kwargs(neutral) == {}  # the engine's defaults are not sent
    openai = OpenAI("gpt-4o-mini", api_key="x")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kw = openai._kwargs(dataclasses.replace(params, stop_regex=None))
    assert "extra_body" not in kw and kw["max_completion_tokens"] == 5
    assert {str(w.message).split("=")[0] for w in caught} == {"min_new_tokens", "top_k", "min_p",
                                                              "repetition_penalty", "ignore_eos", "stop_token_ids"}
    with pytest.raises(BackendError, match="stop_regex"):
        openai._kwargs(params)


def test_anthropic_refuses_what_the_messages_api_lacks():
    from sgnb.backends.anthropic import _UNSUPPORTED, Anthropic
    from sgnb.backends.base import GenContext

    backend = Anthropic("claude-test", api_key="k")
    ctx = GenContext("", [{"role": "user", "content": "hi"}], "r", in_role="assistant")
    for name in _UNSUPPORTED:
        value = {"stop_token_ids": (1,), "stop_regex": ("a",), "regex": "a", "json_schema": "{}", "ebnf": "x",
                 "min_new_tokens": 1, "min_p": 0.5, "frequency_penalty": 0.5, "presence_penalty": 0.5,
                 "repetition_penalty": 1.5, "grammar_after": "</think>"}[name]
        with pytest.raises(BackendError, match=f"{name} is not available"):
            backend._request(ctx, GenParams(**{name: value}))
        assert "extra_body" not in backend._request(ctx, GenParams(**{name: SAMPLING_DEFAULTS[name]}))
    kw = backend._request(ctx, dataclasses.replace(DEFAULT_PARAMS, temperature=0.5, top_k=3))
    assert kw["extra_body"] == {"temperature": 0.5, "top_k": 3} and kw["max_tokens"] == 128
