"""Hub ids resolved from a local Hugging Face cache the test builds (tests/conftest.py sets HF_HUB_OFFLINE=1: no
test reaches the network): snapshots and revisions, the offline error, the download path failing on an endpoint
that refuses connections, `%sgl model` completion; then a whole engine over a cached sharded Qwen3 checkpoint:
its logits against transformers, generation_config.json defaults and eos ids, and the chat template's
enable_thinking through chat_template_kwargs (checked against transformers' apply_chat_template).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from sgnb.engine import hub
from sgnb.engine.model_loader import SMOLLM2_NAME, resolve_model

REPO = "acme/tiny-qwen3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
# a Qwen3-style switch, written for this test: thinking off -> an empty think block opens the answer
TEMPLATE = ("{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
            "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}"
            "{%- endif -%}{%- endif -%}")
GENERATION = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "eos_token_id": [2, 7]}


def _snapshot(root: Path, commit: str, files: Path | None, refs: dict[str, str]) -> Path:
    """Put `files` (a directory) into the cache `root` as snapshot `commit` of REPO, with these refs. Files are
    copied, not symlinked to blobs: huggingface_hub reads either (Windows caches hold copies)."""
    repo = root / ("models--" + REPO.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    if files is not None:
        for f in files.iterdir():
            shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref, target in refs.items():
        (repo / "refs" / ref).write_text(target)
    return snap


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A tiny random Qwen3 in sharded safetensors (with an index), the SmolLM2 tokenizer, a generation_config
    and a separate chat_template.jinja."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.7, 1.3) if "norm" in name else p.normal_(0.0, 0.25)
    path = tmp_path_factory.mktemp("tiny-qwen3-files")
    model.save_pretrained(path, max_shard_size="4MB")
    assert (path / "model.safetensors.index.json").is_file()
    tok_dir = Path(os.environ.get("SGNB_TEST_TOKENIZER") or resolve_model(SMOLLM2_NAME).path)
    shutil.copy(tok_dir / "tokenizer.json", path / "tokenizer.json")
    tok_cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    (path / "generation_config.json").write_text(json.dumps(GENERATION))
    return path, model


@pytest.fixture(scope="module")
def cache(tmp_path_factory, checkpoint) -> Path:
    root = tmp_path_factory.mktemp("hf-hub-cache")
    _snapshot(root, COMMIT, checkpoint[0], {"main": COMMIT})
    _snapshot(root, OLD_COMMIT, checkpoint[0], {"v0.1": OLD_COMMIT})
    return root


def test_offline_in_tests():
    assert hub.offline()


def test_hub_ids_resolve_to_their_snapshot(cache):
    source = resolve_model(REPO, hub_cache=cache)
    assert source.name == REPO and not source.dummy and source.config.architecture == "qwen3"
    assert source.path == cache / "models--acme--tiny-qwen3" / "snapshots" / COMMIT
    assert resolve_model(REPO, revision="v0.1", hub_cache=cache).path.name == OLD_COMMIT
    assert resolve_model(REPO, revision=OLD_COMMIT, hub_cache=cache).path.name == OLD_COMMIT
    assert hub.cached_model_ids(cache) == [REPO]


@pytest.mark.parametrize("spec", ["acme/not-cached", "Org.Name/model_v1-2"])
def test_not_cached_offline_is_one_clear_error(cache, spec):
    with pytest.raises(hub.HubModelNotFound) as info:
        resolve_model(spec, hub_cache=cache)
    message = str(info.value)
    for needle in (repr(spec), str(cache), f"hf download {spec}", "HF_HUB_OFFLINE"):
        assert needle in message, (needle, message)


def test_a_partial_snapshot_is_not_a_model(tmp_path, checkpoint):
    only_config = tmp_path / "files"
    only_config.mkdir()
    shutil.copy(checkpoint[0] / "config.json", only_config)
    _snapshot(tmp_path / "cache", COMMIT, only_config, {"main": COMMIT})
    with pytest.raises(hub.HubModelNotFound, match="only part of it") as info:
        resolve_model(REPO, hub_cache=tmp_path / "cache")
    assert f"hf download {REPO}" in str(info.value)
    with pytest.raises(hub.HubModelNotFound, match="--revision v2"):
        resolve_model(REPO, revision="v2", hub_cache=tmp_path / "cache")


def test_download_path_reports_a_failed_download(tmp_path, monkeypatch):
    """Online (HF_HUB_OFFLINE unset) and not cached: huggingface_hub is asked to download, here from an
    endpoint that refuses connections (no network in tests); its failure becomes the same clear error."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 2)
    assert not hub.offline()
    with pytest.raises(hub.HubModelNotFound, match="downloading it failed") as info:
        hub.resolve_hub("acme/elsewhere", cache=tmp_path)
    assert "hf download acme/elsewhere" in str(info.value)


def test_paths_and_other_forms_win_over_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    with pytest.raises(ValueError, match="not an HF-format model directory"):
        resolve_model("org")  # an existing directory is a directory, named or not like a hub id
    assert not hub.is_hub_id("/abs/path") and not hub.is_hub_id("a/b/c") and not hub.is_hub_id("../x")
    assert hub.is_hub_id("Qwen/Qwen3-8B") and hub.is_hub_id("google/gemma-3-12b-it")


def test_sgl_model_completes_cached_ids(cache, monkeypatch):
    from huggingface_hub import constants

    from sgnb.kernel_ext.engine_magics import complete_line

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    fragment, names = complete_line("%sgl model ac", {})
    assert fragment == "ac" and names == [REPO]
    assert REPO in complete_line("%sgl model ", {})[1]


@pytest.fixture(scope="module")
def engine(cache):
    from huggingface_hub import constants

    from sgnb.engine import Engine

    saved = constants.HF_HUB_CACHE
    constants.HF_HUB_CACHE = str(cache)  # the user's HF_HOME / HF_HUB_CACHE, as huggingface_hub read it
    try:
        eng = Engine(REPO, device="cpu", dtype="float32", attention_backend="torch", max_total_tokens=1024,
                     quantization="none", chat_template_kwargs={"enable_thinking": False})
    finally:
        constants.HF_HUB_CACHE = saved
    yield eng
    eng.shutdown()


def test_engine_over_a_hub_id_equals_transformers(engine, checkpoint):
    model = checkpoint[1]
    assert engine.model_name == REPO
    ids = [5, 17, 300, 42, 9, 77, 123, 8, 250, 31]
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
                          return_logprob=True, logprob_start_len=0)
    with torch.no_grad():
        ref = model(torch.tensor([ids + out["output_ids"]])).logits[0].double().log_softmax(-1)
    got = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
    want = [ref[i - 1, t].item() for i, t in enumerate(ids) if i > 0]
    assert max(abs(a - b) for a, b in zip(got, want)) < 2e-4
    gen = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    want = [ref[len(ids) - 1 + j, t].item() for j, t in enumerate(out["output_ids"])]
    assert max(abs(a - b) for a, b in zip(gen, want)) < 2e-4


def test_generation_config_gives_request_defaults_and_stop_ids(engine):
    assert engine.sampling_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert {2, 7} <= set(engine.tokenizer.eos_token_ids)
    reqs, _ = engine._make_reqs(_input([5, 6, 7], {"max_new_tokens": 1}))
    sp = reqs[0].sampling
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.6, 0.95, 20)
    reqs, _ = engine._make_reqs(_input([5, 6, 7], {"max_new_tokens": 1, "temperature": 0.0, "top_p": None}))
    sp = reqs[0].sampling
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.0, 0.95, 20)  # the user's value wins; None is unset
    # validated once: engine.sampling_params applies the same defaults, and a request keeps the object it is given
    given = engine.sampling_params({"max_new_tokens": 1, "temperature": 0.0})
    assert (given.temperature, given.top_p, given.top_k) == (0.0, 0.95, 20)
    reqs, _ = engine._make_reqs(_input([5, 6, 7], given))
    assert reqs[0].sampling is given


def _input(ids: list[int], params: Any):
    from sgnb.engine.request_input import GenerateInput

    return GenerateInput(input_ids=ids, sampling_params=params)


def test_chat_template_kwargs_equal_transformers(engine, checkpoint):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(checkpoint[0]))
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                      **{"enable_thinking": False, **kwargs})  # the engine's default first
        assert engine.apply_chat_template(messages, **kwargs) == want
    assert engine.apply_chat_template(messages).endswith("<think>\n\n</think>\n\n")
    assert not engine.apply_chat_template(messages, enable_thinking=True).endswith("</think>\n\n")


def test_chat_route_takes_chat_template_kwargs(engine):
    """The OpenAI chat route's chat_template_kwargs field reaches the template (over the engine's default)."""
    import requests

    from sgnb.server import start_server_thread

    handle = start_server_thread(engine, "127.0.0.1", 0)
    try:
        def prompt_tokens(extra: dict) -> int:
            body = {"model": REPO, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **extra}
            r = requests.post(handle.url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        off = prompt_tokens({})  # the engine's default: enable_thinking False, an empty think block
        on = prompt_tokens({"chat_template_kwargs": {"enable_thinking": True}})
        messages = [{"role": "user", "content": "Hi"}]
        assert off == len(engine.tokenizer.encode(engine.apply_chat_template(messages)))
        assert on == len(engine.tokenizer.encode(engine.apply_chat_template(messages, enable_thinking=True))) < off
    finally:
        handle.stop()
