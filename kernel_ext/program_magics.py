"""`%%sgl`: a cell as an LM program, run on the current backend with a live view."""

from __future__ import annotations

import re
import shlex
import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from sgnb.cell import CellNamespace, cell_function, compile_cell, run_definitions
from sgnb.interpreter import ProgramError, show_user_traceback
from sgnb.kernel_ext import display as show
from sgnb.kernel_ext.interrupt import InterruptibleBackend
from sgnb.kernel_ext.session import KernelSession
from sgnb.state import ProgramState
from sgnb.user_code import frame_at

DEFAULT_OUTPUT = "_sgl"
LOGPROBS_TOP = 5  # top alternatives per token that `%%sgl --logprobs` asks for


@magics_class
class ProgramMagics(Magics):
    def __init__(self, shell: Any, session: KernelSession) -> None:
        super().__init__(shell)
        self.session = session

    @property
    def _user_ns(self) -> dict[str, Any]:
        assert self.shell is not None  # registered with its shell
        return self.shell.user_ns

    @magic_arguments(name="%sgl")
    @argument("-o", "--output", metavar="NAME", default=None,
              help=f"store the program's final state in NAME (default: {DEFAULT_OUTPUT}, or the -i NAME)")
    @argument("-i", "--input", metavar="NAME", default=None,
              help="run the cell on the program state in NAME (a chat from an earlier cell): `s` is that state, "
                   "which goes on from its text, messages and variables (its prefix is cached)")
    @argument("--temperature", type=float, default=None, metavar="T", help="default temperature of the gens")
    @argument("--max-tokens", type=int, default=None, metavar="N",
              help="default max_tokens of the gens (else run()'s default, 128)")
    @argument("--logprobs", nargs="?", type=int, const=LOGPROBS_TOP, default=None, metavar="K",
              help=f"ask every gen for its tokens' logprobs and top K alternatives (K default {LOGPROBS_TOP}): "
                   "the view shows them when you hover a token")
    @argument("--backend", default=None, metavar="SPEC",
              help="this cell's backend: URL, openai:MODEL, anthropic:MODEL or a variable holding a backend "
                   "(default: the current one, see %%sgl)")
    @argument("--no-widget", action="store_true", help="no live view; print the program's text at the end")
    @argument("--stream", action="store_true", help="stream gens token by token (the default with the view; "
                                                    "with --no-widget, print the text as it comes)")
    @argument("--no-stream", action="store_true", help="the view shows each gen when it ends, not token by token")
    @no_var_expand
    @cell_magic
    def sgl(self, line: str, cell: str) -> Any:
        """Run the cell as an LM program: its body is a program function's body with the state bound to `s`.

        Every primitive is there without an import (gen, select, gen_int, gen_string, image, video, system,
        user, assistant, tool, the *_begin/*_end roles, separate_reasoning, function, and `sgl` for the
        package), next to the notebook's own names: the cell reads and assigns user variables as a normal cell
        does.
        The final state lands in `_sgl` (or `-o NAME`): `_sgl["answer"]`, `_sgl.messages()`, ...

            %%sgl --temperature 0 -o chat
            s += system("You are terse.")
            s += user(question)
            s += assistant(gen("answer", max_tokens=64, stop="\\n"))
            answer = s["answer"]

        A conversation goes on in a later cell with `%%sgl -i chat` (the body's `s` is `chat`, continued from
        its text, messages and variables; the engine's cache holds that prefix), or in plain Python with
        `chat += user("..."); chat += assistant(gen("a2"))`.

        A final bare expression is the cell's value (Out[n]), as in any cell. A cell that never uses `s` at its
        top level just runs (with the primitives in scope): that is how a cell defines `@function` programs
        for later cells. Errors show one short traceback ending at the cell's line; interrupting the kernel
        aborts the cell's requests (forks included) and leaves the engine ready for the next cell.
        """
        __tracebackhide__ = True  # noqa: F841 (IPython hides this frame in tracebacks)
        here = sys._getframe()  # tracebacks start below this frame: the user sees their cell, not the magic
        try:
            args = self.sgl.parser.parse_args(shlex.split(line, comments=True))  # a trailing "# ..." is a comment
        except ValueError as e:
            raise UsageError(f"%%sgl: {e}") from None
        output = args.output or args.input or DEFAULT_OUTPUT
        for name in (output, args.input):
            if name is not None and not name.isidentifier():
                raise UsageError(f"%%sgl -o / -i take a variable name, got {name!r}")
        target = None
        if args.input is not None:
            target = self._user_ns.get(args.input)
            if not isinstance(target, ProgramState):
                what = "not defined" if target is None else f"a {type(target).__name__}"
                raise UsageError(f"%%sgl -i {args.input}: {args.input} is {what}, not a program state (what a "
                                 "%%sgl -o NAME cell or fn.run() made)")
        filename = self.session.cell_filename()
        try:
            code = compile_cell(cell, filename)
        except SyntaxError as e:  # a cell that ran as `%%sgl` does not get here (CellSyntaxCheck reported it)
            raise e.with_traceback(None)  # noqa: B904
        namespace = CellNamespace(self._user_ns)
        if not code.is_program:
            if target is not None:
                raise UsageError(f"%%sgl -i {args.input}: the cell never uses `s`, the state it would continue")
            try:
                return run_definitions(code, namespace)
            except BaseException as e:  # shown from the cell's frame down (an interrupt too)
                show_user_traceback(e, below=here)
                raise
        backend = self.session.backend_for(args.backend) if args.backend else self.session.backend()
        guard = InterruptibleBackend(backend)
        sampling = {k: v for k, v in (("temperature", args.temperature), ("max_new_tokens", args.max_tokens))
                    if v is not None}
        if args.logprobs is not None:
            if args.logprobs < 0:
                raise UsageError(f"%%sgl --logprobs takes a number of alternatives >= 0, got {args.logprobs}")
            sampling.update(return_logprob=True, top_logprobs_num=args.logprobs, return_text_in_logprobs=True)
        if args.stream and args.no_stream:
            raise UsageError("%%sgl: --stream and --no-stream contradict each other")
        title = f"%%sgl [{self.session.cell_number()}]"
        view = show.live_view("ProgramView", title=title) if self.session.widgets() and not args.no_widget else None
        subscribers = [view.on_event] if view else None
        if view is not None:
            view.errors_below = True  # the cell's traceback follows the view
        stream = not args.no_stream if view is not None else args.stream  # a view streams by default
        streamed = False
        state = None
        try:
            try:
                fn = cell_function(code, namespace, title)
                if target is not None:
                    try:
                        state = fn.run_on(target, backend=guard, stream=stream, subscribers=subscribers,
                                          sampling=sampling)
                    except ProgramError as e:  # the state cannot continue (its program failed or was interrupted)
                        if view is not None:  # nothing ran: no view of it
                            show.discard_view(view)
                            view = None
                        raise UsageError(f"%%sgl -i {args.input}: {e}") from None
                else:
                    state = fn.run(backend=guard, stream=stream, subscribers=subscribers, **sampling)
            finally:
                namespace.commit()
            self._user_ns[output] = state
            if args.stream and view is None:
                _print_stream(state)
                streamed = True
            state.error()  # waits for the program to finish
            _wait_for_branches(state.executor)  # copies and forks that were never joined, too
        except KeyboardInterrupt as e:
            state = state or getattr(e, "program_state", None)  # interrupted in the body: run() kept the state
            if state is not None:  # first: the states read "interrupted", not the failure of an aborted request
                self._user_ns[output] = state
                state.executor.abort_all()
            clean = guard.interrupt()
            if state is not None:  # the programs record what their aborted gens wrote (the view shows it)
                for exe in (state.executor, *state.executor.descendants()):
                    exe.drained(timeout=5)
            late = "" if clean else " (some did not stop in time)"
            sys.stdout.flush()
            interrupted = KeyboardInterrupt(f"interrupted: the cell's requests were aborted{late}")
            tb = e.__traceback__
            if not _reaches(tb, filename) and state is not None:  # it waited in the magic: show the running line
                tb = frame_at(state.executor.current_line) or tb
            raise show_user_traceback(interrupted, below=here).with_traceback(tb) from None
        finally:
            if view is not None:
                view.flush()
                show.refresh_view(view)  # the output's static snapshot: the finished program, not the empty view
        failure = state.executor.failure
        if failure is not None:
            _raise_in_cell(failure.error, failure.where, filename, here)
        if view is None:
            display(show.variables_summary(state) if streamed else show.transcript(state))
        return state.ret_value


_SGL_CELL = re.compile(r"%%sgl(?:\s|$)")


class CellSyntaxCheck:
    """An IPython input transformer (`shell.input_transformers_cleanup`): compiles the body of a `%%sgl` cell before
    the cell runs and lets its SyntaxError out there, which IPython shows as it shows one in a plain cell: the
    cell's line and a caret, no frames. (Raised by the magic, the same error would come with the frames of IPython
    and the extension that ran it: IPython never trims a SyntaxError's stack.) Lines pass through unchanged.

    The error names the cell `<sgl-cell-N>` for `In [N]`, as the magic does (IPython counts the cell after
    transforming it: `execution_count` is still N here). Nothing is reserved: ipykernel transforms each cell
    twice, and the magic compiles the body again under the same name."""

    has_side_effects = True  # IPython's completeness check (`check_complete`) leaves it out: it must not raise

    def __init__(self, shell: Any, session: KernelSession) -> None:
        self.shell = shell
        self.session = session

    def __call__(self, lines: list[str]) -> list[str]:
        if lines and _SGL_CELL.match(lines[0]):
            compile_cell("".join(lines[1:]), self.session.cell_filename(self.shell.execution_count, reserve=False))
        return lines


def _print_stream(state: Any) -> None:
    try:
        for chunk in state.text_iter():
            sys.stdout.write(chunk)
            sys.stdout.flush()
    except ProgramError:
        pass  # reported with its line once the program is done
    sys.stdout.write("\n")


def _reaches(tb: Any, filename: str) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            return True
        tb = tb.tb_next
    return False


def _wait_for_branches(exe: Any) -> None:
    for child in exe.descendants():
        child.wait(child.drained, "sync")


def _raise_in_cell(error: BaseException, where: str | None, filename: str, below: Any) -> None:
    """Raise the program's error so the traceback ends at the program line that caused it: a Python error in
    the body keeps its own frames from the cell down (sgnb's left out when shown); a failed primitive (run on
    the program's thread) is raised as a ProgramError from a frame at the line that appended it."""
    __tracebackhide__ = True  # noqa: F841
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    if tb is not None:
        raise show_user_traceback(error, below=below).with_traceback(tb)
    message = str(error) if isinstance(error, ProgramError) else f"{type(error).__name__}: {error}"
    shown = show_user_traceback(ProgramError(message, where), below=below)
    raise shown.with_traceback(frame_at(where)) from None
