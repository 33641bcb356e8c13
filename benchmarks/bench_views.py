"""What the live views cost a program: the same work with and without the streaming view, in a real kernel.

    python benchmarks/bench_views.py [--model smollm2] [--engine-args JSON] [--rounds 6] [--tokens 128]
        [--batch 64] [--batch-tokens 16] [--variants view,table,...] [--out FILE]   (default: benchmarks/results/DATE-{cpu,gpu}-views.json)

At GPU scale: `--model dummy:llama-2-7b-smolvocab --engine-args '{"tokenizer_path": ".gpu/smollm2"}'` (the
GPU machine needs ipykernel, nbclient and anywidget among the carried wheels: benchmarks/gpu/setup.sh).

A notebook is written and run by nbclient (a real ipykernel; its widget messages travel over ZMQ to nbclient,
which keeps the widget state as a frontend would). Inside, each round runs every variant once, in an order
rotated from round to round so drift in the machine's speed hits every variant alike, each from an empty
cache:

- single program, one gen of `--tokens` tokens (greedy, ignore_eos): `none` (no view, not streamed) against
  `view` (a ProgramView, streamed token by token: what a `%%sgl` cell shows by default). Tokens/s.
- `run_batch` of `--batch` programs (a shared prefix, one gen of `--batch-tokens` tokens each): `none` (no
  table, not streamed), `table` (the table a notebook's run_batch shows, streamed: the default; a live
  BatchView once the batch has run 0.25 s, or a static BatchSnapshot when a shorter one ends),
  `table-nostream` (the table, gens shown when they end) and `program-view` (a ProgramView over the whole
  batch, streamed). Programs/s.
- the table's fixed work on the cell's thread per batch, in ms: a batch that ends before the table's delay
  (its static snapshot made and displayed once), and a longer one (made and displayed live; finished).

A variant's cost is the median over rounds of its time against that round's `none` (and, beside it, its median
against `none`'s median); the target is <= 3%. At GPU scale a 64-program batch of 16-token gens lasts ~0.23 s and
single rounds stray by 10% and more (2026-12-06: some rounds of every variant ran at half speed): use 12+ rounds,
and 128-token gens (`--batch-tokens 128`) to see what is not a fixed cost per batch.
The physical limit is the engine itself: `none` is the run with no view at all. Prints a table; writes JSON
with the machine, model, commit and date to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import commit, device_name, write_result  # noqa: E402

SETUP = """\
import json, statistics, time
import sgnb as sgl
from sgnb.widgets import ProgramView
from IPython.display import display

runtime = sgl.Runtime({model!r}, **{engine_args!r})
sgl.set_default_backend(runtime)
engine = runtime.engine
PREFIX = "You answer questions about animals in one short sentence. " * 4

@sgl.function
def story(s, i):
    s += f"Story {{i}}: Once upon a time" + sgl.gen("x", max_tokens={tokens}, ignore_eos=True, temperature=0)

@sgl.function
def qa(s, i):
    s += PREFIX + f"Question {{i}}: what does animal number {{i}} eat? Answer:"
    s += sgl.gen("a", max_tokens={batch_tokens}, ignore_eos=True, temperature=0)

def single(variant):
    engine.flush_cache()
    t0 = time.perf_counter()
    if variant == "none":
        state = story.run(0, stream=False)
        state.sync()
    else:
        view = ProgramView(title="bench")
        display(view)
        state = view.run(story, 0)
        state.sync()
        view.flush()
    dt = time.perf_counter() - t0
    return {tokens} / dt

def batch(variant):
    engine.flush_cache()
    args = [{{"i": i}} for i in range({batch})]
    t0 = time.perf_counter()
    if variant == "none":
        qa.run_batch(args, subscribers=[lambda e: None], stream=False)
    elif variant == "table":
        qa.run_batch(args)
    elif variant == "table-nostream":
        qa.run_batch(args, stream=False)
    else:
        view = ProgramView(title="bench")
        display(view)
        view.run_batch(qa, args, stream=True)
    return {batch} / (time.perf_counter() - t0)

for _ in range(2):  # warm-up: every variant, twice (the first GPU rounds still compile kernels for new shapes)
    for v in {single_variants!r}:
        single(v)
    for v in {batch_variants!r}:
        batch(v)
"""

MEASURE = """\
results = {{"single": {{}}, "batch": {{}}}}
for r in range({rounds}):
    for kind, fn, variants in (("single", single, {single_variants!r}),
                               ("batch", batch, {batch_variants!r})):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            results[kind].setdefault(v, []).append(fn(v))
# the table's own work on the cell's thread per batch, apart from the run: a batch that ends within the table's
# delay gets its static snapshot displayed once ("short"); a longer one gets it displayed live, then finished
from sgnb.widgets._batch_view import BatchTable
args = [{{"i": i}} for i in range({batch})]
states = qa.run_batch(args, subscribers=[lambda e: None], stream=False)
parts = {{"short": [], "live_show": [], "live_finish": []}}
for _ in range(10):
    t0 = time.perf_counter(); BatchTable("qa", args).finish(states); t1 = time.perf_counter()
    table = BatchTable("qa", args); table.show(); t2 = time.perf_counter()
    table.finish(states).close(); t3 = time.perf_counter()
    for k, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
        parts[k].append(dt)
results["table_parts_ms"] = {{k: round(1000 * statistics.median(v), 2) for k, v in parts.items()}}
print("RESULTS " + json.dumps(results))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--engine-args", default="{}", help="engine options as JSON (e.g. tokenizer_path)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batch-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--variants", default="view,table,table-nostream,program-view",
                    help="the variants measured against none (e.g. `table` alone, to profile it)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    chosen = args.variants.split(",")
    unknown = set(chosen) - {"view", "table", "table-nostream", "program-view"}
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}")
    engine_args = json.loads(args.engine_args)
    if "tokenizer_path" in engine_args:  # the kernel runs in a temporary folder
        engine_args["tokenizer_path"] = str(Path(engine_args["tokenizer_path"]).resolve())
    fmt = {"model": args.model, "engine_args": engine_args, "tokens": args.tokens, "batch": args.batch,
           "batch_tokens": args.batch_tokens, "rounds": args.rounds,
           "single_variants": ["none"] + [v for v in chosen if v == "view"],
           "batch_variants": ["none"] + [v for v in chosen if v != "view"]}
    nb = new_notebook(cells=[new_code_cell(SETUP.format(**fmt)), new_code_cell(MEASURE.format(**fmt))])
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                                resources={"metadata": {"path": tmp}})
        client.execute()
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    line = next(x for x in printed.splitlines() if x.startswith("RESULTS "))
    raw = json.loads(line[len("RESULTS "):])
    parts = raw.pop("table_parts_ms")
    rows = []
    for kind, unit in (("single", "tokens/s"), ("batch", "programs/s")):
        base = raw[kind]["none"]
        for variant, values in raw[kind].items():
            ratios = [v / b for v, b in zip(values, base)]  # per round, against that round's none
            rows.append({"workload": kind, "variant": variant, "unit": unit, "median": statistics.median(values),
                         "values": values, "ratio_to_none": statistics.median(ratios),
                         "cost_pct": round(100 * (1 - statistics.median(ratios)), 2),
                         # the same from the medians of each variant's rounds (a slow round of one variant
                         # weighs less here than in its round's ratio)
                         "cost_pct_of_medians": round(100 * (1 - statistics.median(values) / statistics.median(base)), 2)})
    print(f"{'workload':8} {'variant':15} {'median':>10}  {'vs none':>8}  {'cost':>7}  {'of medians':>10}")
    for r in rows:
        print(f"{r['workload']:8} {r['variant']:15} {r['median']:10.2f}  {r['ratio_to_none']:8.3f}  "
              f"{r['cost_pct']:6.2f}%  {r['cost_pct_of_medians']:9.2f}%  ({r['unit']})")
    base = statistics.median(raw["batch"]["none"])
    print(f"the table's own work per batch (cell thread, ms): {parts}; a batch without views lasts "
          f"{1000 * args.batch / base:.0f} ms")
    payload = {"date": time.strftime("%Y-%m-%d"), "commit": commit(), "benchmark": "bench_views",
               "device": device_name(), "model": args.model, "settings": fmt,
               "target": "cost <= 3% (views streamed vs none)", "rows": rows, "table_parts_ms": parts,
               "wall_seconds": round(time.time() - t0, 1)}
    if args.out:
        Path(args.out).write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.out}")
    else:
        print(f"wrote {write_result('cpu' if 'cpu' in payload['device'] else 'gpu', 'views', payload)}")


if __name__ == "__main__":
    main()
