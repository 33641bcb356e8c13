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

from sgnb.interpreter import ProgramError
from sgnb.kernel_ext import display as show
from sgnb.kernel_ext.interrupt import InterruptibleBackend
from sgnb.kernel_ext.session import KernelSession
from sgnb.notebook import CellNamespace, cell_function, compile_cell, run_definitions

DEFAULT_OUTPUT = "_sgl"
_WHERE = re.compile(r"\A(.*?):(\d+)(?::|\Z)")


@magics_class
class ProgramMagics(Magics):
    def __init__(self, shell: Any, session: KernelSession) -> None:
        super().__init__(shell)
        self.session = session

    @magic_arguments(name="%sgl")
    @argument("-o", "--output", metavar="NAME", default=DEFAULT_OUTPUT,
              help=f"store the program's final state in NAME (default: {DEFAULT_OUTPUT})")
    @argument("--temperature", type=float, default=None, metavar="T", help="default temperature of the gens")
    @argument("--max-tokens", type=int, default=None, metavar="N",
              help="default max_tokens of the gens (else run()'s default, 128)")
    @argument("--backend", default=None, metavar="SPEC",
              help="this cell's backend: URL, openai:MODEL, anthropic:MODEL or a variable holding a backend "
                   "(default: the current one, see %%sgl)")
    @argument("--no-widget", action="store_true", help="no live view; print the program's text at the end")
    @argument("--stream", action="store_true", help="stream gens token by token (printed as they come without "
                                                    "a widget)")
    @no_var_expand
    @cell_magic
    def sgl(self, line: str, cell: str) -> Any:
        """Run the cell as an LM program: its body is a program function's body with the state bound to `s`.

        Every primitive is there without an import (gen, select, gen_int, gen_string, image, video, system,
        user, assistant, the *_begin/*_end roles, separate_reasoning, function, and `sgl` for the package),
        next to the notebook's own names: the cell reads and assigns user variables as a normal cell does.
        The final state lands in `_sgl` (or `-o NAME`): `_sgl["answer"]`, `_sgl.messages()`, ...

            %%sgl --temperature 0
            s += system("You are terse.")
            s += user(question)
            s += assistant(gen("answer", max_tokens=64, stop="\\n"))
            answer = s["answer"]

        A final bare expression is the cell's value (Out[n]), as in any cell. A cell that never uses `s` at its
        top level just runs (with the primitives in scope): that is how a cell defines `@function` programs
        for later cells. Errors point at the cell's line; interrupting the kernel aborts the cell's requests
        (forks included) and leaves the engine ready for the next cell.
        """
        __tracebackhide__ = True  # noqa: F841 (IPython hides this frame in tracebacks)
        try:
            args = self.sgl.parser.parse_args(shlex.split(line))
        except ValueError as e:
            raise UsageError(f"%%sgl: {e}") from None
        if not args.output.isidentifier():
            raise UsageError(f"%%sgl -o takes a variable name, got {args.output!r}")
        filename = self.session.cell_filename()
        code = compile_cell(cell, filename)
        namespace = CellNamespace(self.shell.user_ns)
        if not code.is_program:
            return run_definitions(code, namespace)
        backend = self.session.backend_for(args.backend) if args.backend else self.session.backend()
        guard = InterruptibleBackend(backend)
        sampling = {k: v for k, v in (("temperature", args.temperature), ("max_new_tokens", args.max_tokens))
                    if v is not None}
        title = f"%%sgl [{self.session.cell_number()}]"
        view = show.live_view("ProgramView", title=title) if self.session.widgets() and not args.no_widget else None
        streamed = False
        try:
            try:
                fn = cell_function(code, namespace, title)
                state = fn.run(backend=guard, stream=args.stream, subscribers=[view.on_event] if view else None,
                               **sampling)
            finally:
                namespace.commit()
            self.shell.user_ns[args.output] = state
            if args.stream and view is None:
                _print_stream(state)
                streamed = True
            state.error()  # waits for the program to finish
        except KeyboardInterrupt:
            clean = guard.interrupt()
            late = "" if clean else " (some did not stop in time)"
            sys.stdout.flush()
            print(f"\nsgnb: interrupted; the cell's requests were aborted{late}", file=sys.stderr)
            raise
        finally:
            if view is not None:
                view.flush()
        error = state.executor.error_
        if error is not None:
            _raise_in_cell(error, state.executor.error_where, filename)
        if view is None:
            display(show.variables_summary(state) if streamed else show.transcript(state))
        return state.ret_value


def _print_stream(state: Any) -> None:
    try:
        for chunk in state.text_iter():
            sys.stdout.write(chunk)
            sys.stdout.flush()
    except ProgramError:
        pass  # reported with its line once the program is done
    sys.stdout.write("\n")


def _raise_in_cell(error: BaseException, where: str | None, filename: str) -> None:
    """Raise the program's error so the traceback ends at the program line that caused it: a Python error in
    the body keeps its own frames from the cell down; a failed primitive (run on the program's thread) is
    raised as a ProgramError from a frame at the line that appended it."""
    __tracebackhide__ = True  # noqa: F841
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    if tb is not None:
        raise error.with_traceback(tb)
    message = f"{type(error).__name__}: {error}"
    m = _WHERE.match(where or "")
    if m is None:
        raise ProgramError(message) from None
    # a frame "at" the program line: its code sits at that line number under that file name, so the
    # traceback shows the line (IPython reads it from linecache, where the cell is registered)
    code = compile("\n" * (int(m.group(2)) - 1) + "raise __error__ from None", m.group(1), "exec")
    exec(code, {"__error__": ProgramError(message)})
