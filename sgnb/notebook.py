"""Notebooks as LM programs, a module per concept; their public names are importable from here too.

- `sgnb.cell`: what a `%%sgl` cell means (`compile_cell`, `CellNamespace`, `prelude`, `cell_function`).
- `sgnb.headless`: `sgnb run` (`execute_notebook`, `inject_parameters`, `run_dataset`, `backend_from_spec`,
  `pinned_backend`).
- `sgnb.export`: notebooks for readers with no kernel and no network (`add_static_views`, `export_html`,
  `write_notebook`, `OfflineHTMLExporter`).
- `sgnb.notebook_import`: `load_notebook`.

`sgnb.notebook:OfflineHTMLExporter` is the name pyproject registers the nbconvert exporter `sgnb_html` under, and
`jupyter nbconvert --to sgnb.notebook.OfflineHTMLExporter` names it too: both resolve here.
"""

from __future__ import annotations

from typing import Any

from sgnb.cell import (
    CELL_FUNCTION,
    CellCode,
    CellNamespace,
    cell_function,
    compile_cell,
    prelude,
    references_s,
    register_source,
    run_definitions,
)
from sgnb.export import (
    WIDGET_STATE,
    WIDGET_VIEW,
    add_static_views,
    export_html,
    saved_widget_state,
    write_notebook,
)
from sgnb.headless import (
    BACKEND_ENV,
    INJECTED_TAG,
    PARAMETERS_TAG,
    backend_from_spec,
    execute,
    execute_notebook,
    inject_parameters,
    parse_parameter,
    pinned_backend,
    read_jsonl,
    run_dataset,
)
from sgnb.notebook_import import load_notebook


def __getattr__(name: str) -> Any:
    # built on first use by sgnb.export (it subclasses nbconvert's exporter), so importing this module stays cheap
    if name == "OfflineHTMLExporter":
        from sgnb import export

        return export.OfflineHTMLExporter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BACKEND_ENV", "CELL_FUNCTION", "INJECTED_TAG", "PARAMETERS_TAG", "WIDGET_STATE", "WIDGET_VIEW",
           "CellCode", "CellNamespace", "add_static_views", "backend_from_spec", "cell_function", "compile_cell",
           "execute", "execute_notebook", "export_html", "inject_parameters", "load_notebook", "parse_parameter",
           "pinned_backend", "prelude", "read_jsonl", "references_s", "register_source", "run_dataset",
           "run_definitions", "saved_widget_state", "write_notebook"]
