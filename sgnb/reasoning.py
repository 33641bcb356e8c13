"""Reasoning ("thinking") separated from the answer, by SGLang's parser names.

A reasoning model writes its thinking between two markers before the answer (`<think>...</think>` for Qwen3 and
DeepSeek-R1, `[THINK]...[/THINK]` for Magistral, a harmony "analysis" channel for gpt-oss). One `ReasoningFormat`
per name says the markers and whether a reply starts *inside* the reasoning (templates that open the block in
the prompt, as DeepSeek-R1's does: the reply has only the closing marker). `split_reasoning` splits a finished
text; `ReasoningStream` splits text as it arrives (holding back what may be the start of a marker), for the
server's `delta.reasoning_content` and the live views. The language (`separate_reasoning`), `sgnb serve
--reasoning-parser` and the engine's "grammar after the reasoning" all use this one table. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    open: str
    close: str
    starts_inside: bool = False  # the reply begins in the reasoning (the prompt opened the block)
    answer_prefix: str = ""  # text that introduces the answer after the close marker (dropped)
    answer_suffix: str = ""  # text that ends the answer (dropped)


_THINK = ("<think>", "</think>")
_HARMONY = dict(open="<|channel|>analysis<|message|>", close="<|end|>",
                answer_prefix="<|start|>assistant<|channel|>final<|message|>", answer_suffix="<|return|>")

# SGLang's names (sglang.srt.parser.reasoning_parser's table) for the formats they share; `auto` is ours: `<think>`
# markers, and a reply with a closing marker but no opening one started inside the reasoning.
FORMATS: dict[str, ReasoningFormat] = {f.name: f for f in [
    ReasoningFormat("auto", *_THINK),
    ReasoningFormat("deepseek-r1", *_THINK, starts_inside=True),
    ReasoningFormat("deepseek-v3", *_THINK),
    ReasoningFormat("qwen3", *_THINK),
    ReasoningFormat("qwen3-thinking", *_THINK, starts_inside=True),
    ReasoningFormat("glm45", *_THINK),
    ReasoningFormat("kimi", "◁think▷", "◁/think▷"),
    ReasoningFormat("kimi_k2", *_THINK),
    ReasoningFormat("step3", *_THINK, starts_inside=True),
    ReasoningFormat("step3p5", *_THINK, starts_inside=True),
    ReasoningFormat("minimax", *_THINK, starts_inside=True),
    ReasoningFormat("nanbeige", *_THINK),
    ReasoningFormat("interns1", *_THINK),
    ReasoningFormat("dots", *_THINK),
    ReasoningFormat("nemotron_3", *_THINK),
    ReasoningFormat("gigachat35", *_THINK, starts_inside=True),
    ReasoningFormat("mistral", "[THINK]", "[/THINK]"),
    ReasoningFormat("gpt-oss", starts_inside=False, **_HARMONY),
]}


def reasoning_format(name: str | None) -> ReasoningFormat:
    """The format called `name` (SGLang's parser names; None: `auto`). A ValueError lists the names known."""
    key = "auto" if name is None else str(name).lower()
    if key not in FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}: one of {', '.join(sorted(FORMATS))}")
    return FORMATS[key]


def split_reasoning(text: str, fmt: ReasoningFormat | str | None = None) -> tuple[str, str]:
    """(reasoning, answer) of a finished reply, each as written (whitespace kept, as SGLang's parsers keep it).
    A reply with no reasoning gives ("", text); a reply cut off inside its reasoning gives (the reasoning, "")."""
    fmt = fmt if isinstance(fmt, ReasoningFormat) else reasoning_format(fmt)
    start = text.find(fmt.open)
    if start >= 0 and text[:start].strip() == "":
        body_at = start + len(fmt.open)
    elif fmt.starts_inside or (fmt.name == "auto" and fmt.close in text):
        body_at = 0
    else:
        return "", _answer(text, fmt)
    end = text.find(fmt.close, body_at)
    if end < 0:
        return text[body_at:], ""
    return text[body_at:end], _answer(text[end + len(fmt.close):], fmt)


def _answer(text: str, fmt: ReasoningFormat) -> str:
    if fmt.answer_prefix:
        at = text.find(fmt.answer_prefix)
        if at >= 0:
            text = text[at + len(fmt.answer_prefix):]
    if fmt.answer_suffix and text.endswith(fmt.answer_suffix):
        text = text[: -len(fmt.answer_suffix)]
    return text


class ReasoningStream:
    """Splits a reply as it arrives: `feed(piece)` returns (reasoning, answer) text that is certain now; a piece
    that may be the start of a marker is held back until the next feed or `finish()`."""

    def __init__(self, fmt: ReasoningFormat | str | None = None) -> None:
        self.fmt = fmt if isinstance(fmt, ReasoningFormat) else reasoning_format(fmt)
        self.state = "start"  # start | reasoning | answer
        self.buffer = ""

    def feed(self, piece: str) -> tuple[str, str]:
        self.buffer += piece
        reasoning, answer = "", ""
        while True:
            if self.state == "start":
                stripped = self.buffer.lstrip()
                if stripped.startswith(self.fmt.open):
                    self.buffer = stripped[len(self.fmt.open):]
                    self.state = "reasoning"
                    continue
                if self.fmt.open.startswith(stripped):
                    return reasoning, answer  # may still open
                self.state = "reasoning" if self.fmt.starts_inside else "answer"
                continue
            if self.state == "reasoning":
                end = self.buffer.find(self.fmt.close)
                if end >= 0:
                    reasoning += self.buffer[:end]
                    self.buffer = self.buffer[end + len(self.fmt.close):]
                    self.state = "answer"
                    continue
                keep = _partial_suffix(self.buffer, self.fmt.close)
                reasoning += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return reasoning, answer
            # answer: drop its introduction and its end marker
            markers = [m for m in (self.fmt.answer_prefix, self.fmt.answer_suffix) if m]
            for m in markers:
                at = self.buffer.find(m)
                if at >= 0:
                    self.buffer = self.buffer[:at] + self.buffer[at + len(m):]
            keep = max((_partial_suffix(self.buffer, m) for m in markers), default=0)
            out, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
            return reasoning, answer + out

    def finish(self) -> tuple[str, str]:
        """What is left once the reply ended."""
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning" or (self.state == "start" and self.fmt.starts_inside):
            return rest, ""
        return "", rest

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"


def _partial_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` are a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


__all__ = ["FORMATS", "ReasoningFormat", "ReasoningStream", "reasoning_format", "split_reasoning"]
