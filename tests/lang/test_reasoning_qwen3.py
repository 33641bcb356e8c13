"""Reasoning end to end on a Qwen3-shaped checkpoint: a tiny random Qwen3 (transformers' Qwen3Config, SmolLM2's
tokenizer) with a Qwen3-style chat template (`enable_thinking`; earlier turns' thinking left out), run through
`separate_reasoning` in-process (the engine's reasoning parser as its default) and through `sgnb serve
--reasoning-parser qwen3` (a subprocess, read by the `openai` client). Its weights are random: a regex forces the
think block, so what is checked is the split, the conversation and the wire format, not what the model thinks."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import sgnb as sgl
from sgnb.engine.model_loader import SMOLLM2_NAME, resolve_model

THINKING = r"<think>[a-z ]{5,40}</think>The answer is [0-9]"
# Qwen3's template in small: an earlier assistant turn keeps only what follows its </think>; thinking off opens
# the reply with an empty block
TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif -%}{%- endif -%}")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny-qwen3-thinking")
    model.save_pretrained(path)
    tok_dir = Path(os.environ.get("SGNB_TEST_TOKENIZER") or resolve_model(SMOLLM2_NAME).path)
    shutil.copy(tok_dir / "tokenizer.json", path / "tokenizer.json")
    tok_cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    assert resolve_model(str(path)).config.architecture == "qwen3"
    return path


@pytest.fixture(scope="module")
def qwen3_engine(qwen3_dir):
    from sgnb.engine import Engine

    engine = Engine(str(qwen3_dir), reasoning_parser="qwen3", quantization="none")
    yield engine
    engine.shutdown()


@sgl.function
def two_turns(s):
    for question in ("What is 2 + 2?", "And 3 + 3?"):
        s += sgl.user(question)
        # no model_type: the backend's reasoning parser (the engine's, qwen3)
        s += sgl.separate_reasoning(sgl.assistant(sgl.gen("answer", regex=THINKING, max_tokens=60,
                                                          temperature=0)))


def test_separate_reasoning_in_process_on_a_qwen3_checkpoint(qwen3_engine):
    from sgnb.widgets import ProgramView

    backend = sgl.Runtime(engine=qwen3_engine)
    assert backend.reasoning_parser == "qwen3"
    view = ProgramView()
    state = view.run(two_turns, backend=backend)
    state.sync()
    answers, thoughts = state["answer"], state["answer_reasoning_content"]
    assert re.fullmatch(r"The answer is [0-9]", answers), answers
    assert re.fullmatch(r"[a-z ]{5,40}", thoughts), thoughts
    assert "<think>" not in state.text() and "</think>" not in state.text()
    assistant = [m["content"] for m in state.messages() if m["role"] == "assistant"]
    assert len(assistant) == 2 and all(re.fullmatch(r"The answer is [0-9]", a) for a in assistant)
    # what the model was asked the second time is what its template renders for the conversation so far
    first_turn = state.messages()[:2]
    assert qwen3_engine.apply_chat_template(first_turn, add_generation_prompt=False) in state.text()
    end = time.monotonic() + 20
    while view.flush() or any(p["status"] == "running" for p in view.programs):
        assert time.monotonic() < end
        time.sleep(0.05)
    gens = [g for p in view.programs for g in p["segments"] if g["k"] == "gen"]
    assert [g["think"]["format"] for g in gens] == ["qwen3", "qwen3"]
    assert gens[-1]["think"]["text"] == thoughts and gens[-1]["text"][gens[-1]["think"]["end"]:] == answers
    assert all(g["think"]["tokens"] > 0 for g in gens)


@pytest.fixture(scope="module")
def qwen3_server(qwen3_dir):
    """`sgnb serve --model DIR --reasoning-parser qwen3` in a subprocess; yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "sgnb.cli", "serve", "--model", str(qwen3_dir), "--port",
                             str(port), "--reasoning-parser", "qwen3", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.time() < deadline, "sgnb serve did not answer /health in 120 s"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_sgnb_serve_splits_a_qwen3_reply(qwen3_server):
    """The server says its parser; chat completions return the thinking as reasoning_content (streamed as
    delta.reasoning_content) and the answer as content; separate_reasoning=false returns the reply whole.
    (Thinking off in the template: the regex writes the block itself, from the reply's start.)"""
    openai = pytest.importorskip("openai")
    with urllib.request.urlopen(qwen3_server + "/get_server_info", timeout=30) as r:
        assert json.loads(r.read())["reasoning_parser"] == "qwen3"
    client = openai.OpenAI(base_url=qwen3_server + "/v1", api_key="none")
    kw = dict(model="default", messages=[{"role": "user", "content": "What is 2 + 2?"}], temperature=0,
              max_tokens=60)
    extra = {"regex": THINKING, "chat_template_kwargs": {"enable_thinking": False}}
    whole = client.chat.completions.create(**kw, extra_body={**extra, "separate_reasoning": False})
    raw = whole.choices[0].message.content
    m = re.fullmatch(r"<think>([a-z ]{5,40})</think>(The answer is [0-9])", raw)
    assert m, raw
    apart = client.chat.completions.create(**kw, extra_body=extra).choices[0].message
    assert (apart.reasoning_content, apart.content) == (m.group(1), m.group(2))
    pieces = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**kw, extra_body=extra, stream=True):
        for c in chunk.choices:
            delta = c.delta.model_dump()
            for key in pieces:
                pieces[key] += delta.get(key) or ""
    assert pieces == {"reasoning_content": m.group(1), "content": m.group(2)}
