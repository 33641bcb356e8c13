"""Each architecture of the registry against HF transformers on the same tiny random checkpoint (fp32, CPU).

A checkpoint is built from transformers' own config class (Qwen3Config, Gemma3TextConfig, MistralConfig),
written with save_pretrained and loaded by both. Checked through the whole engine: prompt logprobs of a fresh
prompt, a greedy decode (each generated token's logprob against HF's logits of the same text), an extension
over a cached prefix, a chunked prefill and a batch of ragged requests. Sliding windows are a few tokens wide so
that every prompt runs past them; those also run through the Triton backend (TRITON_INTERPRET=1 on CPU).
Comparisons are of logprobs with a tolerance, never of greedy text.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

TOL = 2e-4  # fp32 both sides; a wrong mask, window, norm or rope base moves logprobs by units
VOCAB = 512  # token ids of the prompts stay below it (the SmolLM2 tokenizer only names them)
WINDOW = 5


def _tiny(arch: str):
    """(transformers model class, config) of a tiny random model of `arch`."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    if arch == "qwen3":
        cfg = tf.Qwen3Config(num_hidden_layers=2, rope_theta=10000.0, tie_word_embeddings=False, **common)
        return tf.Qwen3ForCausalLM, cfg
    if arch == "gemma3":
        # layers 0, 1 sliding (local rope base), layer 2 global (its own base and a linear rope scaling)
        cfg = tf.Gemma3TextConfig(num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                  layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 50000.0},
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 1000.0}},
                                  **common)
        return tf.Gemma3ForCausalLM, cfg
    if arch == "mistral":
        cfg = tf.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, rope_theta=10000.0, **common)
        return tf.MistralForCausalLM, cfg
    raise AssertionError(arch)


@pytest.fixture(scope="module", params=["qwen3", "gemma3", "mistral"])
def checkpoint(request, tmp_path_factory):
    """(arch, HF-format directory, the HF model in fp32) of a tiny random model with the SmolLM2 tokenizer."""
    from sgnb.engine.model_loader import SMOLLM2_NAME, resolve_model

    arch = request.param
    cls, cfg = _tiny(arch)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # larger weights than the init's: peaked distributions, so a comparison can fail
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.3, 0.3) if arch == "gemma3" else p.uniform_(0.7, 1.3)  # Gemma scales by 1 + w
            else:
                p.normal_(0.0, 0.35 if "embed" in name else 0.2)
    path = tmp_path_factory.mktemp(f"tiny-{arch}")
    model.save_pretrained(path)
    tok_dir = Path(os.environ.get("SGNB_TEST_TOKENIZER") or resolve_model(SMOLLM2_NAME).path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, path / name)
    return arch, path, model


def _engine(path: Path, **kw):
    from sgnb.engine import Engine

    opts = dict(device="cpu", dtype="float32", attention_backend="torch", max_total_tokens=2048,
                quantization="none")
    return Engine(str(path), **{**opts, **kw})


@pytest.fixture(scope="module")
def engine(checkpoint):
    eng = _engine(checkpoint[1])
    yield eng
    eng.shutdown()


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(L, V) float64 log-softmax of HF's logits for the sequence ids."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().log_softmax(-1)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) and got, (len(got), len(want))
    diff = max(abs(a - b) for a, b in zip(got, want))
    assert diff < TOL, f"max |logprob diff| {diff:.3g} >= {TOL}"


def _check(model, ids: list[int], out: dict, start: int = 0) -> None:
    """The request's prompt logprobs from position `start` on and its generated tokens' logprobs equal HF's."""
    gen = out["output_ids"]
    ref = _hf_logprobs(model, ids + gen)
    prompt = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]
    positions = range(max(start, 1), len(ids))
    _close([lp for lp in prompt if lp is not None][-len(positions):], [ref[i - 1, ids[i]].item() for i in positions])
    if gen:
        _close([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]],
               [ref[len(ids) - 1 + j, t].item() for j, t in enumerate(gen)])


GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def test_config_is_read(checkpoint, engine):
    arch, path, model = checkpoint
    cfg = engine.runner.model.config
    assert cfg.architecture == {"gemma3": "gemma3_text"}.get(arch, arch)
    layers = engine.runner.model.model.layers
    windows = [layer.self_attn.sliding_window for layer in layers]
    assert windows == {"qwen3": [None, None], "gemma3": [WINDOW, WINDOW, None], "mistral": [WINDOW, WINDOW]}[arch]
    assert cfg.qk_norm == (arch != "mistral")


def test_prompt_logprobs_and_greedy_decode(checkpoint, engine):
    _, _, model = checkpoint
    engine.flush_cache()
    ids = _prompt(23, 1)
    out = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    _check(model, ids, out)


def test_decode_over_a_cached_prefix(checkpoint, engine):
    _, _, model = checkpoint
    engine.flush_cache()
    first = _prompt(17, 2)
    engine.generate(input_ids=first, sampling_params={"max_new_tokens": 1})
    longer = first + _prompt(9, 3)
    out = engine.generate(input_ids=longer, sampling_params=GREEDY, return_logprob=True, logprob_start_len=17)
    assert out["meta_info"]["cached_tokens"] >= 16
    _check(model, longer, out, start=17)


def test_ragged_batch(checkpoint, engine):
    _, _, model = checkpoint
    engine.flush_cache()
    prompts = [_prompt(n, 10 + n) for n in (3, 19, 11)]
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    for ids, out in zip(prompts, outs):
        _check(model, ids, out)


def test_chunked_prefill(checkpoint):
    _, path, model = checkpoint
    eng = _engine(path, chunked_prefill_size=7)
    try:
        ids = _prompt(26, 4)
        out = eng.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
        _check(model, ids, out)
    finally:
        eng.shutdown()


def test_triton_backend(checkpoint):
    """The Triton kernels (interpreted on CPU) with the window: a ragged batch, then decode over its prefixes."""
    arch, path, model = checkpoint
    if arch == "qwen3":
        pytest.skip("no window: the backend tests cover full attention")
    eng = _engine(path, attention_backend="triton", chunked_prefill_size=8)
    try:
        prompts = [_prompt(n, 20 + n) for n in (4, 13)]
        outs = eng.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 4}, return_logprob=True,
                            logprob_start_len=0)
        for ids, out in zip(prompts, outs):
            _check(model, ids, out)
        longer = prompts[1] + _prompt(3, 5)
        out = eng.generate(input_ids=longer, sampling_params={**GREEDY, "max_new_tokens": 3}, return_logprob=True,
                           logprob_start_len=13)
        _check(model, longer, out, start=13)
    finally:
        eng.shutdown()


# Gemma's way, written for this test: no system role; a system message opens the first user turn
NO_SYSTEM_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set rest = messages[1:] -%}{%- else -%}{%- set first = '' -%}{%- set rest = messages -%}{%- endif -%}"
    "{%- for m in rest -%}{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('roles must alternate user/assistant') }}{%- endif -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + m['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}")


def test_program_roles_with_a_template_without_system_role(checkpoint, tmp_path):
    """A program's system + user messages render as the template renders them: one user turn."""
    import json

    from transformers import AutoTokenizer

    import sgnb

    arch, path, _ = checkpoint
    if arch != "gemma3":
        pytest.skip("Gemma's template")
    shutil.copytree(path, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": NO_SYSTEM_TEMPLATE}))
    eng = _engine(tmp_path / "m")
    try:
        @sgnb.function
        def chat(s):
            s += sgnb.system("Be brief.")
            s += sgnb.user("Hi")
            s += sgnb.assistant("Hello")
            s += sgnb.user("Bye")

        state = chat.run(backend=sgnb.Runtime(engine=eng))
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
        want = AutoTokenizer.from_pretrained(str(tmp_path / "m")).apply_chat_template(messages, tokenize=False)
        assert state.text() == want == eng.apply_chat_template(messages, add_generation_prompt=False)
        assert state.messages() == messages
    finally:
        eng.shutdown()


def test_graph_paths_with_windows(checkpoint):
    """The decode and small-extend CUDA graphs' paths (their static buffers, padding and the extend kernel's
    block table), run eagerly on CPU in the interpreter as tests/engine/test_attention_backends.py does: window
    layers read the same keys inside a graph."""
    from sgnb.engine.cuda_graph import DecodeGraphs, ExtendGraphs

    arch, path, model = checkpoint
    if arch == "qwen3":
        pytest.skip("no window")
    eng = _engine(path, attention_backend="triton")
    try:
        r = eng.runner
        pad_row = r.req_pool.alloc()
        r.graphs = DecodeGraphs(r.model, r.attn, r.req_pool.req_to_token, pad_row, r.kv_cache.scratch_slot, 4,
                                r.kv_pool.size, r.device, capture=False)
        r.extend_graphs = ExtendGraphs(r.model, r.attn, r.req_pool.req_to_token, pad_row, r.kv_cache.scratch_slot,
                                       32, 8, r.model_config.head_dim, r.device, capture=False)
        prompts = [_prompt(n, 40 + n) for n in (6, 11, 9)]
        outs = eng.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 4}, return_logprob=True,
                            logprob_start_len=0)
        assert r.graphs.replays > 0 and r.extend_graphs.replays > 0
        for ids, out in zip(prompts, outs):
            _check(model, ids, out)
    finally:
        eng.shutdown()


def test_tensor_parallel(checkpoint):
    """tp_size=2 (gloo worker processes, each holding half the heads, q/k norms replicated) equals transformers."""
    _, path, model = checkpoint
    eng = _engine(path, tp_size=2)
    try:
        prompts = [_prompt(n, 60 + n) for n in (12, 7)]
        outs = eng.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 3}, return_logprob=True,
                            logprob_start_len=0)
        for ids, out in zip(prompts, outs):
            _check(model, ids, out)
    finally:
        eng.shutdown()
