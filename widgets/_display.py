"""A view's output in a notebook: displayed under a display id, so that its output can be sent again once the run
it shows is over (`refresh`).

A view's output carries its static snapshot (`_static.py`) under text/html, drawn when the output was made: for a
view displayed before its program runs, an empty picture. Jupyter frontends save outputs as they got them (and
JupyterLab saves no widget state unless asked), so a notebook saved after the run would show GitHub, nbviewer and
VS Code that empty picture. `refresh` sends the output again as an update of the same display id
(update_display_data): the same widget view, with the snapshot of now. JupyterLab, Notebook 7, VS Code and
nbclient replace the output in place (a frontend draws the view afresh from its model once), so what is saved is
the final picture.

IPython is imported only by `show`, and only where the caller displays; `refresh` does nothing for a view that
`show` did not display.
"""

from __future__ import annotations

from typing import Any

_HANDLE = "_sgnb_display"  # the DisplayHandle, kept on the view


def show(view: Any) -> None:
    """Display `view` in IPython under a new display id, kept on the view for `refresh`."""
    from IPython.display import display

    setattr(view, _HANDLE, display(view, display_id=True))


def refresh(view: Any) -> bool:
    """Replace the output `show` made with `view`'s output of now (its final snapshot, once its run is over).
    Call it on the thread of the cell that displayed the view (the update goes out as that cell's output).
    Returns False when `view` was not displayed by `show`."""
    handle = getattr(view, _HANDLE, None)
    if handle is None:
        return False
    handle.update(view)
    return True


def discard(view: Any) -> None:
    """Take back the output `show` made (a view whose run was refused before it began) and close the view."""
    handle = getattr(view, _HANDLE, None)
    if handle is not None:
        handle.update({"text/plain": ""}, raw=True)
    view.close()


__all__ = ["discard", "refresh", "show"]
