"""The peers of the benchmark suite as sgnb backends, so every system runs the very same program.

- HFTransformers: transformers' LlamaForCausalLM on our converted weights (fp32, SDPA). Concurrent gens are
  gathered into batched `generate` calls (left padding; grouped by output length, stop strings and EOS
  handling); a program that is sequential therefore makes one call at a time. Regex gens use xgrammar's
  transformers logits processor. A select runs the prompt once and each choice on a copy of its KV.
- LlamaCpp: llama-cpp-python on the same GGUF file (Q4_1), one call at a time. It reuses the KV of the longest
  prefix shared with its previous call (that is its only cache); selects score each choice's tokens with
  `logits_all`.
- Guidance: guidance 0.3.1 with its transformers engine on the same weights. Each gen/select is a guidance
  `model + text + gen(...)` / `select(...)` on the program's text, which is how a guidance program grows its
  state; guidance keeps one KV cache and reuses its longest common prefix. It has no ignore_eos and picks a
  select by constrained greedy decoding, not by length-normalized likelihood.

Every backend counts prompt tokens, prompt tokens it actually computed (the rest came from its cache),
generated tokens and forward steps in `self.counters`, read by the suite.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sgnb.backends.base import Backend, ChoiceDecision, GenContext
from sgnb.chat_template import derive_from_jinja
from sgnb.engine.radix_cache import common_prefix_len
from sgnb.engine.scoring import SCORING_METHODS, check_choices, decide
from sgnb.sampling import GenParams


# ---- the peers' scorer: the choice's own tokens only (the engine scores as SGLang does: engine/scoring.py) ----
def score_start(prefix_ids: list[int], full: list[list[int]]) -> int:
    """The first position where any choice's tokenization (prefix + choice, encoded together) departs from the
    prefix's, at least 1 and leaving every choice at least one token."""
    start = min(common_prefix_len(prefix_ids, f) for f in full)
    return max(1, min(start, min(len(f) for f in full) - 1))


def choose(method: str, cond: list[list[float]], uncond: list[list[float]] | None = None) -> tuple[int, list[float]]:
    """(index, one score per choice) from the choice tokens' logprobs alone: their mean, greedy token by token, or
    the mean of (conditional - unconditional)."""
    means = [sum(c) / len(c) for c in cond]
    if method == "token_length_normalized":
        return max(range(len(means)), key=lambda i: (means[i], -i)), means
    if method == "greedy_token_selection":
        rows = [[(v, None, None) for v in c] for c in cond]
        return decide(method, means, rows)[0], means
    if method == "unconditional_likelihood_normalized":
        assert uncond is not None and len(uncond) == len(cond)
        scores = [(sum(c) - sum(u)) / len(c) for c, u in zip(cond, uncond)]
        return max(range(len(scores)), key=lambda i: (scores[i], -i)), scores
    raise ValueError(f"unknown choices_method {method!r}; valid: {SCORING_METHODS}")


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class PeerBackend(Backend):
    """What the peers share: our tokenizer and chat template (so prompts are identical) and the counters."""

    def __init__(self, source: Any, tokenizer_dir: str | None = None) -> None:
        from sgnb.engine.model_loader import SMOLLM2_NAME, load_tokenizer, resolve_model

        self.source = source
        # a dummy model (random weights) takes a real model's tokenizer: the suite's --tokenizer, else SmolLM2's
        self.tokenizer = load_tokenizer(source, tokenizer_path=tokenizer_dir)
        self.tokenizer_dir = (Path(tokenizer_dir) if tokenizer_dir
                              else source.path if not source.dummy else resolve_model(SMOLLM2_NAME).path)
        self.counters: Counter[str] = Counter()
        self._template = derive_from_jinja(lambda m, g: self.tokenizer.apply_chat_template(m, add_generation_prompt=g),
                                           source.name)

    def get_model_name(self) -> str:
        return self.source.name

    def get_chat_template(self):
        return self._template

    def _scoring_plan(self, text: str, choices: list[str]) -> tuple[list[int], list[list[int]], int]:
        """As the engine scores: from the first token where any choice's tokenization departs from the prompt's."""
        prefix = self.tokenizer.encode(text)
        full = [self.tokenizer.encode(text + c) for c in choices]
        return prefix, full, score_start(prefix, full)


def _values(params: GenParams) -> dict[str, Any]:
    v = params.sampling_dict()
    return {"max_new_tokens": v.get("max_new_tokens", 128), "stop": tuple(v.get("stop") or ()),
            "ignore_eos": bool(v.get("ignore_eos")), "regex": v.get("regex"), "json_schema": v.get("json_schema")}


# ---- HF transformers -------------------------------------------------------------------------------------------
@dataclass
class _Job:
    kind: str
    ids: list[int]
    values: dict[str, Any] = field(default_factory=dict)
    choices: list[str] = field(default_factory=list)
    method: str = "token_length_normalized"
    text: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


def _hf_llama(source: Any, device: Any, dtype: Any, sdpa: bool = False) -> Any:
    """HF transformers' LlamaForCausalLM on `source`'s weights, on `device` in `dtype`, for the peers. A dummy
    model gets random weights (normal, std 0.02, so that 32 layers keep finite activations; norms stay 1): a
    speed baseline whose outputs are noise, like the engine's random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sgnb.engine.model_loader import load_state_dict

    cfg = LlamaConfig(**source.config.to_hf_dict())
    if sdpa:
        cfg._attn_implementation = "sdpa"
    if source.dummy:
        with torch.device(device):
            model = LlamaForCausalLM(cfg).to(dtype).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.02)
    else:
        model = LlamaForCausalLM(cfg).eval()
        model.load_state_dict(load_state_dict(source, torch.device("cpu"), torch.float32), strict=False)
        model = model.to(device, dtype)
    model.tie_weights()
    return model


class HFTransformers(PeerBackend):
    """HF transformers' batched generate: fp32 on the CPU, bf16 on a GPU (a dummy model: see _hf_llama)."""

    def __init__(self, source: Any, max_batch: int = 16, gather_s: float = 0.003,
                 tokenizer_dir: str | None = None) -> None:
        import torch
        from transformers import PreTrainedTokenizerFast

        super().__init__(source, tokenizer_dir)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = _hf_llama(source, self.device, dtype, sdpa=True)
        self.hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(self.tokenizer_dir / "tokenizer.json"))
        self.hf_tok.pad_token_id, self.hf_tok.padding_side = self.tokenizer.eos_token_ids[0], "left"
        self.max_batch, self.gather_s = max_batch, gather_s
        self._grammar_compiler = None
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._loop, name="hf-batcher", daemon=True)
        self._worker.start()

    # the program threads submit jobs; one worker thread batches them
    def _submit(self, job: _Job) -> Any:
        self._jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def generate(self, ctx: GenContext, params: GenParams) -> tuple[str, dict[str, Any]]:
        return self._submit(_Job("gen", self.tokenizer.encode(ctx.text), _values(params)))

    def select(self, ctx: GenContext, choices: list[str], temperature: float, choices_method: str) -> ChoiceDecision:
        check_choices(choices, choices_method)
        return self._submit(_Job("select", [], choices=list(choices), method=choices_method, text=ctx.text))

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._worker.join()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            time.sleep(self.gather_s)  # let the other program threads' requests arrive
            jobs = [job]
            while True:
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._jobs.put(None)
                    break
                jobs.append(nxt)
            groups: dict[tuple, list[_Job]] = {}
            for j in jobs:
                if j.kind == "select":
                    self._run([j], self._select)
                else:
                    v = j.values
                    key = (v["max_new_tokens"], v["stop"], v["ignore_eos"], v["regex"] is not None)
                    groups.setdefault(key, []).append(j)
            for group in groups.values():
                for i in range(0, len(group), self.max_batch):
                    self._run(group[i: i + self.max_batch], self._generate)

    def _run(self, jobs: list[_Job], fn) -> None:
        try:
            results = fn(jobs)
            for j, r in zip(jobs, results):
                j.result = r
        except BaseException as e:  # noqa: BLE001 - handed to the waiting program threads
            for j in jobs:
                j.error = e
        for j in jobs:
            j.done.set()

    def _generate(self, jobs: list[_Job]) -> list[tuple[str, dict[str, Any]]]:
        import torch

        v = jobs[0].values
        n = v["max_new_tokens"]
        width = max(len(j.ids) for j in jobs)
        pad = self.hf_tok.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(j.ids)) + j.ids for j in jobs], device=self.device)
        mask = torch.tensor([[0] * (width - len(j.ids)) + [1] * len(j.ids) for j in jobs], device=self.device)
        kwargs: dict[str, Any] = {"max_new_tokens": n, "do_sample": False, "pad_token_id": pad}
        if v["ignore_eos"]:
            kwargs["min_new_tokens"] = n
        if v["stop"]:
            kwargs.update(stop_strings=list(v["stop"]), tokenizer=self.hf_tok)
        if v["regex"] is not None:
            kwargs["logits_processor"] = [self._regex_processor([j.values["regex"] for j in jobs])]
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, **kwargs)
        new = out[:, width:]
        eos = set(self.tokenizer.eos_token_ids)
        self.counters["prompt_tokens"] += sum(len(j.ids) for j in jobs)
        self.counters["prompt_tokens_computed"] += sum(len(j.ids) for j in jobs)
        self.counters["padded_prompt_tokens"] += input_ids.numel()
        self.counters["decode_steps"] += new.shape[1]
        self.counters["forward_calls"] += new.shape[1]
        results = []
        for row, j in zip(new.tolist(), jobs):
            ids = []
            for t in row:
                if t in eos and not v["ignore_eos"]:
                    break
                ids.append(t)
            text, stopped = cut_at_stop(self.tokenizer.decode(ids), v["stop"])
            if stopped:
                ids = self.tokenizer.encode(text) if text else []
            self.counters["generated_tokens"] += len(ids)
            results.append((text, {"prompt_tokens": len(j.ids), "completion_tokens": len(ids), "cached_tokens": 0}))
        return results

    def _regex_processor(self, regexes: list[str]):
        import xgrammar as xgr
        from xgrammar.contrib.hf import LogitsProcessor

        if self._grammar_compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.hf_tok, vocab_size=self.model.config.vocab_size)
            self._grammar_compiler = xgr.GrammarCompiler(info)
        return LogitsProcessor([self._grammar_compiler.compile_regex(r) for r in regexes])

    def _select(self, jobs: list[_Job]) -> list[ChoiceDecision]:
        import torch
        from transformers import DynamicCache

        (job,) = jobs
        prefix, full, start = self._scoring_plan(job.text, job.choices)
        cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([full[0][:start]], device=self.device), past_key_values=cache,
                             use_cache=True)
            first = torch.log_softmax(out.logits[0, -1].float(), -1)
            logprobs = []
            for f in full:
                rest = f[start:]
                lp = [first[rest[0]].item()]
                if len(rest) > 1:
                    o = self.model(input_ids=torch.tensor([rest[:-1]], device=self.device), past_key_values=cache,
                                   use_cache=True)
                    cache.crop(-(len(rest) - 1))
                    lps = torch.log_softmax(o.logits[0].float(), -1)
                    lp += [lps[i, t].item() for i, t in enumerate(rest[1:])]
                logprobs.append(lp)
                self.counters["prompt_tokens_computed"] += len(rest) - 1
                self.counters["forward_calls"] += 1
        self.counters["prompt_tokens"] += sum(len(f) for f in full)
        self.counters["prompt_tokens_computed"] += start
        self.counters["forward_calls"] += 1
        index, scores = choose(job.method, logprobs)
        return [ChoiceDecision(job.choices[index], {"normalized_prompt_logprobs": scores})]


# ---- llama.cpp ---------------------------------------------------------------------------------------------------
class LlamaCpp(PeerBackend):
    def __init__(self, source: Any, logits_all: bool = False, n_ctx: int = 4096, threads: int | None = None) -> None:
        import os

        from llama_cpp import Llama

        from sgnb.engine.model_loader import smollm2_gguf_path

        super().__init__(source)
        threads = threads or os.cpu_count() or 1
        self.llm = Llama(model_path=str(smollm2_gguf_path()), n_threads=threads, n_threads_batch=threads,
                         n_ctx=n_ctx, n_batch=512, flash_attn=True, logits_all=logits_all, verbose=False)
        self.lock = threading.Lock()

    def _reused(self, ids: list[int]) -> int:
        """How much of `ids` llama.cpp can take from its KV (the previous call's tokens)."""
        past = self.llm._input_ids[: self.llm.n_tokens].tolist()
        return min(common_prefix_len(past, ids), len(ids) - 1)

    def generate(self, ctx: GenContext, params: GenParams) -> tuple[str, dict[str, Any]]:
        v = _values(params)
        if v["regex"] is not None or v["json_schema"] is not None:
            raise NotImplementedError("llama.cpp: regex constraints are not translated to GBNF by this harness")
        ids = self.tokenizer.encode(ctx.text)
        kwargs: dict[str, Any] = {"max_tokens": v["max_new_tokens"], "temperature": 0.0, "top_k": 1}
        if v["stop"]:
            kwargs["stop"] = list(v["stop"])
        if v["ignore_eos"]:
            kwargs["logit_bias"] = {t: -1e9 for t in self.tokenizer.eos_token_ids}
        with self.lock:
            reused = self._reused(ids)
            out = self.llm.create_completion(ids, **kwargs)
        text = out["choices"][0]["text"]
        n = out["usage"]["completion_tokens"]
        self.counters["prompt_tokens"] += len(ids)
        self.counters["prompt_tokens_computed"] += len(ids) - reused
        self.counters["generated_tokens"] += n
        self.counters["decode_steps"] += n
        return text, {"prompt_tokens": len(ids), "completion_tokens": n, "cached_tokens": reused}

    def select(self, ctx: GenContext, choices: list[str], temperature: float, choices_method: str) -> ChoiceDecision:
        import numpy as np

        check_choices(choices, choices_method)
        if not self.llm._logits_all:
            raise NotImplementedError("select needs LlamaCpp(logits_all=True)")
        prefix, full, start = self._scoring_plan(ctx.text, choices)
        logprobs = []
        with self.lock:
            for f in full:
                reused = self._reused(f)
                self.llm.n_tokens = reused
                self.llm.eval(f[reused:])
                rows = np.asarray(self.llm.scores[start - 1: len(f) - 1], dtype=np.float64)
                rows = rows - rows.max(-1, keepdims=True)
                lse = np.log(np.exp(rows).sum(-1))
                logprobs.append([float(rows[i, t] - lse[i]) for i, t in enumerate(f[start:])])
                self.counters["prompt_tokens"] += len(f)
                self.counters["prompt_tokens_computed"] += len(f) - reused
                self.counters["forward_calls"] += 1
        index, scores = choose(choices_method, logprobs)
        return ChoiceDecision(choices[index], {"normalized_prompt_logprobs": scores})

    def shutdown(self) -> None:
        with self.lock:
            self.llm.close()


# ---- Guidance ----------------------------------------------------------------------------------------------------
class Guidance(PeerBackend):
    def __init__(self, source: Any, tokenizer_dir: str | None = None) -> None:
        import torch
        from transformers import PreTrainedTokenizerFast

        super().__init__(source, tokenizer_dir)
        import guidance

        _patch_guidance_crop()
        model = _hf_llama(source, torch.device("cpu"), torch.float32)
        tok = PreTrainedTokenizerFast(tokenizer_file=str(self.tokenizer_dir / "tokenizer.json"))
        tok.eos_token, tok.bos_token = "<|im_end|>", "<|im_start|>"
        self.lm = guidance.models.Transformers(model, tok, echo=False, enable_monitoring=False)
        self.lock = threading.Lock()
        self._n = 0

    def generate(self, ctx: GenContext, params: GenParams) -> tuple[str, dict[str, Any]]:
        from guidance import gen

        v = _values(params)
        if v["json_schema"] is not None:
            raise NotImplementedError("json_schema gens are not wired for guidance in this harness")
        kwargs: dict[str, Any] = {"max_tokens": v["max_new_tokens"], "temperature": 0.0}
        if v["stop"]:
            kwargs["stop"] = list(v["stop"])
        if v["regex"] is not None:
            kwargs["regex"] = v["regex"]
        with self.lock:
            self._n += 1
            name = f"v{self._n}"
            state = self.lm + ctx.text + gen(name=name, **kwargs)
        text = state[name]
        n = len(self.tokenizer.encode(text)) if text else 0
        prompt = len(self.tokenizer.encode(ctx.text))
        self.counters["prompt_tokens"] += prompt
        self.counters["generated_tokens"] += n
        return text, {"prompt_tokens": prompt, "completion_tokens": n}

    def select(self, ctx: GenContext, choices: list[str], temperature: float, choices_method: str) -> ChoiceDecision:
        from guidance import select

        check_choices(choices, choices_method)
        with self.lock:
            self._n += 1
            name = f"v{self._n}"
            state = self.lm + ctx.text + select(choices, name=name)
        self.counters["prompt_tokens"] += len(self.tokenizer.encode(ctx.text))
        return ChoiceDecision(state[name], {})


def _patch_guidance_crop() -> None:
    """guidance 0.3.1 trims its KV cache with `cache.crop(keep)` (keep that many tokens); transformers >= 5.18
    reads the argument as the number of tokens to remove, a negative int (it raises on positive values and
    ignores 0). The guidance system runs in its own process: give DynamicCache the old meaning there."""
    from transformers import DynamicCache

    if getattr(DynamicCache.crop, "_keep_semantics", False):
        return
    remove = DynamicCache.crop

    def crop(self, keep: int) -> None:
        if keep < 0:
            return remove(self, keep)
        drop = self.get_seq_length() - keep
        if drop > 0:
            remove(self, -drop)

    crop._keep_semantics = True
    DynamicCache.crop = crop


SYSTEMS_PEERS = {"hf-transformers": HFTransformers, "llama.cpp": LlamaCpp, "guidance": Guidance}
