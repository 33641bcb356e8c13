"""Roles, media, var scopes and reasoning, the nodes that shape the text (a mixin of StreamExecutor): a role's
begin and end and the message it makes (its text less what is not content, its tool calls or the call it
answers), images and videos, var scopes, separate_reasoning.

Contract: as every node handler, these run only from `StreamExecutor._execute`, on the pool thread draining the
state's queue, in node order; they change the state only through its own methods (`_append` for text,
`_set_var` for variables, `emit` for views' events) and its role, media and scope fields; an exception fails
the program at the node's line. No model is called here.

Images and videos: `sgl.image(x)` / `sgl.video(path)` append the backend's image (video) token to the text and
record the item (a `sgnb.media.Media`) in order; every later gen/select of the state, its forks and copies gets
them. The event is `{"type": "image" | "video", "index": n (0-based over the state's media), "text": the token
appended, "source": a short label (path, URL or what the value is), "path": the same (older views read it),
"thumbnail": a PNG data: URL <= 96 px or None (an http(s) URL is not fetched)}`, a video's also with "frames" (a
few frame thumbnails) and "num_frames". The "text" events plus these tokens make up the state's text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sgnb import ir
from sgnb.media import Media, describe, thumbnail, video_frames
from sgnb.program_events import MediaEvent, ReasoningEvent, RoleEvent
from sgnb.reasoning import ReasoningFormat, reasoning_format, split_reasoning

if TYPE_CHECKING:
    from sgnb.interpreter import StreamExecutor


class RoleHandlers:
    """StreamExecutor's role, image, video, var scope and separate_reasoning nodes."""

    # StreamExecutor's fields these handlers assign (it sets them up in __init__; their meaning is there)
    text_: str
    cur_role: str | None
    cur_role_begin: int
    role_hidden: list[tuple[int, int]]
    role_calls: list[dict[str, Any]]
    role_answers: str | None
    unanswered: list[str]

    def _role_begin(self: StreamExecutor, node: ir.RoleBegin) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role {node.role!r} begins inside the open role {self.cur_role!r}: end it first")
        tmpl = self.chat_template
        if (node.role == "user" and tmpl.default_system_prompt and not self.messages_
                and not self.text_.strip()):
            self._role_begin(ir.RoleBegin("system"))
            self._append(tmpl.default_system_prompt)
            self._role_end(ir.RoleEnd("system"))
        prefix, _ = tmpl.prefix_and_suffix(node.role)
        if (node.role == "user" and tmpl.user_prefix_after_system is not None and self.messages_
                and self.messages_[-1]["role"] == "system"):
            prefix = tmpl.user_prefix_after_system  # the system content opened this user turn
        self._append(prefix)
        self.cur_role, self.cur_role_begin = node.role, len(self.text_)
        self.role_hidden, self.role_calls, self.role_answers = [], [], None
        if node.role == "tool":  # the call it answers: the one named, else the next unanswered one
            answers = node.tool_call_id
            if answers is None and self.unanswered:
                answers = self.unanswered[0]
            if answers in self.unanswered:
                self.unanswered.remove(answers)
            self.role_answers = answers
        self.emit(RoleEvent(program=self.id, parent=self.parent_id, type="role_begin", role=node.role))

    def _role_end(self: StreamExecutor, node: ir.RoleEnd) -> None:
        if self.cur_role != node.role:
            raise ValueError(f"role {node.role!r} ends but the open role is {self.cur_role!r}")
        message = self._role_message()
        self.messages_.append(message)
        if node.role == "assistant":
            self.unanswered = [c["id"] for c in self.role_calls]
        _, suffix = self.chat_template.prefix_and_suffix(node.role)
        self.cur_role = None
        self._append(suffix)
        self.emit(RoleEvent(program=self.id, parent=self.parent_id, type="role_end", role=node.role))

    def _role_message(self: StreamExecutor) -> dict[str, Any]:
        """The open role's message: its text less what is not content, with its tool calls (an assistant's)
        or the call it answers (a tool's)."""
        parts, pos = [], self.cur_role_begin
        for start, end in self.role_hidden:
            parts.append(self.text_[pos:start])
            pos = end
        parts.append(self.text_[pos:])
        message: dict[str, Any] = {"role": self.cur_role, "content": "".join(parts)}
        if self.role_calls:
            message["tool_calls"] = list(self.role_calls)
        if self.role_answers is not None:
            message["tool_call_id"] = self.role_answers
        return message

    def _image(self: StreamExecutor, node: ir.Image) -> None:
        media = Media("image", node.path)
        token = self.backend.media_token(media)  # a backend that takes no images fails here, at the line
        self._add_media(media, token, thumbnail(media))  # reads the image: unreadable fails here

    def _video(self: StreamExecutor, node: ir.Video) -> None:
        media = Media("video", node.path, node.num_frames)
        token = self.backend.media_token(media)
        frames = video_frames(media)
        self._add_media(media, token, frames[0] if frames else None, (frames, node.num_frames))

    def _add_media(self: StreamExecutor, media: Media, token: str, thumb: str | None,
                   video: tuple[list[str], int] | None = None) -> None:
        """`media` joins the state as `token`; views get its thumbnail (a video's also its frames and count)."""
        self.images_.append(media)
        self.text_ += token
        with self.chunks_cond:
            self.chunks.append((None, token, None))
            self.chunks_cond.notify_all()
        label = describe(media)
        event = MediaEvent(program=self.id, parent=self.parent_id, type="video" if media.kind == "video" else "image",
                           index=len(self.images_) - 1, text=token, source=label, path=label, thumbnail=thumb)
        if video is not None:
            event["frames"], event["num_frames"] = video
        self.emit(event)

    def _var_scope_begin(self: StreamExecutor, node: ir.VarScopeBegin) -> None:
        self.var_scopes[node.name] = len(self.text_)

    def _var_scope_end(self: StreamExecutor, node: ir.VarScopeEnd) -> None:
        start = self.var_scopes.pop(node.name)
        self._set_var(node.name, self.text_[start:])

    def _separate_reasoning(self: StreamExecutor, node: ir.SeparateReasoning) -> None:
        """Each named gen's reply split into answer and reasoning; the reasoning also leaves the text and the
        messages (the reply's last occurrence in them, which is where the gen wrote it)."""
        fmt = self._reasoning_format(node)
        for name in node.names:
            value = self.variables.get(name)
            if not isinstance(value, str):
                raise ValueError(f"separate_reasoning: {name!r} has no text to split")
            reasoning, answer = split_reasoning(value, fmt)
            if answer != value:
                at = self.text_.rfind(value)
                if at >= 0:
                    self.text_ = self.text_[:at] + answer + self.text_[at + len(value):]
                for k in range(len(self.messages_) - 1, -1, -1):  # a new dict: forks share the old ones
                    content = self.messages_[k].get("content")
                    if isinstance(content, str) and value in content:
                        i = content.rfind(value)
                        self.messages_[k] = {**self.messages_[k],
                                             "content": content[:i] + answer + content[i + len(value):]}
                        break
                self._set_var(name, answer)
            self.emit(ReasoningEvent(program=self.id, parent=self.parent_id, type="reasoning", var=name,
                                     reasoning=reasoning, answer=answer))
            self._set_var(f"{name}_reasoning_content", reasoning)

    def _reasoning_format(self: StreamExecutor, node: ir.SeparateReasoning) -> ReasoningFormat:
        return reasoning_format(node.model_type or getattr(self.backend, "reasoning_parser", None))
