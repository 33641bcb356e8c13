"""Warm-up at engine start: run the shapes a program will meet once, so no program pays their first-use costs.

On a GPU the first forward of each kind compiles kernels: Triton specializes a kernel per tile size (the extend
kernel's BLOCK_M follows the batch's longest query run: 16, 32 or 64) and per variant (causal or not, with a
log-sum-exp output for the cascade's merge), and FlashInfer JIT-builds a module per prefill or cascade variant
(~100 s each on a machine that never built it; then cached on disk). A compile inside a program's first
shared-prefix batch costs that program more than the radix cache saves it (benchmarks/results/NOTES.md). So
the engine, once started, runs a few tiny requests that take every path a
program can take (prefill at each tile size, a cached prefix, the cascade over a prefix shared by a batch at
each tile size, decode through the graphs and beside a prefill, input logprobs, the grammar bitmask), then
empties the cache, the counters and the event history: the engine the caller gets has seen nothing.

On disk caches persist, so after the first start on a machine the warm-up costs tens of milliseconds.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sgnb.engine.engine import Engine

log = logging.getLogger("sgnb.engine")

# extend lengths: small ones (the extend CUDA graphs on a GPU, each BLOCK_M of the kernel elsewhere) and one
# past the graphs' token budget (eager: FlashInfer or the Triton extend kernel)
PREFILL_LENGTHS = (5, 24, 48, 130, 600)
SHARED_PREFIX = 64  # >= scheduler.MIN_SHARED_PREFIX: batches over it take the cascade path
# (requests, extend each) of the cascade batches: small batches, and batches past the graphs' 512-token budget
# whose longest extend selects each BLOCK_M of the own-keys pass (16, 32, 64)
CASCADE_BATCHES = ((4, 3), (4, 12), (40, 14), (20, 28), (5, 130))
# (requests, extend each) of batches of distinct prompts past the graphs' token budget: the plain (no cascade)
# eager extend at BLOCK_M 16 and 32 (600 above takes 64). Many short extends in one round (200 JSON programs'
# jump-forward continuations, 64 chat turns) run so, and without these their first such round compiles both
# variants inside the program
EAGER_BATCHES = ((40, 14), (20, 28))


def warm_up(engine: Engine) -> float:
    """Run the warm-up requests through `engine` and reset what they left behind. Returns the seconds taken."""
    t0 = time.perf_counter()
    vocab = engine.source.config.vocab_size
    usable = [t for t in range(100, min(vocab, 20_000)) if t not in engine.scheduler.eos_ids]

    def ids(n: int, offset: int) -> list[int]:
        return [usable[(offset + 7 * i) % len(usable)] for i in range(n)]

    greedy = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    # a small engine (a short context, a small KV pool) warms what fits in it: each request, and each batch's
    # tokens, within half the pool and the context
    room = min(engine.context_length - 16, engine.runner.kv_pool.size // 2)
    for i, n in enumerate(PREFILL_LENGTHS):  # one request per tile size, decode at batch 1 afterwards
        if n <= room:
            engine.generate(input_ids=ids(n, 1_000 * i), sampling_params=greedy)
    for j, (count, n) in enumerate(EAGER_BATCHES):  # distinct first tokens: no prefix is shared or cached
        if count * (n + 6) <= room and count <= engine.config.max_running_requests:
            engine.generate(input_ids=[ids(n + k % 3, 20_000 + 1_000 * j + 37 * k) for k in range(count)],
                            sampling_params=greedy)
    shared = ids(SHARED_PREFIX, 50)
    if SHARED_PREFIX + 16 <= room:
        engine.generate(input_ids=shared, sampling_params={"max_new_tokens": 0})  # cache it
        for j, (count, n) in enumerate(CASCADE_BATCHES):  # requests over the cached prefix: the cascade
            if SHARED_PREFIX + count * (n + 6) > room or count > engine.config.max_running_requests:
                continue
            batch = [shared + ids(n + k % 3, 3_000 + 500 * j + 10 * k) for k in range(count)]
            engine.generate(input_ids=batch, sampling_params=greedy)
    if 120 <= room:  # input logprobs, and decode riding along with a prefill (a mixed batch)
        engine.generate(input_ids=[ids(20, 7_000), ids(90, 8_000)],
                        sampling_params={**greedy, "max_new_tokens": 8}, return_logprob=True, logprob_start_len=0,
                        top_logprobs_num=2)
    _warm_bitmask(engine)
    engine.flush_cache()
    engine.scheduler.reset_counters()
    engine.events.clear()
    seconds = time.perf_counter() - t0
    log.info("warm-up (every kernel variant a program takes) in %.1f s", seconds)
    return seconds


def _warm_bitmask(engine: Engine) -> None:
    """The grammar bitmask kernel, on a GPU (xgrammar is not needed for it: the mask is a plain int32 tensor)."""
    device = engine.runner.device
    if device.type != "cuda":
        return
    import torch

    from sgnb.kernels.bitmask import apply_token_bitmask

    vocab = engine.source.config.vocab_size
    logits = torch.zeros(2, vocab, dtype=torch.float32, device=device)
    bitmask = torch.full((2, (vocab + 31) // 32), -1, dtype=torch.int32, device=device)
    apply_token_bitmask(logits, bitmask, [1])
    torch.cuda.synchronize(device)
