"""Req: one generation request as the scheduler sees it."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from sgnb.engine.media import Placement
from sgnb.engine.meta_info import FinishReason
from sgnb.engine.radix_cache import TreeNode
from sgnb.engine.sampling_params import SamplingParams
from sgnb.engine.tokenizer import TextOffsets


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # queued for admission (new, or retracted)
    CHUNKED = "chunked"  # admitted; a long prompt whose next chunk extends next round
    EXTENDING = "extending"  # admitted; jump-forward appended forced tokens that the next round extends
    RUNNING = "running"  # admitted; decodes one token per step
    FINISHED = "finished"


class Req:
    """Token-level state of a request.

    KV bookkeeping: the first `kv_len` tokens of `fill_ids` have K/V in the pool at
    req_to_token[req_pool_idx, :kv_len]; the first `cached_len` of those are owned by the radix tree and
    protected by the lock on `last_node`; the next `borrowed` by another request of the batch it was admitted in
    (until the forward is done: KVManager.borrow / adopt); the rest are owned by this request.
    """

    def __init__(self, rid: str, input_ids: list[int], sampling: SamplingParams, *, return_logprob: bool = False,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0,
                 on_update: Callable[[Req], None] | None = None) -> None:
        self.rid = rid
        self.origin_input_ids = input_ids
        self.sampling = sampling
        self.output_ids: list[int] = []
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len if return_logprob else -1
        self.top_logprobs_num = top_logprobs_num if return_logprob else 0
        self.on_update = on_update
        self.mm: list[Placement] = []  # images / videos in origin_input_ids (their pad-id spans), by offset
        self.prompt_offsets: TextOffsets | None = None  # a text prompt's tokens in its characters
        # scheduler state (scheduler thread only)
        self.status = ReqStatus.WAITING
        self.req_pool_idx: int | None = None
        self.new_slots: np.ndarray | None = None  # slots allocated for the next forward's new tokens
        self.kv_len = 0
        self.cached_len = 0
        self.borrowed = 0
        self.last_node: TreeNode | None = None
        self.cached_tokens = -1  # prompt tokens served by the cache at first admission (-1: not yet)
        self.num_retractions = 0
        self.generator: torch.Generator | None = None
        # outputs
        self.text = ""  # decoded output so far (incremental: see Scheduler._advance_text)
        self.detok_prefix = 0  # incremental detokenization offsets into output_ids
        self.detok_read = 0
        # per output token read so far (detok_read of them): the text reading it added; they join to `text`
        # until the end trims it (tokenizer.fit_pieces fits them then)
        self.pieces: list[str] = []
        self.stop_scan = 0  # stop strings were searched in text[:stop_scan] already
        self.finish_reason: FinishReason | None = None
        self.error: BaseException | None = None
        self.input_token_logprobs: list[tuple] = []
        self.input_top_logprobs: list[list[tuple] | None] = []
        self.output_token_logprobs: list[tuple] = []
        self.output_top_logprobs: list[list[tuple] | None] = []
        self.input_logprobs_done = not (return_logprob and logprob_start_len >= 0)
        # structured output: a compile future at submission, the matcher once admitted
        self.grammar_future: Any = None
        self.grammar_key: tuple[str, str] | None = None  # (kind, source) of the constraint grammar_future compiles
        self.grammar: Any = None
        # a grammar that starts after the reasoning (sampling_params.grammar_after): its matcher waits here until
        # the output holds the reasoning's closing marker
        self.grammar_held: Any = None
        self.forced: list[bool] = []  # per output token: appended by jump-forward (True) or sampled
        # lpm's walk of the tree for this request while it waits: (deepest fully matched node, its depth);
        # cleared when it is admitted (its tokens may change afterwards: jump-forward rolls some back)
        self.lpm_hint: Any = None
        self.rollback_floor = 0  # jump-forward rolls back no token before this position (its last extend's end)
        self.decode_steps = 0  # model forwards that produced a sampled token of this request
        self.created = time.perf_counter()
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def fill_view(self) -> list[int]:
        """fill_ids for reading only: the prompt list itself (no copy of a long prompt) while nothing was
        generated."""
        return self.fill_ids if self.output_ids else self.origin_input_ids

    @property
    def fill_len(self) -> int:
        """len(fill_ids), without building it (a long prompt's copy costs ~10 us, several times a round)."""
        return len(self.origin_input_ids) + len(self.output_ids)

    def fill_slice(self, lo: int, hi: int) -> list[int]:
        """fill_ids[lo:hi] (0 <= lo <= hi), copying only those tokens."""
        n = len(self.origin_input_ids)
        if hi <= n:
            return self.origin_input_ids[lo:hi]
        if lo >= n:
            return self.output_ids[lo - n: hi - n]
        return self.origin_input_ids[lo:] + self.output_ids[: hi - n]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def remaining_new_tokens(self) -> int:
        return self.sampling.max_new_tokens - len(self.output_ids)

    def __repr__(self) -> str:
        return f"Req({self.rid}, prompt={len(self.origin_input_ids)}, out={len(self.output_ids)}, kv={self.kv_len})"
