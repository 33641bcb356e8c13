"""sgnb.kernel_ext: the IPython extension. `%load_ext sgnb` (or `%load_ext sgnb.kernel_ext`) registers

- `%sgl`: the kernel's engine and backend: `model`, `backend`, `tree`, `stats`, `flush`, `serve`, `status`;
- `%%sgl`: a cell as an LM program on the current backend, with a live view.

The magics are thin: they parse their line and call sgnb's public API (`sgnb.Runtime`, `set_default_backend`,
`SglFunction.run`, `sgnb.notebook`) and the views of `sgnb.widgets`. Loading the extension imports no torch;
`%sgl model` does. If SGNB_BACKEND is set (`sgnb run --backend`), that backend becomes the default.
"""

from __future__ import annotations

from typing import Any

_SESSION_ATTR = "_sgnb_session"


def load_ipython_extension(ip: Any) -> None:
    from sgnb.kernel_ext.engine_magics import EngineMagics
    from sgnb.kernel_ext.program_magics import ProgramMagics
    from sgnb.kernel_ext.session import KernelSession

    if getattr(ip, _SESSION_ATTR, None) is not None:
        return  # already loaded: keep the engine and views
    session = KernelSession(ip)
    setattr(ip, _SESSION_ATTR, session)
    ip.register_magics(EngineMagics(ip, session))
    ip.register_magics(ProgramMagics(ip, session))


def unload_ipython_extension(ip: Any) -> None:
    """Stop the server, detach the views and shut down the engine `%sgl model` loaded."""
    session = getattr(ip, _SESSION_ATTR, None)
    if session is None:
        return
    session.close()
    setattr(ip, _SESSION_ATTR, None)
    magics = ip.magics_manager.magics
    magics["line"].pop("sgl", None)
    magics["cell"].pop("sgl", None)


def get_session(ip: Any) -> Any:
    """The extension's KernelSession for shell `ip` (None when not loaded)."""
    return getattr(ip, _SESSION_ATTR, None)


__all__ = ["get_session", "load_ipython_extension", "unload_ipython_extension"]
