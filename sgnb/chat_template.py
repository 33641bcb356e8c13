"""Role templates: how `system/user/assistant` render into program text for a completion-style backend.

A program's text grows by plain appends, so each role needs a fixed prefix and suffix. We derive them from the
model's own Jinja chat template by rendering probe conversations (so `s.messages()` and the text agree with
what the model was trained on), or take a named template for remote backends.

Tools (`sgnb.tools`): a "tool" message (a tool's result) renders as the template renders that role; a template
without one gets it as a user message holding <tool_response>...</tool_response>, as `sgnb serve` renders it. A
system message's tool descriptions are the template's own where it writes them after the system content
(derived by rendering with and without tools), else sgnb's tool prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sgnb.tools import TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN, tools_prompt

ROLES = ("system", "user", "assistant")
_MARK = "\x00SGNB-{}\x00"


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]] = field(hash=False)
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = ()
    # tools (OpenAI's shapes) -> the text the model's template writes after the system content, None when it
    # writes none there (then sgnb's tool prompt is used)
    tools_renderer: Callable[[list[dict[str, Any]]], str | None] | None = field(default=None, compare=False,
                                                                                 hash=False)
    # a template without a system role (Gemma's) writes the system content at the start of the first user turn:
    # the system prefix opens that turn, and the user message right after it takes this prefix instead of
    # the user prefix (None: no such template)
    user_prefix_after_system: str | None = None

    def prefix_and_suffix(self, role: str) -> tuple[str, str]:
        if role == "tool" and role not in self.role_prefix_and_suffix and "user" in self.role_prefix_and_suffix:
            user_prefix, user_suffix = self.role_prefix_and_suffix["user"]
            return user_prefix + TOOL_RESPONSE_OPEN + "\n", "\n" + TOOL_RESPONSE_CLOSE + user_suffix
        if role not in self.role_prefix_and_suffix:
            raise ValueError(f"role must be one of {(*self.role_prefix_and_suffix, 'tool')}, got {role!r}")
        return self.role_prefix_and_suffix[role]

    def tools_text(self, tools: list[dict[str, Any]], functions: dict[str, dict[str, Any]],
                   after_content: bool) -> str:
        """The tool descriptions a system message carries (after its content so far, if `after_content`)."""
        native = self.tools_renderer(tools) if self.tools_renderer is not None else None
        if native:
            return native if after_content else native.lstrip()
        return ("\n\n" if after_content else "") + tools_prompt(functions)


def _named(name: str, head: Callable[[str], str], suffix: str, tool_role: str, stop: str) -> ChatTemplate:
    roles = {r: (head(r), suffix) for r in ROLES}
    return ChatTemplate(name, {**roles, "tool": (head(tool_role), suffix)}, stop_str=(stop,))


PLAIN = ChatTemplate("plain", {r: ("", "") for r in (*ROLES, "tool")})
CHATML = _named("chatml", lambda r: f"<|im_start|>{r}\n", "<|im_end|>\n", "tool", "<|im_end|>")
LLAMA3 = _named("llama-3-instruct", lambda r: f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>",
                "ipython", "<|eot_id|>")

def _roles(system: tuple[str, str], user: tuple[str, str], assistant: tuple[str, str]) -> dict[str, tuple[str, str]]:
    return {"system": system, "user": user, "assistant": assistant, "tool": user}


# SGLang's chat-template names (sglang.lang.chat_template's registry) for the common formats; the role markers are
# those formats' own
_SGLANG = [
    ChatTemplate("default", _roles(("SYSTEM:", "\n"), ("USER:", "\n"), ("ASSISTANT:", "\n"))),
    ChatTemplate("claude", _roles(("", ""), ("\n\nHuman: ", ""), ("\n\nAssistant:", ""))),
    ChatTemplate("vicuna_v1.1", _roles(("", " "), ("USER:", " "), ("ASSISTANT:", "</s>")),
                 "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                 "helpful, detailed, and polite answers to the user's questions.", ("</s>",)),
    ChatTemplate("llama-2-chat", _roles(("<<SYS>>\n", "\n<</SYS>>\n\n"), ("[INST] ", " [/INST]"), ("", " </s><s>")),
                 stop_str=("</s>",)),
    ChatTemplate("mistral", _roles(("[SYSTEM_PROMPT] ", " [/SYSTEM_PROMPT]"), ("[INST] ", " [/INST]"),
                                   ("", " </s><s>")), stop_str=("</s>",)),
    ChatTemplate("gemma-it", _roles(("", ""), ("<start_of_turn>user\n", "<end_of_turn>\n"),
                                    ("<start_of_turn>model\n", "<end_of_turn>\n")), stop_str=("<end_of_turn>",)),
]
NAMED = {t.name: t for t in (PLAIN, CHATML, LLAMA3, *_SGLANG)}
# SGLang's other names for the ChatML and Llama 3 formats
NAMED |= {name: CHATML for name in ("qwen", "qwen2-vl", "chatml-llava", "yi-1.5", "dbrx-instruct")}
NAMED |= {"llama-3-instruct-llava": LLAMA3}


def named_template(name: str) -> ChatTemplate:
    """The chat template called `name` (ours or SGLang's name for it); a ValueError lists the names known."""
    if name not in NAMED:
        raise ValueError(f"unknown chat template {name!r}; known: {', '.join(sorted(NAMED))} (or leave it out to "
                         "use the template the model's tokenizer ships)")
    return NAMED[name]


def template_for_model_name(model: str) -> ChatTemplate:
    """A best guess from a model's name (for servers that do not tell their template)."""
    m = model.lower()
    if "llama-3" in m or "llama3" in m:
        return LLAMA3
    if any(k in m for k in ("smollm", "qwen", "chatml", "hermes", "yi-")):
        return CHATML
    return PLAIN


def derive_from_jinja(render: Callable[..., str], name: str = "model") -> ChatTemplate:
    """Role prefixes/suffixes from a Jinja chat template, by rendering probe conversations with markers.

    render(messages, add_generation_prompt, **variables) -> text (a render that takes no `tools` variable gets
    sgnb's tool prompt). With M0..M3 markers for system, user, assistant, user:
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
    # no user prefix between the system and the user content: both are one user turn (no system role)
    folded = "" if user_prefix and user_prefix not in s_to_u else None
    sys_prefix = four[: four.index(m[0])]
    roles = {"system": (sys_prefix, sys_suffix), "user": (user_prefix, user_suffix),
             "assistant": (asst_prefix, asst_suffix)}
    alone = render([{"role": "user", "content": m[1]}], False)
    head = alone[: alone.index(m[1])]
    head = head[: len(head) - len(user_prefix)] if head.endswith(user_prefix) else head
    default_system = None
    if head and head.startswith(sys_prefix) and head.endswith(sys_suffix):
        default_system = head[len(sys_prefix): len(head) - len(sys_suffix)]
    tool = _tool_role(render, m, asst_suffix)
    if tool is not None:
        roles["tool"] = tool
    stop = tuple(x for x in {asst_suffix.strip()} if x)
    return ChatTemplate(name, roles, default_system, stop, _tools_renderer(render, m), folded)


def _tool_role(render: Callable[..., str], m: list[str], asst_suffix: str) -> tuple[str, str] | None:
    """The "tool" role's prefix and suffix: around M3 in system, user, assistant, tool; None when the template
    renders no tool message (or refuses one)."""
    conv = [{"role": r, "content": c} for r, c in zip(("system", "user", "assistant", "tool"), m)]
    try:
        text = render(conv, False)
    except Exception:
        return None
    if m[3] not in text or m[2] not in text:
        return None
    between = text[text.index(m[2]) + len(m[2]): text.index(m[3])]
    prefix = between[len(asst_suffix):] if between.startswith(asst_suffix) else between
    return prefix, text[text.index(m[3]) + len(m[3]):]


def _tools_renderer(render: Callable[..., str], m: list[str]) -> Callable[[list[dict[str, Any]]], str | None]:
    """tools -> what the template writes between the system content and the end of the system message (Qwen's
    "# Tools" block), or None when it writes them elsewhere or not at all."""
    conv = [{"role": "system", "content": m[0]}, {"role": "user", "content": m[1]}]

    def text(tools: list[dict[str, Any]]) -> str | None:
        try:
            plain, with_tools = render(conv, False), render(conv, False, tools=tools)
        except Exception:  # a render without `tools`, or a template that rejects these
            return None
        if m[0] not in with_tools or plain[: plain.index(m[0])] != with_tools[: with_tools.index(m[0])]:
            return None
        after_plain = plain[plain.index(m[0]) + len(m[0]):]
        after_tools = with_tools[with_tools.index(m[0]) + len(m[0]):]
        if not after_tools.endswith(after_plain) or len(after_tools) == len(after_plain):
            return None
        return after_tools[: len(after_tools) - len(after_plain)]

    return text
