"""`sgnb run`: a notebook run headless, with parameters, or one of its programs mapped over a dataset.

- `execute_notebook` / `execute`: the notebook top to bottom in a fresh kernel (nbclient), with the parameters
  (`-p k=v`, `parse_parameter`) in a cell as papermill injects them (`inject_parameters`); `sgnb.export`'s
  `write_notebook` writes the result, as .ipynb or as a page with the widget state.
- `run_dataset`: one program of the notebook (`load_notebook`) once per JSON row (`read_jsonl`).
- `backend_from_spec`: `--backend SPEC` as a backend. The backend a headless run should use travels to the kernel
  in the environment variable `SGNB_BACKEND` (read here, by `pinned_backend()`; the kernel extension obeys it).

The Jupyter packages load lazily.
"""

from __future__ import annotations

import ast
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sgnb.export import add_static_views

if TYPE_CHECKING:
    from sgnb.backends.base import Backend
    from sgnb.function import SglFunction

BACKEND_ENV = "SGNB_BACKEND"
PARAMETERS_TAG = "parameters"
INJECTED_TAG = "injected-parameters"


# ---- backends ---------------------------------------------------------------------------------------------
def pinned_backend() -> str | None:
    """The backend spec a headless run (`sgnb run --backend`) imposes on the notebook, if any."""
    return os.environ.get(BACKEND_ENV) or None


def backend_from_spec(spec: str, **options: Any) -> Backend:
    """`http(s)://HOST:PORT` (RuntimeEndpoint: `sgnb serve`, an SGLang server), `openai:MODEL`,
    `anthropic:MODEL`, or `runtime:MODEL` (an in-process engine; MODEL as `sgnb.Runtime` takes it).
    `options` go to the backend's constructor (e.g. `base_url=` for openai)."""
    import sgnb

    scheme, _, rest = spec.partition(":")
    if scheme in ("http", "https"):
        return sgnb.RuntimeEndpoint(spec, **options)
    if scheme == "openai" and rest:
        return sgnb.OpenAI(rest, **options)
    if scheme == "anthropic" and rest:
        return sgnb.Anthropic(rest, **options)
    if scheme == "runtime" and rest:
        return sgnb.Runtime(rest, **options)
    raise ValueError(f"unknown backend {spec!r}: give http(s)://HOST:PORT, openai:MODEL, anthropic:MODEL or "
                     "runtime:MODEL")


# ---- a notebook, top to bottom ----------------------------------------------------------------------------
def parse_parameter(text: str) -> tuple[str, Any]:
    """`key=value`: value is a Python literal if it reads as one (3, 0.5, True, [1, 2], 'x'), else a string."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise ValueError(f"a parameter is KEY=VALUE with KEY a Python name, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def inject_parameters(nb: Any, parameters: Mapping[str, Any]) -> None:
    """Insert a code cell tagged `injected-parameters` assigning the parameters: after the first cell tagged
    `parameters` (as papermill does), else first. An earlier injected cell is replaced."""
    import nbformat

    if not parameters:
        return
    cells = [c for c in nb.cells if INJECTED_TAG not in c.get("metadata", {}).get("tags", [])]
    source = "# Parameters (injected by sgnb run)\n" + "".join(f"{k} = {v!r}\n" for k, v in parameters.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": [INJECTED_TAG]})
    at = next((i + 1 for i, c in enumerate(cells)
               if c.cell_type == "code" and PARAMETERS_TAG in c.get("metadata", {}).get("tags", [])), 0)
    nb.cells = cells[:at] + [cell] + cells[at:]


def execute_notebook(path: str | Path, parameters: Mapping[str, Any] | None = None, backend: str | None = None,
                     timeout: float | None = 600, kernel_name: str = "python3") -> Any:
    """Run the notebook top to bottom in a fresh kernel (working directory: the notebook's folder) and return
    the executed notebook, outputs and widget state included. `backend` (a spec for `backend_from_spec`)
    reaches the kernel as SGNB_BACKEND (one already in the environment passes through when it is None).
    A failing cell raises nbclient's CellExecutionError (to keep the partial outputs, read the notebook
    yourself and call `execute(nb, ...)`, which works in place)."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    inject_parameters(nb, parameters or {})
    execute(nb, Path(path).resolve().parent, backend, timeout, kernel_name)
    return nb


def execute(nb: Any, cwd: str | Path, backend: str | None = None, timeout: float | None = 600,
            kernel_name: str = "python3") -> Any:
    """Execute `nb` (an nbformat notebook) in place in a fresh kernel started in `cwd`."""
    from nbclient import NotebookClient

    env = dict(os.environ)
    if backend:
        env[BACKEND_ENV] = backend
    # ipykernel warns on every start that its loopback TCP is unencrypted: keep the run's output to errors
    quiet = ["--IPKernelApp.log_level=ERROR"] if kernel_name == "python3" else []
    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel_name, extra_arguments=quiet,
                            resources={"metadata": {"path": str(cwd)}})
    client.execute(env=env)
    add_static_views(nb)
    return nb


# ---- a program over a dataset -----------------------------------------------------------------------------
def read_jsonl(lines: Iterable[str]) -> list[Any]:
    rows = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"input line {n} is not JSON: {e}") from None
    return rows


def _argument_error(fn: SglFunction, row: Any) -> str | None:
    import inspect

    if not isinstance(row, dict):
        return f"an input row must be a JSON object of {fn.__name__}'s arguments, got {type(row).__name__}"
    try:
        inspect.signature(fn.func).bind(None, **{**fn.bind_arguments, **row})
    except TypeError as e:
        return (f"TypeError: {e} ({fn.__name__} takes {', '.join(fn.arg_names) or 'no arguments'}; the row has "
                f"{', '.join(row) or 'none'})")
    return None


def run_dataset(fn: SglFunction, rows: list[Any], backend: Backend, num_threads: int | str = "auto",
                progress_bar: bool = True, **sampling: Any) -> Iterator[dict[str, Any]]:
    """Run `fn` once per row (a dict of its arguments) with `run_batch`; yields, in input order, one
    `{"index", "variables", "error"}` record per row. A row with bad arguments or a failing program gets its
    error and does not stop the others."""
    errors = {i: e for i, row in enumerate(rows) if (e := _argument_error(fn, row)) is not None}
    good = [i for i in range(len(rows)) if i not in errors]
    states = fn.run_batch([rows[i] for i in good], backend=backend, num_threads=num_threads,
                          progress_bar=progress_bar, **sampling) if good else []
    by_index = dict(zip(good, states))
    for i in range(len(rows)):
        if i in errors:
            yield {"index": i, "variables": {}, "error": errors[i]}
            continue
        state = by_index[i]
        err = state.error()
        yield {"index": i, "variables": _jsonable(dict(state.executor.variables)),
               "error": None if err is None else str(err)}


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


__all__ = ["BACKEND_ENV", "INJECTED_TAG", "PARAMETERS_TAG", "backend_from_spec", "execute", "execute_notebook",
           "inject_parameters", "parse_parameter", "pinned_backend", "read_jsonl", "run_dataset"]
