"""`make demo`: run the quickstart notebook headless and say where to look at it.

    python -m sgnb.demo                 # notebooks/quickstart.ipynb -> build/quickstart.html (from a checkout)
    python -m sgnb.demo --text          # the text demo: a short workload straight on the engine

The text demo: few-shot questions that share one long prefix run as a batch (the prefix is computed once and
reused), then a chat turn through the model's template, then a `select`-style choice scoring.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

FEW_SHOT = """Answer each question with one word.
Q: What color is the sky on a clear day? A: Blue
Q: What is frozen water called? A: Ice
Q: Which animal says moo? A: Cow
Q: What do bees make? A: Honey
Q: What is the opposite of hot? A: Cold
"""
QUESTIONS = ["What color is grass?", "What is the capital of France?", "How many legs does a spider have?",
             "What do cows drink?", "Which planet do we live on?", "What is the opposite of up?"]


def text_demo() -> None:
    from sgnb.engine import Engine

    t0 = time.perf_counter()
    engine = Engine("smollm2")
    print(f"loaded {engine.model_name} on {engine.runner.placement} in {time.perf_counter() - t0:.1f} s "
          f"(KV pool {engine.runner.kv_pool.size} tokens)\n")

    prompts = [f"{FEW_SHOT}Q: {q} A:" for q in QUESTIONS]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, {"max_new_tokens": 6, "temperature": 0, "stop": ["\n"]})
    dt = time.perf_counter() - t0
    print(f"few-shot batch: {len(prompts)} programs in {dt:.2f} s")
    for q, o in zip(QUESTIONS, outs):
        m = o["meta_info"]
        print(f"  {q:<38} -> {o['text'].strip()!r:<12} prompt {m['prompt_tokens']}, cached {m['cached_tokens']}")

    chat = engine.apply_chat_template([{"role": "user", "content": "Give me one tip for writing clear code."}])
    out = engine.generate(chat, {"max_new_tokens": 48, "temperature": 0})
    print(f"\nchat: {out['text'].strip()!r}")

    choice = engine.score(f"{FEW_SHOT}Q: What color is a banana? A:", [" Yellow", " Purple", " Seven"])
    probs = ", ".join(f"{c.strip()} {lp:.2f}" for c, lp in zip([" Yellow", " Purple", " Seven"],
                                                               choice["normalized_prompt_logprobs"]))
    print(f"\nselect: {choice['choice'].strip()!r} (mean logprob per choice: {probs})")

    s = engine.get_stats()
    tree = engine.tree_snapshot()
    print(f"\ncache: hit rate {s['cache_hit_rate']:.1%} ({s['cached_tokens']} of {s['prompt_tokens']} prompt tokens), "
          f"{len(tree['nodes']) - 1} tree nodes holding {tree['total_tokens']} tokens, "
          f"{s['prefill_tokens']} tokens prefilled, {s['generated_tokens']} generated in {s['decode_steps']} decode steps")
    engine.shutdown()


def notebook_demo(notebook: Path, html: Path) -> int:
    from sgnb.cli import main as cli

    if not notebook.exists():
        print(f"sgnb demo: {notebook} not found (the notebooks live in a source checkout); try --text",
              file=sys.stderr)
        return 1
    code = cli(["run", str(notebook), "-o", str(html)])
    if code == 0:
        python = os.path.relpath(sys.executable)
        jupyter = os.path.relpath(Path(sys.executable).parent / "jupyter")
        print(f"\nThe executed notebook, outputs and widgets included: {html}\n"
              f"  open it in a browser: {html.resolve().as_uri()}\n"
              f"Run it live in JupyterLab: {jupyter} lab {notebook}\n"
              f"More notebooks in {notebook.parent}/; the text demo: {python} -m sgnb.demo --text")
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgnb.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--text", action="store_true", help="the text demo on the engine, no notebook")
    parser.add_argument("--notebook", type=Path, default=Path("notebooks/quickstart.ipynb"))
    parser.add_argument("-o", "--output", type=Path, default=Path("build/quickstart.html"))
    args = parser.parse_args(argv)
    if args.text:
        text_demo()
        return 0
    return notebook_demo(args.notebook, args.output)


if __name__ == "__main__":
    sys.exit(main())
