"""A view's output in a notebook: displayed under a display id, so that its output can be sent again with the
snapshot of now (`refresh`), once the run it shows is over or, for a view that stays open, after later cells.

A view's output carries its static snapshot (`_static.py`) under text/html, drawn when the output was made: for a
view displayed before its program runs, an empty picture. Jupyter frontends save outputs as they got them (and
JupyterLab saves no widget state unless asked), so a notebook saved after the run would show GitHub, nbviewer and
VS Code that empty picture. `refresh` sends the output again as an update of the same display id
(update_display_data): the same widget view, with the snapshot of now. JupyterLab, Notebook 7, VS Code and
nbclient replace the output in place, so what is saved is the latest picture. (A frontend without sgnb's
extension draws the view afresh from its model on such an update; with it, the live view stays as it is and only
the saved snapshot changes: labextension/src/views.ts.)

Views that stay open while later cells change what they show (`%sgl tree`, `%sgl stats`) are `keep_current`:
after each later cell (IPython's post_run_cell, on the kernel's main thread, so the update goes out as that cell's
output and the frontend routes it to the view's cell by its display id) the view catches up with its source and
its output is sent again when it changed since it was last sent. The cell boundary is the throttle: one update
per cell at most, none while nothing changes.

IPython is imported only by `show` and `keep_current`, and only where the caller displays; `refresh` does nothing
for a view that `show` did not display.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

_HANDLE = "_sgnb_display"  # the DisplayHandle, kept on the view
_SENT = "_sgnb_display_sent"  # the view's version when its output was last sent

# views kept current -> (how to catch up with the source, the view's version now)
# (each takes the view: the table holds no reference to it)
_kept: weakref.WeakKeyDictionary[Any, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = weakref.WeakKeyDictionary()
_hooked: set[int] = set()  # ids of the shells whose post_run_cell calls `after_cell`


def _bundle(view: Any) -> tuple[dict, dict] | None:
    """The view's output (data, metadata) from its own `_repr_mimebundle_`: published as it is, without IPython's
    formatters asking the view for each of their ten types in turn (a run_batch's table pays this on the cell's
    thread, after its batch). None when the view has no such output (a closed widget)."""
    bundle = view._repr_mimebundle_() if hasattr(view, "_repr_mimebundle_") else None
    if bundle is None:
        return None
    return bundle if isinstance(bundle, tuple) else (bundle, {})


def show(view: Any) -> None:
    """Display `view` in IPython under a new display id, kept on the view for `refresh`."""
    from IPython.display import display

    bundle = _bundle(view)
    handle = display(view, display_id=True) if bundle is None else \
        display(bundle[0], metadata=bundle[1], raw=True, display_id=True)
    setattr(view, _HANDLE, handle)


def refresh(view: Any) -> bool:
    """Replace the output `show` made with `view`'s output of now (its final snapshot, once its run is over).
    Call it on the thread of the cell that displayed the view (the update goes out as that cell's output), or
    on the kernel's main thread while a later cell runs (it goes out as that cell's, routed by its display id).
    Returns False when `view` was not displayed by `show`."""
    handle = getattr(view, _HANDLE, None)
    if handle is None:
        return False
    bundle = _bundle(view)
    if bundle is None:
        handle.update(view)
    else:
        handle.update(bundle[0], metadata=bundle[1], raw=True)
    return True


def keep_current(view: Any, catch_up: Callable[[Any], Any], version: Callable[[Any], Any],
                 shell: Any = None) -> None:
    """Send `view`'s output again after each later cell in which it changed, until the view is closed.

    `catch_up(view)` brings the view up to date with its source (a flush of buffered events), `version(view)`
    changes whenever what the view shows does (a count of its syncs). Called where `show` displayed it."""
    if shell is None:
        from IPython import get_ipython

        shell = get_ipython()
    if shell is None or getattr(view, _HANDLE, None) is None:
        return
    _kept[view] = (catch_up, version)
    setattr(view, _SENT, version(view))
    if id(shell) not in _hooked:
        shell.events.register("post_run_cell", after_cell)
        _hooked.add(id(shell))


def after_cell(*_: Any) -> int:
    """IPython's post_run_cell: refresh each kept view whose picture changed; forget closed ones. Returns how many
    were refreshed."""
    sent = 0
    for view, (catch_up, version) in list(_kept.items()):
        if getattr(view, "comm", True) is None:  # closed: its output stays as last sent
            _kept.pop(view, None)
            continue
        try:
            catch_up(view)
            now = version(view)
            if now != getattr(view, _SENT, None):
                setattr(view, _SENT, now)
                sent += refresh(view)
        except Exception:  # a view that cannot draw must not break the user's cells
            _kept.pop(view, None)
    return sent


def discard(view: Any) -> None:
    """Take back the output `show` made (a view whose run was refused before it began) and close the view."""
    _kept.pop(view, None)
    handle = getattr(view, _HANDLE, None)
    if handle is not None:
        handle.update({"text/plain": ""}, raw=True)
    view.close()


__all__ = ["after_cell", "discard", "keep_current", "refresh", "show"]
