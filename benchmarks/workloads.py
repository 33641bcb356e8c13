"""The LM-program workloads of the benchmark suite, synthesized offline from fixed seeds (no downloads).

Each workload is an sgnb program plus one argument dict per program instance. Every system runs the same
program through an sgnb backend (benchmarks/peers.py for the peers), so prompts and output lengths are the
same everywhere; the programs are greedy (temperature 0) and use `ignore_eos` with fixed lengths where the
output length is part of the workload (peers that cannot ignore EOS report the tokens they actually made).

`build(name, scale)` returns a Workload; scale "cpu" runs in about a minute per system on the default model on
2 cores, scale "gpu" is the realistic size.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_json import CHARACTER_REGEX, NAMES  # noqa: E402

import sgnb as sgl  # noqa: E402

WORDS = ("river mountain lantern violin glacier orchard comet harbor meadow falcon copper library canyon tulip "
         "engine island pepper thunder marble compass garden signal bridge forest candle window shadow silver "
         "market winter planet garden ladder mirror anchor feather basket castle desert valley rocket cotton "
         "crystal dragon empire fossil harvest jungle kettle legend magnet needle oyster pirate quartz saddle "
         "temple umbrella velvet walnut yacht zephyr").split()
SUBJECTS = ["astronomy", "botany", "economics", "geology", "music theory", "navigation", "chemistry", "law"]


@dataclass
class Workload:
    name: str
    program: Any  # an sgnb SglFunction
    args: list[dict[str, Any]]
    description: str
    constrained: bool = False  # has regex gens: the jump-forward ablation applies
    has_select: bool = False
    # a system name -> why that peer cannot express this workload (the suite skips it and says so)
    cannot: dict[str, str] = field(default_factory=dict)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _sizes(scale: str, cpu: Any, gpu: Any) -> Any:
    return cpu if scale == "cpu" else gpu


# ---- MMLU-style 5-shot -----------------------------------------------------------------------------------------
def _mc_question(rng: random.Random, subject: str, answer: bool) -> str:
    opts = [_words(rng, rng.randint(2, 4)) for _ in range(4)]
    q = (f"Question: In {subject}, which of these is most closely linked to the {_words(rng, 2)} "
         f"{rng.choice(['principle', 'effect', 'rule', 'method'])}?\n"
         + "".join(f"{letter}. {o}\n" for letter, o in zip("ABCD", opts)) + "Answer:")
    return q + (f" {rng.choice('ABCD')}\n\n" if answer else "")


def _mmlu_args(scale: str, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    subjects, per_subject = _sizes(scale, (4, 8), (8, 64))
    args = []
    for subject in SUBJECTS[:subjects]:
        shots = (f"The following are multiple choice questions (with answers) about {subject}.\n\n"
                 + "".join(_mc_question(rng, subject, True) for _ in range(5)))
        args += [{"shots": shots, "question": _mc_question(rng, subject, False)} for _ in range(per_subject)]
    return args


@sgl.function
def mmlu_gen(s, shots, question):
    s += shots + question
    s += sgl.gen("answer", max_tokens=1)


@sgl.function
def mmlu_select(s, shots, question):
    s += shots + question
    s += sgl.select("answer", choices=[" A", " B", " C", " D"])


# ---- HellaSwag-style 20-shot select over 4 endings ---------------------------------------------------------------
def _hellaswag_args(scale: str, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    n = _sizes(scale, 24, 200)

    def context() -> str:
        return f"A person takes the {_words(rng, 1)} to the {_words(rng, 1)} and then"

    shots = "".join(f"{context()} {_words(rng, rng.randint(5, 9))}.\n\n" for _ in range(20))
    return [{"shots": shots, "context": context(),
             "endings": [" " + _words(rng, rng.randint(6, 12)) + "." for _ in range(4)]} for _ in range(n)]


@sgl.function
def hellaswag(s, shots, context, endings):
    s += shots + context
    s += sgl.select("ending", choices=endings)


# ---- ReAct agent, trace replay --------------------------------------------------------------------------------
REACT_PROMPT = (
    "Solve a question answering task with interleaving Thought, Action, Observation steps. Thought can reason "
    "about the current situation, and Action can be three types:\n(1) Search[entity], which searches the exact "
    "entity on Wikipedia and returns the first paragraph if it exists.\n(2) Lookup[keyword], which returns the "
    "next sentence containing keyword in the current passage.\n(3) Finish[answer], which returns the answer and "
    "finishes the task.\nHere are some examples.\n"
    + "".join(
        f"Question: What is the {a} of the {b} that borders the {c}?\n"
        f"Thought 1: I need to search the {b}, find what borders the {c}, then find its {a}.\n"
        f"Action 1: Search[{b}]\nObservation 1: The {b} is a region known for its {c} and old {a} traditions.\n"
        f"Thought 2: The paragraph mentions the {c}. I need to look up {a}.\n"
        f"Action 2: Lookup[{a}]\nObservation 2: (Result 1 / 1) Its {a} is recorded as the {d}.\n"
        f"Thought 3: The {a} is the {d}. So the answer is the {d}.\nAction 3: Finish[the {d}]\n\n"
        for a, b, c, d in [("height", "northern valley", "glacier", "twin peak"),
                           ("capital", "river delta", "harbor", "copper town"),
                           ("founder", "old library", "meadow", "lantern guild"),
                           ("length", "east canyon", "desert", "long bridge"),
                           ("oldest tree", "orchard hill", "forest", "walnut grove"),
                           ("language", "island state", "marble coast", "falcon tongue")]))


def _react_args(scale: str, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    n, steps, tokens = _sizes(scale, (6, 3, 48), (64, 5, 200))
    return [{"question": f"What is the {_words(rng, 1)} of the {_words(rng, 2)} near the {_words(rng, 1)}?",
             "observations": [f"The {_words(rng, 2)} is described as {_words(rng, rng.randint(10, 30))}."
                              for _ in range(steps)],
             "thought_tokens": tokens} for _ in range(n)]


@sgl.function
def react(s, question, observations, thought_tokens):
    s += REACT_PROMPT + "Question: " + question + "\n"
    for i, obs in enumerate(observations, 1):
        s += f"Thought {i}:" + sgl.gen(f"thought_{i}", max_tokens=thought_tokens, stop="Observation")
        s += f"\nAction {i}:" + sgl.select(f"action_{i}", choices=[" Search", " Lookup", " Finish"])
        s += f"[{question.split()[3]}]\nObservation {i}: {obs}\n"


# ---- tree of thought (2 branches x 4 levels) --------------------------------------------------------------------
TOT_PROMPT = ("Think step by step. At each step propose a short next thought that brings the plan closer to a "
              "solution; different branches should explore different ideas.\n")


def _tot_args(scale: str, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    n, tokens = _sizes(scale, (4, 16), (32, 128))
    return [{"question": f"How can a town with a {_words(rng, 1)} and a {_words(rng, 1)} save {_words(rng, 1)}?",
             "width": 2, "depth": 4, "tokens": tokens} for _ in range(n)]


@sgl.function
def tree_of_thought(s, question, width, depth, tokens):
    s += TOT_PROMPT + "Problem: " + question + "\n"
    frontier = [s]
    for level in range(1, depth + 1):
        nxt = []
        for node in frontier:
            for b, child in enumerate(node.fork(width), 1):
                child += f"Thought {level}.{b}:" + sgl.gen(f"thought_{level}", max_tokens=tokens, ignore_eos=True)
                child += "\n"
                nxt.append(child)
        frontier = nxt
    for leaf in frontier:  # wait for the last level (a fork inherits its parent's variables: name per level)
        leaf[f"thought_{depth}"]


# ---- skeleton of thought -----------------------------------------------------------------------------------------
SOT_PROMPT = ("You are a helpful assistant. First write a skeleton of the answer: five short numbered tips of a "
              "few words each. Then each tip is expanded into a paragraph.\n")


def _sot_args(scale: str, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    n, tip_tokens, expand_tokens = _sizes(scale, (4, 12, 32), (32, 24, 256))
    return [{"question": f"How do I take care of a {_words(rng, 1)} in the {_words(rng, 1)} season?",
             "tip_tokens": tip_tokens, "expand_tokens": expand_tokens} for _ in range(n)]


@sgl.function
def skeleton_of_thought(s, question, tip_tokens, expand_tokens):
    s += SOT_PROMPT + "Question: " + question + "\nSkeleton:\n"
    for i in range(1, 6):
        s += f"{i}." + sgl.gen(f"tip_{i}", max_tokens=tip_tokens, ignore_eos=True) + "\n"
    forks = s.fork(5)
    for i, f in enumerate(forks, 1):
        f += f"Expand tip {i} into a paragraph:" + sgl.gen("expansion", max_tokens=expand_tokens, ignore_eos=True)
    forks.join()


# ---- LLM judge / branch-solve-merge --------------------------------------------------------------------------------
JUDGE_DIMENSIONS = ["helpfulness", "relevance", "accuracy", "depth", "creativity", "level of detail"]


def _judge_args(scale: str, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    n, tokens = _sizes(scale, (4, 48), (32, 256))
    return [{"question": f"Explain why the {_words(rng, 1)} matters to the {_words(rng, 1)}.",
             "answer": _words(rng, 120), "tokens": tokens} for _ in range(n)]


@sgl.function
def llm_judge(s, question, answer, tokens):
    s += ("Please act as an impartial judge and evaluate the answer an assistant gave to the question below.\n"
          f"Question: {question}\nAnswer: {answer}\n")
    forks = s.fork(len(JUDGE_DIMENSIONS))
    for f, dim in zip(forks, JUDGE_DIMENSIONS):
        f += f"Judge the answer on {dim}:" + sgl.gen("judgement", max_tokens=tokens, ignore_eos=True)
    s += "".join(f"\nOn {dim}: {f['judgement']}" for f, dim in zip(forks, JUDGE_DIMENSIONS))
    s += "\nOverall score out of 10:" + sgl.gen("score", max_tokens=2, ignore_eos=True)


# ---- JSON regex decoding over a long document ---------------------------------------------------------------------
CITY_REGEX = (r"""\{\n  "name": "[A-Z][a-z]{1,16}",\n  "country": "[A-Z][a-z]{1,16}",\n"""
              r"""  "population": [1-9][0-9]{3,7},\n  "landmarks": \["[\w ]{1,20}"(, "[\w ]{1,20}"){0,2}\]\n\}""")


def _city_document(rng: random.Random, tokens_words: int) -> str:
    name = rng.choice(["Valmora", "Kestrel", "Oradell", "Brindle", "Solvay", "Tarnow", "Ulmstead", "Corvin"])
    facts = (f"{name} is a city in Norland with a population of {rng.randint(10_000, 900_000)}. It was founded in "
             f"{rng.randint(900, 1900)}. Landmarks include the {_words(rng, 2)} and the {_words(rng, 2)}. ")
    return facts + " ".join(f"The {_words(rng, 1)} of {name} {_words(rng, 8)}." for _ in range(tokens_words // 11))


def _json_regex_args(scale: str, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    n, words = _sizes(scale, (3, 2200), (64, 2200))  # ~3k tokens per document
    return [{"document": _city_document(rng, words)} for _ in range(n)]


@sgl.function
def json_regex(s, document):
    s += "Read the article and extract the facts asked for.\nArticle: " + document + "\n"
    s += "City: " + sgl.gen("name", regex=r"[A-Z][a-z]{1,16}", max_tokens=8)
    s += "\nPopulation: " + sgl.gen("population", regex=r"[1-9][0-9]{3,7}", max_tokens=8)
    s += "\nFounded in year: " + sgl.gen("founded", regex=r"[1-9][0-9]{2,3}", max_tokens=6)
    s += "\nIs it a capital: " + sgl.gen("capital", regex=r"(yes|no)", max_tokens=4)
    s += "\nSummary as JSON:\n" + sgl.gen("summary", regex=CITY_REGEX, max_tokens=96)


# ---- JSON jump-forward: the 11-field character regex --------------------------------------------------------------
def _character_args(scale: str, seed: int) -> list[dict[str, Any]]:
    n = _sizes(scale, 16, 200)
    return [{"name": NAMES[i % len(NAMES)]} for i in range(n)]


@sgl.function
def character_json(s, name):
    s += name + " is a character in Harry Potter. Please fill in the following information about this character.\n"
    s += sgl.gen("json", max_tokens=256, regex=CHARACTER_REGEX)


# ---- multi-turn chat -----------------------------------------------------------------------------------------------
def _chat_args(scale: str, seed: int, long: bool) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    if long:
        n, lo, hi = _sizes(scale, (4, 48, 96), (64, 256, 512))
    else:
        n, lo, hi = _sizes(scale, (16, 4, 8), (256, 4, 8))
    return [{"questions": [f"Tell me about the {_words(rng, 2)} and the {_words(rng, 1)}." for _ in range(4)],
             "lengths": [rng.randint(lo, hi) for _ in range(4)]} for _ in range(n)]


@sgl.function
def multi_turn_chat(s, questions, lengths):
    for i, (q, n) in enumerate(zip(questions, lengths), 1):
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=n, ignore_eos=True))


# ---- serving trace: random lengths, raw throughput -----------------------------------------------------------------
def _serving_args(scale: str, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    n, (in_lo, in_hi), (out_lo, out_hi) = _sizes(scale, (16, (100, 1024), (16, 64)), (512, (100, 1024), (100, 1024)))
    # ~1.3 tokens per word for these words: aim the word count at the sampled token length
    return [{"prompt": f"Request {i}: " + _words(rng, int(rng.randint(in_lo, in_hi) / 1.3)),
             "output_len": rng.randint(out_lo, out_hi)} for i in range(n)]


@sgl.function
def serving(s, prompt, output_len):
    s += prompt
    s += sgl.gen("output", max_tokens=output_len, ignore_eos=True)


REGEX_NOT_GBNF = "llama.cpp constrains with GBNF grammars; the harness has no regex-to-GBNF translation"
WORKLOADS = {
    "mmlu": lambda sc, seed: Workload("mmlu", mmlu_gen, _mmlu_args(sc, seed),
                                      "5-shot multiple choice, a 1-token gen answer"),
    "mmlu_select": lambda sc, seed: Workload("mmlu_select", mmlu_select, _mmlu_args(sc, seed),
                                             "5-shot multiple choice, select over 4 letters", has_select=True),
    "hellaswag": lambda sc, seed: Workload("hellaswag", hellaswag, _hellaswag_args(sc, seed),
                                           "20-shot, select over 4 endings", has_select=True),
    "react": lambda sc, seed: Workload("react", react, _react_args(sc, seed),
                                       "ReAct agent trace replay: gen thoughts (stop at Observation), select "
                                       "actions, replayed observations", has_select=True),
    "tree_of_thought": lambda sc, seed: Workload("tree_of_thought", tree_of_thought, _tot_args(sc, seed),
                                                 "fork 2 branches per node, 4 levels (30 gens)"),
    "skeleton_of_thought": lambda sc, seed: Workload("skeleton_of_thought", skeleton_of_thought, _sot_args(sc, seed),
                                                     "5 tips, then 5 forked expansions"),
    "llm_judge": lambda sc, seed: Workload("llm_judge", llm_judge, _judge_args(sc, seed),
                                           "branch-solve-merge: 6 forked judgements, then a 2-token score"),
    "json_regex": lambda sc, seed: Workload("json_regex", json_regex, _json_regex_args(sc, seed),
                                            "~3k-token article, 5 regex-constrained gens", constrained=True,
                                            cannot={"llama.cpp": REGEX_NOT_GBNF}),
    "json_jump_forward": lambda sc, seed: Workload("json_jump_forward", character_json, _character_args(sc, seed),
                                                   "the 11-field character JSON regex", constrained=True,
                                                   cannot={"llama.cpp": REGEX_NOT_GBNF}),
    "chat_short": lambda sc, seed: Workload("chat_short", multi_turn_chat, _chat_args(sc, seed, False),
                                            "4 turns, 4-8 token answers"),
    "chat_long": lambda sc, seed: Workload("chat_long", multi_turn_chat, _chat_args(sc, seed, True),
                                           "4 turns, long answers (48-96 tokens on CPU, 256-512 on GPU)"),
    "serving_trace": lambda sc, seed: Workload("serving_trace", serving, _serving_args(sc, seed),
                                               "independent requests, input 100-1024 tokens, ignore_eos outputs"),
}


def build(name: str, scale: str = "cpu", seed: int = 0) -> Workload:
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
    return WORKLOADS[name](scale, seed)
