"""The shared suite of LM programs: each runs on any backend; checks assert structure and invariants
(stops respected, choices in choices, variables filled, cache use), not a 135M model's knowledge."""

from __future__ import annotations

import sgnb as sgl

FEW_SHOT = ("Answer with one word.\nQ: What color is the sky? A: Blue\nQ: What is frozen water? A: Ice\n"
            "Q: Which animal says moo? A: Cow\n")


@sgl.function
def few_shot_qa(s, question):
    s += FEW_SHOT + "Q: " + question + " A:"
    s += sgl.gen("answer", max_tokens=12, stop="\n", temperature=0)


def check_few_shot_qa(state) -> None:
    assert "\n" not in state["answer"]
    assert state.text().endswith(state["answer"])
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] <= 12


@sgl.function
def pick_letter(s, question):
    s += "Question: " + question + "\nOptions: A) red B) green C) blue D) seven\nAnswer:"
    s += sgl.select("letter", choices=[" A", " B", " C", " D"])


def check_pick_letter(state) -> None:
    assert state["letter"] in (" A", " B", " C", " D")
    meta = state.get_meta_info("letter")
    assert len(meta["normalized_prompt_logprobs"]) == 4
    best = max(range(4), key=lambda i: meta["normalized_prompt_logprobs"][i])
    assert [" A", " B", " C", " D"][best] == state["letter"]


@sgl.function
def parallel_tips(s, topic):
    s += f"Here are two tips about {topic}.\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Tip {i + 1}:"
        f += sgl.gen("tip", max_tokens=10, stop="\n", temperature=0)
    forks.join()
    s += "Summary:" + sgl.gen("summary", max_tokens=8, stop="\n", temperature=0)


def check_parallel_tips(state) -> None:
    tips = state["tip"]
    assert isinstance(tips, list) and len(tips) == 2 and all(isinstance(t, str) for t in tips)
    assert all("\n" not in t for t in tips)
    assert "Summary:" in state.text()


@sgl.function
def parallel_encode(s, docs):
    s += "Read the notes.\n"
    forks = s.fork(len(docs))
    for f, d in zip(forks, docs):
        f += f"Note: {d}\n"
    forks.join(mode="concate_and_append")
    s += "The notes mention" + sgl.gen("gist", max_tokens=8, stop="\n", temperature=0)


def check_parallel_encode(state, docs) -> None:
    text = state.text()
    positions = [text.index(f"Note: {d}") for d in docs]
    assert positions == sorted(positions)  # appended in order
    assert isinstance(state["gist"], str)


@sgl.function
def chat(s, turns):
    s += sgl.system("You are terse.")
    for i, t in enumerate(turns):
        s += sgl.user(t)
        s += sgl.assistant(sgl.gen(f"reply{i}", max_tokens=16, temperature=0))


def check_chat(state, turns) -> None:
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system"] + ["user", "assistant"] * len(turns)
    assert msgs[0]["content"] == "You are terse."
    for i, t in enumerate(turns):
        assert msgs[1 + 2 * i]["content"] == t
        assert msgs[2 + 2 * i]["content"] == state[f"reply{i}"]


@sgl.function
def react(s, question, max_steps=3):
    s += ("You can Search or Finish.\nQuestion: " + question + "\n")
    for step in range(max_steps):
        s += f"Thought {step + 1}:" + sgl.gen(f"thought{step}", max_tokens=12, stop=["\n", "Action"], temperature=0)
        s += f"\nAction {step + 1}:" + sgl.select(f"action{step}", choices=[" Search", " Finish"])
        if s[f"action{step}"] == " Finish":
            break
        s += f"\nObservation {step + 1}: no results.\n"
    s["steps"] = step + 1


def check_react(state) -> None:
    steps = state["steps"]
    assert 1 <= steps <= 3
    for i in range(steps):
        assert state[f"action{i}"] in (" Search", " Finish")
        assert "\n" not in state[f"thought{i}"]
    if steps < 3:
        assert state[f"action{steps - 1}"] == " Finish"


@sgl.function
def tool_use(s, city):
    s += "Tool call for the weather in " + city + ":\n"
    with s.var_scope("call"):
        s += "weather(city=\"" + city + "\", unit=\""
        s += sgl.select("unit", choices=["celsius", "fahrenheit"])
        s += "\")"
    s += "\nResult: 21 degrees.\nAnswer:" + sgl.gen("answer", max_tokens=10, stop="\n", temperature=0)


def check_tool_use(state, city) -> None:
    assert state["call"] == f'weather(city="{city}", unit="{state["unit"]}")'
    assert state["unit"] in ("celsius", "fahrenheit")


@sgl.function
def may_fail(s, i):
    s += f"Item {i}:"
    if i == 2:
        raise ValueError("item 2 is broken")
    s += sgl.gen("out", max_tokens=3, temperature=0)


@sgl.function
def streamed(s):
    s += "Count from one to ten: one, two,"
    s += sgl.gen("rest", max_tokens=16, temperature=0)


@sgl.function
def typed_values(s):
    s += "Tom is 31 years old and 1.8 meters tall.\nAge: " + sgl.gen_int("age", max_tokens=6)
    s += "\nHeight: " + sgl.gen("height", dtype=float, max_tokens=8)
    s += "\nName: " + sgl.gen_string("name", max_tokens=16)
    s += "\nPhone: " + sgl.gen("phone", regex=r"[0-9]{3}-[0-9]{4}", max_tokens=12)


def check_typed_values(state) -> None:
    import re

    assert isinstance(state["age"], int)
    assert isinstance(state["height"], float)
    assert isinstance(state["name"], str) and '"' not in state["name"]
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", state["phone"])


PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                  "age": {"type": "integer"},
                                                  "city": {"enum": ["Paris", "Rome", "Oslo"]}},
                 "required": ["name", "age", "city"], "additionalProperties": False}


@sgl.function
def extract_json(s, text):
    s += "Extract the person as JSON.\nText: " + text + "\nJSON: "
    s += sgl.gen("person", json_schema=PERSON_SCHEMA, max_tokens=64)


def check_extract_json(state) -> None:
    import json

    import jsonschema

    jsonschema.validate(json.loads(state["person"]), PERSON_SCHEMA)
