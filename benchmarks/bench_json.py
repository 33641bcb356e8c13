"""Issue 4's benchmark: the paper's JSON workloads with jump-forward on vs off, side by side in one run.

1. character regex: 50 programs, each fills the 11-field "character" JSON (long fixed keys, enums, numbers)
   with one regex-constrained gen.
2. extraction: programs read a long synthetic document (~1,500 tokens) and make several constrained gens
   (a JSON-schema object, an enum regex, a number, a date) about it.
Reports wall time, programs/s, decode steps (forwards that sampled a token) and forced tokens.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_name, write_result  # noqa: E402

import sgnb as sgl  # noqa: E402

CHARACTER_REGEX = (
    r"""\{\n"""
    r"""    "name": "[\w\d\s]{1,16}",\n"""
    r"""    "house": "(Gryffindor|Slytherin|Ravenclaw|Hufflepuff)",\n"""
    r"""    "blood status": "(Pure-blood|Half-blood|Muggle-born)",\n"""
    r"""    "occupation": "(student|teacher|auror|ministry of magic|death eater|order of the phoenix)",\n"""
    r"""    "wand": \{\n"""
    r"""        "wood": "[\w\d\s]{1,16}",\n"""
    r"""        "core": "[\w\d\s]{1,16}",\n"""
    r"""        "length": [0-9]{1,2}\.[0-9]{0,2}\n"""
    r"""    \},\n"""
    r"""    "alive": "(Alive|Deceased)",\n"""
    r"""    "patronus": "[\w\d\s]{1,16}",\n"""
    r"""    "bogart": "[\w\d\s]{1,16}"\n"""
    r"""\}"""
)
NAMES = ["Harry Potter", "Hermione Granger", "Ron Weasley", "Severus Snape", "Albus Dumbledore", "Draco Malfoy",
         "Luna Lovegood", "Neville Longbottom", "Ginny Weasley", "Sirius Black"]


@sgl.function
def character(s, name):
    s += name + " is a character in Harry Potter. Please fill in the following information about this character.\n"
    s += sgl.gen("json", max_tokens=256, regex=CHARACTER_REGEX)


COMPANY_SCHEMA = {"type": "object", "properties": {
    "company": {"type": "string", "maxLength": 24}, "founded": {"type": "integer"},
    "headquarters": {"type": "string", "maxLength": 24}, "public": {"type": "boolean"},
    "products": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["company", "founded", "headquarters", "public", "products"], "additionalProperties": False}


def make_document(seed: int) -> str:
    rng = random.Random(seed)
    words = ["The", "company", "grew", "steadily", "across", "markets", "while", "its", "engineers", "shipped",
             "new", "products", "every", "quarter", "and", "customers", "in", "Europe", "Asia", "praised", "them"]
    body = " ".join(rng.choice(words) for _ in range(1100))
    return (f"Report {seed}. Nordlicht Systems was founded in 19{rng.randint(50, 99)} in Oslo and is listed on the "
            f"stock exchange. Its products include Aurora, Fjord and Polar. {body}")


@sgl.function
def extract(s, document):
    s += "Read the report and answer in the formats asked.\n" + document + "\n"
    s += "Company record as JSON: " + sgl.gen("record", json_schema=COMPANY_SCHEMA, max_tokens=160)
    s += "\nSentiment: " + sgl.gen("sentiment", regex=r"(positive|neutral|negative)", max_tokens=8)
    s += "\nEmployees (estimate): " + sgl.gen("employees", regex=r"[1-9][0-9]{1,5}", max_tokens=8)
    s += "\nFounding date: " + sgl.gen("date", regex=r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]", max_tokens=12)


def run(fn, batch, backend) -> dict:
    engine = backend.engine
    before = engine.get_stats()
    t0 = time.perf_counter()
    states = fn.run_batch(batch, backend=backend, temperature=0)
    wall = time.perf_counter() - t0
    errors = [str(s.error()) for s in states if s.error() is not None]
    names = [n for n in ("json", "record", "sentiment", "employees", "date") if n in states[0].executor.meta_info]
    metas = [s.get_meta_info(n) for s in states if s.error() is None for n in names]
    after = engine.get_stats()
    return {"wall_s": wall, "programs_per_s": len(batch) / wall, "errors": errors[:3],
            "decode_steps": sum(m.get("decode_steps", 0) for m in metas),
            "forced_tokens": sum(m.get("forced_tokens", 0) for m in metas),
            "completion_tokens": sum(m["completion_tokens"] for m in metas),
            "prefill_tokens_computed": after["prefill_tokens"] - before["prefill_tokens"],
            "valid": len(states) - len(errors)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--characters", type=int, default=50)
    ap.add_argument("--documents", type=int, default=8)
    args = ap.parse_args()
    rows = []
    for jf in (True, False):
        backend = sgl.Runtime("smollm2", disable_jump_forward=not jf)
        system = "sgnb" if jf else "sgnb-no-jump-forward"
        character.run(name="warm", backend=backend, temperature=0).sync()  # compile + warm caches
        backend.flush_cache()
        r1 = run(character, [{"name": NAMES[i % len(NAMES)] + ("" if i < len(NAMES) else f" {i}")}
                             for i in range(args.characters)], backend)
        backend.flush_cache()
        r2 = run(extract, [{"document": make_document(i)} for i in range(args.documents)], backend)
        rows += [{"name": "json_character_regex", "system": system, **r1},
                 {"name": "json_schema_extraction", "system": system, **r2}]
        backend.shutdown()
    table = {(r["name"], r["system"]): r for r in rows}
    ratios = {}
    print(f"{'workload':<24}{'system':<22}{'wall s':>8}{'prog/s':>8}{'decode steps':>14}{'forced':>8}{'valid':>7}")
    for r in rows:
        print(f"{r['name']:<24}{r['system']:<22}{r['wall_s']:>8.2f}{r['programs_per_s']:>8.2f}"
              f"{r['decode_steps']:>14}{r['forced_tokens']:>8}{r['valid']:>7}")
    for name in ("json_character_regex", "json_schema_extraction"):
        on, off = table[(name, "sgnb")], table[(name, "sgnb-no-jump-forward")]
        ratios[f"{name}: throughput on/off"] = on["programs_per_s"] / off["programs_per_s"]
        ratios[f"{name}: decode steps off/on"] = off["decode_steps"] / max(on["decode_steps"], 1)
    for k, v in ratios.items():
        print(f"{k:<48}{v:6.2f}")
    targets = {"character regex throughput >= 1.6x": ratios["json_character_regex: throughput on/off"] >= 1.6,
               "character regex decode steps >= 2x fewer": ratios["json_character_regex: decode steps off/on"] >= 2}
    print("targets:", targets)
    print("wrote", write_result("cpu", "json", {"device": device_name(), "model": "SmolLM2-135M-Instruct",
                                                "benchmark": "json_jump_forward", "workloads": rows,
                                                "ratios": ratios, "targets": targets}))


if __name__ == "__main__":
    main()
