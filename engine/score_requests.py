"""The engine's requests for choice scoring (select): engine/scoring.py's method over prompt-logprob requests.

`plan` validates a prefix and its choices and builds the requests (nothing is submitted): one per choice, prefix +
choice tokenized together, its input logprobs from SGLang's logprob_start_len (image tokens counted); for the
unconditional method, one more per choice holding only its scored entries' tokens. The prefix's KV is shared
through the radix cache. The caller submits `ScorePlan.reqs`, waits for them and passes their outputs, in order,
to `ScorePlan.result`, which applies the method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sgnb.engine.request import Req
from sgnb.engine.request_input import new_rid
from sgnb.engine.sampling_params import SamplingParams
from sgnb.engine.scoring import check_choices, choice_rows, decide, heals, start_len, unexpanded_index

if TYPE_CHECKING:
    from sgnb.engine.engine import Engine


@dataclass
class ScorePlan:
    """A select's requests: reqs[i] scores choices[i]; for the unconditional method reqs[n + i] scores choice i's
    entries alone (n = len(choices))."""

    reqs: list[Req]
    choices: list[str]
    method: str
    prefix_text: str  # the prefix as text (decoded when given as ids): what token healing is judged against

    def result(self, outs: list[dict], with_text: bool, token_text: Callable[[int], str]) -> dict:
        """The decision and SGLang's meta_info for the method from the requests' outputs (see Engine.score).
        RuntimeError when one of them failed."""
        n = len(self.choices)
        for o in outs:
            if o["meta_info"]["finish_reason"]["type"] == "abort":
                raise RuntimeError(f"scoring failed: {o['meta_info'].get('error')}")

        def entries(o: dict, texts: bool) -> list[tuple]:
            return [(lp, t, token_text(t) if texts else None) for lp, t, _ in o["meta_info"]["input_token_logprobs"]]

        # the first entry's text decides token healing, whether or not the caller wants the texts
        rows, normalized = choice_rows(self.prefix_text, [entries(o, True) for o in outs[:n]], self.choices)
        if not with_text:
            rows = [[(e[0], e[1], None) for e in row] for row in rows]
        uncond = None
        if self.method == "unconditional_likelihood_normalized":
            # aligned from the end: a context that starts inside an image holds the whole image
            uncond = [entries(o, with_text)[-len(row):] for o, row in zip(outs[n:], rows)]
        index, meta = decide(self.method, normalized, rows, uncond)
        return {
            "index": index,
            "choice": self.choices[index],
            **meta,
            "output_token_logprobs": [o["meta_info"]["output_token_logprobs"] for o in outs[:n]],
            "cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in outs),
            "prompt_tokens": sum(o["meta_info"]["prompt_tokens"] for o in outs),
        }


def plan(engine: Engine, prefix: str | list[int], choices: list[str], method: str, image_data: Any = None,
         video_data: Any = None) -> ScorePlan:
    """One prompt-logprob request per choice, from SGLang's logprob_start_len (max(prompt_len - 2, 0), image
    tokens counted), plus, for the unconditional method, one per choice for its entries' tokens alone. Bad input
    raises (ValueError) before any model work; images are loaded here, in the caller's thread."""
    check_choices(choices, method)
    tokenizer = engine.tokenizer
    from_text = isinstance(prefix, str)
    if isinstance(prefix, str):
        # prefix + choice tokenized together (their junction may merge), all in one call
        prefix_ids, *full = tokenizer.encode_many([prefix, *(prefix + c for c in choices)])
        text = prefix
    else:
        prefix_ids = engine._tokens(None, prefix)[0] if len(prefix) else []  # the caller's: ints in the vocabulary
        text = tokenizer.decode(prefix_ids, False)
        full = [prefix_ids + ids for ids in tokenizer.encode_many(choices)]
    if not prefix_ids:
        raise ValueError("select needs a non-empty prefix to score choices against")
    for ids in full:
        engine._check_fits(ids, from_text)
    media = engine._media
    items = media.items(image_data, video_data)  # once for every choice (they share the prefix)
    expanded = [media.place(f, None, None, items=items) for f in full]
    # every image sits in the shared prefix: the prefix's own length with its image tokens
    start = start_len(len(prefix_ids) + len(expanded[0][0]) - len(full[0]))
    reqs, heads = [], []
    for choice, (ids, placements) in zip(choices, expanded):
        if len(ids) <= start + 1:
            raise ValueError(f"select: the choice {choice!r} leaves no token to score: the prefix and it "
                             f"tokenize to {len(ids)} tokens, and scoring starts at token {start + 1}")
        reqs.append(_prompt_logprobs(ids, placements, start))
        heads.append(start + 1 if heals(text, engine._token_text(ids[start])) else start)
    if method == "unconditional_likelihood_normalized":
        # each choice's entries' tokens alone; one that starts inside an image takes the whole image
        for f, (_, placements), head in zip(full, expanded, heads):
            alone = f[unexpanded_index(head, [(p.offset, p.item.num_tokens) for p in placements]):]
            ids_u, placements_u = media.place(alone, None, None, items=media.trailing_items(alone, items))
            reqs.append(_prompt_logprobs(ids_u, placements_u, 0))
    return ScorePlan(reqs, choices, method, text)


_SCORING = SamplingParams.from_dict({"max_new_tokens": 0})  # frozen: every scoring request shares it


def _prompt_logprobs(ids: list[int], placements: list[Any], start: int) -> Req:
    """A request that only computes its prompt's logprobs from token `start` on."""
    req = Req(new_rid(), ids, _SCORING, return_logprob=True, logprob_start_len=start)
    req.mm = placements
    return req
