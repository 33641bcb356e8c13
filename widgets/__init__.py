"""sgnb.widgets: anywidget views of LM programs, the engine's radix tree and its statistics.

Each widget is a Python class with a few synced traits and an ES module beside it. They are thin views over
events: `ProgramView` over the interpreter's program events, `RadixTreeView` and `EngineStats` over an
`sgnb.engine.Engine` (its event bus, tree and stats). Feeding a view never blocks the feeder: events are
buffered and a timer thread syncs them at <= 20 Hz (stats at <= 4 Hz).

Importing this package is cheap: the widget classes (and anywidget, traitlets) load on first use of their
names, and nothing here imports torch or the engine. The lab panel's snapshot (`sgnb.kernel_ext.panel`) uses
the anywidget-free modules only: `_tree_rows` (the tree rows both tree views draw), `_series`, `_media`.

The drawing code of the tree and the stats lives in plain ES modules (`radix_tree_draw.js`, `stats_draw.js`)
that the JupyterLab extension imports too; `esm_path(name)` locates them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgnb.widgets._engine_stats import EngineStats
    from sgnb.widgets._program_view import ProgramView
    from sgnb.widgets._radix_tree import RadixTreeView

_LAZY = {
    "EngineStats": "sgnb.widgets._engine_stats",
    "ProgramView": "sgnb.widgets._program_view",
    "RadixTreeView": "sgnb.widgets._radix_tree",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sgnb.widgets' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def esm_path(name: str) -> Path:
    """Path of one of the widgets' ES modules (e.g. "radix_tree_draw.js")."""
    path = Path(__file__).resolve().parent / name
    if not path.is_file():
        raise FileNotFoundError(f"no widget module {name!r} in {path.parent}")
    return path


__all__ = ["EngineStats", "ProgramView", "RadixTreeView", "esm_path"]
