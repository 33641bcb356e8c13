"""Role templates: how `system/user/assistant` render into program text for a completion-style backend.

A program's text grows by plain appends, so each role needs a fixed prefix and suffix. We derive them from the
model's own Jinja chat template by rendering probe conversations (so `s.messages()` and the text agree with
what the model was trained on), or take a named template for remote backends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")
_MARK = "\x00SGNB-{}\x00"


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]] = field(hash=False)
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = ()

    def prefix_and_suffix(self, role: str) -> tuple[str, str]:
        if role not in self.role_prefix_and_suffix:
            raise ValueError(f"role must be one of {tuple(self.role_prefix_and_suffix)}, got {role!r}")
        return self.role_prefix_and_suffix[role]


PLAIN = ChatTemplate("plain", {r: ("", "") for r in ROLES})
CHATML = ChatTemplate("chatml", {r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ROLES}, stop_str=("<|im_end|>",))
LLAMA3 = ChatTemplate("llama-3-instruct",
                      {r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>") for r in ROLES},
                      stop_str=("<|eot_id|>",))
NAMED = {t.name: t for t in (PLAIN, CHATML, LLAMA3)}


def template_for_model_name(model: str) -> ChatTemplate:
    """A best guess from a model's name (for servers that do not tell their template)."""
    m = model.lower()
    if "llama-3" in m or "llama3" in m:
        return LLAMA3
    if any(k in m for k in ("smollm", "qwen", "chatml", "hermes", "yi-")):
        return CHATML
    return PLAIN


def derive_from_jinja(render: Callable[[list[dict], bool], str], name: str = "model") -> ChatTemplate:
    """Role prefixes/suffixes from a Jinja chat template, by rendering probe conversations with markers.

    render(messages, add_generation_prompt) -> text. With M0..M3 markers for system, user, assistant, user:
    the generation prompt is the assistant prefix; text after the assistant's content is its suffix; the text
    between the assistant's and the next user's content is suffix(assistant) + prefix(user); and so on.
    The default system prompt is what the template writes when a conversation has no system message.
    """
    m = [_MARK.format(i) for i in range(4)]
    conv = [{"role": r, "content": c} for r, c in zip(("system", "user", "assistant", "user"), m)]
    two = render(conv[:2], False)
    asst_prefix = render(conv[:2], True)[len(two):]
    three = render(conv[:3], False)
    four = render(conv, False)

    def between(text: str, a: str, b: str) -> str:
        i = text.index(a) + len(a)
        return text[i: text.index(b, i)]

    asst_suffix = three[three.index(m[2]) + len(m[2]):]
    a_to_u = between(four, m[2], m[3])
    user_prefix = a_to_u[len(asst_suffix):] if a_to_u.startswith(asst_suffix) else a_to_u
    u_to_a = between(four, m[1], m[2])
    user_suffix = u_to_a[: len(u_to_a) - len(asst_prefix)] if asst_prefix and u_to_a.endswith(asst_prefix) else u_to_a
    s_to_u = between(four, m[0], m[1])
    sys_suffix = s_to_u[: len(s_to_u) - len(user_prefix)] if user_prefix and s_to_u.endswith(user_prefix) else s_to_u
    sys_prefix = four[: four.index(m[0])]
    roles = {"system": (sys_prefix, sys_suffix), "user": (user_prefix, user_suffix),
             "assistant": (asst_prefix, asst_suffix)}
    alone = render([{"role": "user", "content": m[1]}], False)
    head = alone[: alone.index(m[1])]
    head = head[: len(head) - len(user_prefix)] if head.endswith(user_prefix) else head
    default_system = None
    if head and head.startswith(sys_prefix) and head.endswith(sys_suffix):
        default_system = head[len(sys_prefix): len(head) - len(sys_suffix)]
    stop = tuple(x for x in {asst_suffix.strip()} if x)
    return ChatTemplate(name, roles, default_system, stop)
