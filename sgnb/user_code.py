"""Where the user is: the program line that submitted a primitive ("file:line: statement", a statement over
several lines shown whole), and tracebacks cut to the user's own frames (what IPython shows for a user error).

Frames are sgnb's (modules named sgnb.*), the user's (a cell, a script, their own module) or other (the standard
library, installed packages); a traceback keeps the user's frames and what their lines called, never sgnb's
internals. No IPython import except in `render_traceback`, which only IPython calls.
"""

from __future__ import annotations

import ast
import io
import linecache
import os
import re
import sys
import tokenize
import types


def _is_library(frame: types.FrameType) -> bool:
    """sgnb's own code (the language, engine, kernels, extension, widgets): its modules are named sgnb.*."""
    name = frame.f_globals.get("__name__")
    return isinstance(name, str) and (name == "sgnb" or name.startswith("sgnb."))


def _installed_dirs() -> tuple[str, ...]:
    import sysconfig

    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    paths.update(v for k, v in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib", "platlib"))
    return tuple(os.path.join(os.path.realpath(p), "") for p in paths if p)


_INSTALLED: tuple[str, ...] | None = None
_FILE_KINDS: dict[str, str] = {}


def frame_kind(frame: types.FrameType) -> str:
    """"sgnb" (our code), "user" (a cell, a script, a module of the user's) or "other" (the standard library,
    an installed package)."""
    global _INSTALLED
    if _is_library(frame):
        return "sgnb"
    filename = frame.f_code.co_filename
    kind = _FILE_KINDS.get(filename)
    if kind is None:
        if filename.startswith("<"):  # a cell (<sgl-cell-N>, <ipython-input-...>) or other source-less code
            kind = "user"
        else:
            if _INSTALLED is None:
                _INSTALLED = _installed_dirs()
            kind = "other" if os.path.realpath(filename).startswith(_INSTALLED) else "user"
        _FILE_KINDS[filename] = kind
    return kind


def user_traceback(tb: types.TracebackType | None,
                   below: types.FrameType | None = None) -> types.TracebackType | None:
    """The user's part of a traceback: from their first frame on, without sgnb's frames, and without what ran
    below an sgnb frame (the library's internals, the standard library it called) unless it is the user's code
    again (a program body sgnb called). So an error raised inside `gen()` ends at the user's `gen()` line. With
    `below`, the frames down to that one (e.g. the magic that ran the cell) are left out first. None when no
    frame is the user's."""
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    if below is not None:
        at = next((i for i, e in enumerate(entries) if e.tb_frame is below), None)
        if at is not None:
            entries = entries[at + 1:]
    kept, context = [], None
    for e in entries:
        kind = frame_kind(e.tb_frame)
        if kind == "user":
            kept.append(e)
            context = "user"
        elif kind == "sgnb":
            context = "sgnb" if context is not None else None
        elif context == "user":  # a library the user's line called (json.loads(...)): shown, as Python does
            kept.append(e)
    new = None
    for e in reversed(kept):
        new = types.TracebackType(new, e.tb_frame, e.tb_lasti, e.tb_lineno)
    return new


def _chain(first: types.TracebackType | None, second: types.TracebackType | None) -> types.TracebackType | None:
    """`first`'s frames, then `second`'s (a line both end and start at is shown once)."""
    entries: list[types.TracebackType] = []
    for tb in (first, second):
        while tb is not None:
            if not (entries and _same_line(entries[-1], tb)):
                entries.append(tb)
            tb = tb.tb_next
    new = None
    for e in reversed(entries):
        new = types.TracebackType(new, e.tb_frame, e.tb_lasti, e.tb_lineno)
    return new


def _same_line(a: types.TracebackType, b: types.TracebackType) -> bool:
    return a.tb_lineno == b.tb_lineno and a.tb_frame.f_code.co_filename == b.tb_frame.f_code.co_filename


_WHERE = re.compile(r"\A(.*?):(\d+)(?::|\Z)")


class _Here(Exception):
    pass


def frame_at(where: str | None) -> types.TracebackType | None:
    """A one-frame traceback at a program line ("file:line: ..."), for an error that happened on a program's
    thread: the frame's code sits at that line of that file, so a traceback shows the line (read from
    linecache, where a cell's source is registered). None when the line cannot be shown."""
    m = _WHERE.match(where or "")
    if m is None or not linecache.getline(m.group(1), int(m.group(2))):
        return None
    code = compile("\n" * (int(m.group(2)) - 1) + "raise __here__", m.group(1), "exec")
    try:
        exec(code, {"__here__": _Here, "__name__": "__main__"})
    except _Here as e:
        tb = e.__traceback__
        return tb.tb_next if tb is not None else None
    return None


def render_traceback(exc: BaseException, tb: types.TracebackType | None, chain: bool = False) -> list[str]:
    """How IPython shows `exc` over the traceback `tb` (the lines of `_render_traceback_`); chained exceptions
    are left out unless `chain`. Imports IPython, so only IPython calls it."""
    import traceback

    saved = exc.__cause__, exc.__context__, exc.__suppress_context__
    if not chain:
        exc.__cause__, exc.__context__, exc.__suppress_context__ = None, None, True
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None:
            return traceback.format_exception(type(exc), exc, tb)
        return shell.InteractiveTB.structured_traceback(type(exc), exc, tb, tb_offset=0)
    finally:
        exc.__cause__, exc.__context__, exc.__suppress_context__ = saved


def user_frame(depth: int = 1) -> types.FrameType | None:
    """The innermost frame of the caller's stack that is not sgnb's: where the user wrote the call."""
    frame: types.FrameType | None = sys._getframe(depth + 1)
    while frame is not None and _is_library(frame):
        frame = frame.f_back
    return frame


def user_location() -> str | None:
    """Where the user wrote the primitive: "file:line: statement" of the innermost frame outside sgnb (a
    statement over several lines is named by its first line and shown whole, on one line)."""
    frame = user_frame(1)
    if frame is None:
        return None
    return location(frame.f_code.co_filename, frame.f_lineno or frame.f_code.co_firstlineno)


def location(filename: str, lineno: int) -> str:
    start, end = statement_lines(filename, lineno)
    text = statement_text(filename, start, end)
    return f"{filename}:{start}: {text}" if text else f"{filename}:{start}"


_SPANS: dict[str, tuple[list[str], dict[int, tuple[int, int]]]] = {}
_MAX_STATEMENT = 160


def statement_lines(filename: str, lineno: int) -> tuple[int, int]:
    """The first and last line of the statement at `lineno` (of a compound statement, its header)."""
    lines = linecache.getlines(filename)
    if not lines:
        return lineno, lineno
    cached = _SPANS.get(filename)
    if cached is None or cached[0] is not lines:  # parsed once per version of the source
        cached = _SPANS[filename] = (lines, _multi_line_statements("".join(lines)))
    return cached[1].get(lineno, (lineno, lineno))


def _multi_line_statements(source: str) -> dict[int, tuple[int, int]]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return {}
    spans: dict[int, tuple[int, int]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt):
            continue
        start, end = node.lineno, node.end_lineno or node.lineno
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.stmt):  # a header: up to its body
            end = max(start, body[0].lineno - 1)
        if end > start:
            for line in range(start, end + 1):
                if line not in spans or spans[line][1] - spans[line][0] > end - start:
                    spans[line] = (start, end)
    return spans


def statement_text(filename: str, start: int, end: int) -> str:
    """Lines `start`..`end` as one line: comments dropped, line breaks collapsed, trimmed in the middle."""
    lines = [linecache.getline(filename, n) for n in range(start, end + 1)]
    if end == start:
        text = lines[0].strip()
    else:
        text = _one_line(lines)
    if len(text) > _MAX_STATEMENT:
        keep = _MAX_STATEMENT - 5
        text = text[: keep * 2 // 3].rstrip() + " ... " + text[-(keep - keep * 2 // 3):].lstrip()
    return text


_OPEN, _CLOSE = {"(", "[", "{"}, {")", "]", "}"}


def _one_line(lines: list[str]) -> str:
    source = lines[0].lstrip() + "".join(lines[1:])
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    out: list[str] = []
    prev = None
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type in skip:
                continue
            if prev is not None:
                if tok.start[0] == prev.end[0]:
                    out.append(" " if tok.start[1] > prev.end[1] else "")
                elif prev.string not in _OPEN and tok.string not in _CLOSE:
                    out.append(" ")
            out.append(tok.string.replace("\n", "\\n"))
            prev = tok
    except (tokenize.TokenError, SyntaxError):
        return " ".join(line.strip() for line in lines if line.strip())
    return "".join(out)
