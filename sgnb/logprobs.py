"""Token logprobs in OpenAI's chat shape: `sgnb serve`'s /v1/chat/completions and `sgnb.dspy.LM` share it."""

from __future__ import annotations

from typing import Any

from sgnb.engine.meta_info import MetaInfo


def chat_logprobs(meta: MetaInfo) -> dict[str, Any]:
    """A result's `output_token_logprobs` ((logprob, id, text) triples) and `output_top_logprobs` as OpenAI's
    chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}, ...]} (empty without logprobs)."""
    entries = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or [None] * len(entries)

    def item(lp: float | None, text: str | None) -> dict[str, Any]:
        text = text or ""
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(lp, text), "top_logprobs": [item(t_lp, t_text) for t_lp, _, t_text in (top or [])]}
                        for (lp, _, text), top in zip(entries, tops)]}
