"""sgnb.kernel_ext: the IPython extension. `%load_ext sgnb` (or `%load_ext sgnb.kernel_ext`) registers

- `%sgl`: the kernel's engine and backend: `model`, `backend`, `tree`, `stats`, `flush`, `serve`, `status`;
- `%%sgl`: a cell as an LM program on the current backend, with a live view (and an input transformer that
  reports a SyntaxError in its body before it runs, as IPython reports one in a plain cell);
- Tab completion of `%sgl` lines (subcommands, options, model aliases) and, for the kernel's completer and
  inspector, the language's names in the user namespace where they are free (`gen`, `select`, `user`, ...,
  `function`, `sgl`; hidden from `%who`), so `gen(max_t` + Tab completes `max_tokens=` and `gen(` + Shift-Tab
  shows gen's signature in any cell.

The magics are thin: they parse their line and call sgnb's public API (`sgnb.Runtime`, `set_default_backend`,
`SglFunction.run`, `sgnb.cell`) and the views of `sgnb.widgets`. Loading the extension imports no torch;
`%sgl model` does. If SGNB_BACKEND is set (`sgnb run --backend`), that backend becomes the default.
"""

from __future__ import annotations

from typing import Any

_SESSION_ATTR = "_sgnb_session"
_UNDO_ATTR = "_sgnb_unload"  # what unloading undoes: the completer, the names put in the user namespace


def load_ipython_extension(ip: Any) -> None:
    from sgnb.kernel_ext.engine_magics import EngineMagics, register_completion
    from sgnb.kernel_ext.program_magics import CellSyntaxCheck, ProgramMagics
    from sgnb.kernel_ext.session import KernelSession

    if getattr(ip, _SESSION_ATTR, None) is not None:
        return  # already loaded: keep the engine and views
    session = KernelSession(ip)
    setattr(ip, _SESSION_ATTR, session)
    ip.register_magics(EngineMagics(ip, session))
    ip.register_magics(ProgramMagics(ip, session))
    remove_completion = register_completion(ip)
    shared = share_primitives(ip)
    syntax_check = CellSyntaxCheck(ip, session)
    ip.input_transformers_cleanup.append(syntax_check)

    def undo() -> None:
        remove_completion()
        if syntax_check in ip.input_transformers_cleanup:
            ip.input_transformers_cleanup.remove(syntax_check)
        for name, value in shared.items():
            if ip.user_ns.get(name) is value:
                ip.user_ns.pop(name, None)
                ip.user_ns_hidden.pop(name, None)

    setattr(ip, _UNDO_ATTR, undo)


def share_primitives(ip: Any) -> dict[str, Any]:
    """Put what a `%%sgl` cell sees without importing (`sgnb.cell.prelude()`) in the user namespace, where
    the name is free, hidden from `%who` (`push(interactive=False)`); returns what was added. The completer
    and the inspector look names up there: this is what makes `gen(` + Shift-Tab and `gen(max_t` + Tab work
    in `%%sgl` cells (and plain ones). A `%%sgl` cell reads the same objects either way."""
    from sgnb.cell import prelude

    free = {name: value for name, value in prelude().items() if name not in ip.user_ns}
    ip.push(free, interactive=False)
    return free


def unload_ipython_extension(ip: Any) -> None:
    """Stop the server, detach the views and shut down the engine `%sgl model` loaded."""
    session = getattr(ip, _SESSION_ATTR, None)
    if session is None:
        return
    session.close()
    setattr(ip, _SESSION_ATTR, None)
    undo = getattr(ip, _UNDO_ATTR, None)
    if undo is not None:
        undo()
        setattr(ip, _UNDO_ATTR, None)
    magics = ip.magics_manager.magics
    magics["line"].pop("sgl", None)
    magics["cell"].pop("sgl", None)


def get_session(ip: Any) -> Any:
    """The extension's KernelSession for shell `ip` (None when not loaded)."""
    return getattr(ip, _SESSION_ATTR, None)


__all__ = ["get_session", "load_ipython_extension", "share_primitives", "unload_ipython_extension"]
