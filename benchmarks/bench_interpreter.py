"""Issue 3's benchmark: interpreter overhead per primitive, and run_batch with vs without frontend hints.

1. Overhead: a program of many text appends and short gens on the real engine; overhead = wall time minus the
   engine's own time for the requests (sum of e2e latencies, which run one after another in one program),
   divided by the number of primitives. Also on a backend that returns at once (pure interpreter cost).
2. Hints: a shared-prefix program (few-shot prefix + question + gen) via run_batch with the traced prefix
   cached first vs not, side by side, on the same engine (cache flushed between runs).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_name, write_result  # noqa: E402

import sgnb as sgl  # noqa: E402
from sgnb.backends.base import Backend  # noqa: E402


class InstantBackend(Backend):
    """Answers every gen with a fixed word at once: what remains is the interpreter's own cost."""

    def get_model_name(self) -> str:
        return "instant"

    def generate(self, ctx, params):
        return "ok", {"prompt_tokens": 0, "completion_tokens": 1, "e2e_latency": 0.0}


@sgl.function
def many_primitives(s, n):
    for i in range(n):
        s += f"Step {i}: "
        s += sgl.gen(f"g{i}", max_tokens=1, temperature=0, ignore_eos=True)
        s += "\n"


SHOTS = "".join(f"Q: What is {i} plus {i}? A: {2 * i}\n" for i in range(60))


@sgl.function
def shared_prefix(s, q):
    s += "Answer the arithmetic questions.\n" + SHOTS
    s += "Q: " + q + " A:"
    s += sgl.gen("a", max_tokens=4, temperature=0, ignore_eos=True, stop="\n")


def main() -> None:
    n = 100
    t0 = time.perf_counter()
    st = many_primitives.run(n=n, backend=InstantBackend())
    st.sync()
    instant = (time.perf_counter() - t0) / (3 * n)

    rt = sgl.Runtime("smollm2")
    many_primitives.run(n=2, backend=rt).sync()
    t0 = time.perf_counter()
    st = many_primitives.run(n=n, backend=rt)
    st.sync()
    wall = time.perf_counter() - t0
    engine_time = sum(st.get_meta_info(f"g{i}")["e2e_latency"] for i in range(n))
    overhead = (wall - engine_time) / (3 * n)

    batch = [{"q": f"What is {i} plus {i + 1}?"} for i in range(32)]
    rows = {}
    # the engine defers a request whose uncached prefix is being prefilled in the same batch, which already
    # shares a prefix among simultaneous requests; the third variant turns that off too, to show what the
    # hint alone is worth (e.g. against a server without such a scheduler)
    no_dedupe = sgl.Runtime("smollm2", in_batch_prefix_threshold=10**9, disable_in_batch_sharing=True)
    variants = [("sgnb", rt, True), ("sgnb-no-hints", rt, False), ("sgnb-hints-no-batch-dedupe", no_dedupe, True),
                ("sgnb-no-hints-no-batch-dedupe", no_dedupe, False)]
    for name, backend, hints in variants:
        backend.flush_cache()
        before = backend.engine.get_stats()
        t0 = time.perf_counter()
        states = shared_prefix.run_batch(batch, backend=backend, frontend_hints=hints)
        wall_b = time.perf_counter() - t0
        after = backend.engine.get_stats()
        assert all(s.error() is None for s in states)
        rows[name] = {
            "wall_s": wall_b, "programs_per_s": len(batch) / wall_b,
            "prefill_tokens_computed": after["prefill_tokens"] - before["prefill_tokens"],
            "cache_hit_rate": (after["cached_tokens"] - before["cached_tokens"])
            / max(after["prompt_tokens"] - before["prompt_tokens"], 1)}
    rt.shutdown()
    no_dedupe.shutdown()
    print(f"interpreter overhead per primitive: {overhead * 1e3:.3f} ms on the engine "
          f"({wall:.2f} s wall, {engine_time:.2f} s in the engine, {3 * n} primitives); "
          f"{instant * 1e3:.3f} ms with an instant backend")
    for name, r in rows.items():
        print(f"{name:<15} {r['wall_s']:6.2f} s  {r['programs_per_s']:6.2f} programs/s  prefilled "
              f"{r['prefill_tokens_computed']:6d} tokens  hit rate {r['cache_hit_rate']:.3f}")
    ratio = rows["sgnb"]["programs_per_s"] / rows["sgnb-no-hints"]["programs_per_s"]
    ratio_alone = (rows["sgnb-hints-no-batch-dedupe"]["programs_per_s"]
                   / rows["sgnb-no-hints-no-batch-dedupe"]["programs_per_s"])
    print(f"hints speedup {ratio:.2f}x (with the engine's in-batch dedupe), {ratio_alone:.2f}x without it; "
          f"target overhead < 1 ms: {overhead < 1e-3}")
    path = write_result("cpu", "interpreter", {
        "device": device_name(), "model": "SmolLM2-135M-Instruct", "benchmark": "interpreter",
        "overhead_ms_per_primitive_engine": overhead * 1e3, "overhead_ms_per_primitive_instant": instant * 1e3,
        "workloads": [{"name": "shared_prefix_run_batch_32", "system": k, **v} for k, v in rows.items()],
        "ratios": {"sgnb/sgnb-no-hints": ratio, "hints/no-hints without batch dedupe": ratio_alone}, "targets": {"overhead < 1 ms": overhead < 1e-3}})
    print("wrote", path)


if __name__ == "__main__":
    main()
