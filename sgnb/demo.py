"""`make demo`: a short LM workload on the default model, printing outputs and what the radix cache did.

Few-shot questions that share one long prefix run as a batch (the prefix is computed once and reused), then a
chat turn through the model's template, then a `select`-style choice scoring.
"""

from __future__ import annotations

import time

FEW_SHOT = """Answer each question with one word.
Q: What color is the sky on a clear day? A: Blue
Q: What is frozen water called? A: Ice
Q: Which animal says moo? A: Cow
Q: What do bees make? A: Honey
Q: What is the opposite of hot? A: Cold
"""
QUESTIONS = ["What color is grass?", "What is the capital of France?", "How many legs does a spider have?",
             "What do cows drink?", "Which planet do we live on?", "What is the opposite of up?"]


def main() -> None:
    from sgnb.engine import Engine

    t0 = time.perf_counter()
    engine = Engine("smollm2")
    print(f"loaded {engine.model_name} on {engine.runner.device} in {time.perf_counter() - t0:.1f} s "
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


if __name__ == "__main__":
    main()
