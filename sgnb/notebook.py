"""Notebooks as LM programs: what a `%%sgl` cell means, running a notebook headless, importing its programs.

- `compile_cell(source, filename)`: a `%%sgl` cell body becomes the program `def __sgl_cell__(s): <body>`, or,
  when the body never mentions `s` at its top level, plain definitions (e.g. `@function` programs). Its code
  runs in a `CellNamespace`: the user's names, then sgnb's primitives (gen, select, roles, `function`, `sgl`,
  ...) as if they were builtins. Names the cell binds are written back to the user's namespace.
- `execute_notebook` / `inject_parameters` / `write_notebook`: `sgnb run NB.ipynb -p k=v -o out.html` (nbclient,
  parameters as papermill injects them, HTML with the widget state through nbconvert).
- `add_static_views` / `export_html`: a page that shows the views with no network (`OfflineHTMLExporter`: the
  widget state drawn by a script inlined in the page, not by the CDN's widget manager) and a static HTML snapshot
  in each view's output, for GitHub, nbviewer and VS Code (`sgnb.widgets._static`).
- `load_notebook(path)`: a notebook's definitions as a module; `run_dataset` maps one program over JSON rows.

The backend a headless run should use travels to the kernel in the environment variable `SGNB_BACKEND` (read
here, by `pinned_backend()`; the kernel extension obeys it). IPython and the Jupyter packages load lazily.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import json
import linecache
import os
import re
import symtable
import types
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgnb.backends.base import Backend
    from sgnb.function import SglFunction

BACKEND_ENV = "SGNB_BACKEND"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
CELL_FUNCTION = "__sgl_cell__"
PARAMETERS_TAG = "parameters"
INJECTED_TAG = "injected-parameters"
_PRIMITIVES = ("gen", "gen_int", "gen_string", "select", "image", "video", "system", "user", "assistant",
               "system_begin", "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end",
               "tool", "separate_reasoning", "function", "set_default_backend", "get_default_backend", "flush_cache")


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


# ---- %%sgl cells ------------------------------------------------------------------------------------------
def prelude() -> dict[str, Any]:
    """What a `%%sgl` cell can use without importing: the primitives, `function`, and `sgl` (this package)."""
    import sgnb

    return {"sgl": sgnb, **{name: getattr(sgnb, name) for name in _PRIMITIVES}}


class CellNamespace(dict):
    """Globals for a cell's code. Names the cell binds land here until `commit()` moves them to the user's
    namespace; any other name is looked up in the user's namespace, then in the prelude, then in builtins. So a
    user variable named `user` or `image` shadows the primitive, as a variable would shadow a builtin.

    Functions the cell defines keep this object as their globals: after `commit()` they see the user's
    current values (and the prelude) at call time.
    """

    def __init__(self, user_ns: dict[str, Any]) -> None:
        super().__init__(__builtins__=builtins, __name__=user_ns.get("__name__", "__main__"))
        self.user_ns = user_ns
        self.prelude = prelude()

    def __missing__(self, name: str) -> Any:
        if name in self.user_ns:
            return self.user_ns[name]
        if name in self.prelude:
            return self.prelude[name]
        raise KeyError(name)

    def commit(self) -> list[str]:
        """Move every name the cell bound into the user's namespace; returns their names."""
        names = [k for k in self if k not in ("__builtins__", "__name__", CELL_FUNCTION)]
        for name in names:
            self.user_ns[name] = self.pop(name)
        return names


@dataclasses.dataclass(frozen=True)
class CellCode:
    """A compiled cell. A program cell's `code` defines `__sgl_cell__(s)`, whose return value is the cell's
    value; a definitions cell runs `code`, then evaluates `value` (its final bare expression, if any)."""

    filename: str
    source: str
    code: types.CodeType
    is_program: bool
    value: types.CodeType | None = None


def register_source(filename: str, source: str) -> None:
    """Let tracebacks and `user_location()` show the lines of code that has no file (a cell)."""
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)


def references_s(source: str, filename: str) -> bool:
    """Whether the code's top level uses the name `s` (nested functions with their own `s` do not count)."""
    return "s" in symtable.symtable(source, filename, "exec").get_identifiers()


def compile_cell(source: str, filename: str) -> CellCode:
    """Compile a `%%sgl` cell body. Raises SyntaxError pointing into the cell.

    A body that uses `s` at its top level is a program: it becomes `def __sgl_cell__(s): <body>` with every name
    it binds declared `global` (so `x = s["answer"]` and `def helper(): ...` reach the user's namespace after
    `CellNamespace.commit()`) and a final bare expression returned, as the cell's value. Line numbers stay
    those of the cell. Any other body is plain definitions.
    """
    register_source(filename, source)
    tree = ast.parse(source, filename)
    last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    if not references_s(source, filename):
        value = None
        if last is not None:
            tree.body.pop()
            value = compile(ast.Expression(last.value), filename, "eval")
        return CellCode(filename, source, compile(tree, filename, "exec"), is_program=False, value=value)
    if last is not None:
        tree.body[-1] = ast.copy_location(ast.Return(last.value), last)
    wrapper = ast.parse(f"def {CELL_FUNCTION}(s):\n    pass\n", filename)
    func = wrapper.body[0]
    assert isinstance(func, ast.FunctionDef)
    func.body = tree.body or [ast.Pass(lineno=1, col_offset=0)]
    table = symtable.symtable(ast.unparse(wrapper), filename, "exec").lookup(CELL_FUNCTION).get_namespace()
    bound = sorted(sym.get_name() for sym in table.get_symbols() if sym.is_local() and not sym.is_parameter())
    if bound:
        func.body.insert(0, ast.Global(names=bound, lineno=1, col_offset=0))
    code = compile(ast.fix_missing_locations(wrapper), filename, "exec")
    inner = next(c for c in code.co_consts if isinstance(c, types.CodeType))
    if inner.co_flags & (0x20 | 0x200):  # CO_GENERATOR | CO_ASYNC_GENERATOR
        line, col = _first_yield(func.body)
        text = linecache.getline(filename, line) if line else ""
        raise SyntaxError("a %%sgl cell cannot `yield`: it is the body of one program",
                          (filename, line or 1, col + 1, text))
    return CellCode(filename, source, code, is_program=True)


def _first_yield(body: list[ast.stmt]) -> tuple[int, int]:
    """(line, column) of the first `yield` in the cell's own scope (not in a function or class it defines)."""
    found: list[tuple[int, int]] = []
    todo: list[ast.AST] = list(body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            found.append((node.lineno, node.col_offset))
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))
    return min(found, default=(0, 0))


def run_definitions(cell: CellCode, namespace: CellNamespace) -> Any:
    """Run a definitions cell in `namespace` (then commit it); returns its final expression's value, if any."""
    assert not cell.is_program
    try:
        exec(cell.code, namespace)
        return eval(cell.value, namespace) if cell.value is not None else None
    finally:
        namespace.commit()


def cell_function(cell: CellCode, namespace: CellNamespace, name: str) -> SglFunction:
    """The program a compiled program cell defines, as an SglFunction named `name`."""
    from sgnb.function import SglFunction

    assert cell.is_program
    exec(cell.code, namespace)
    fn = SglFunction(namespace.pop(CELL_FUNCTION))
    fn.__name__ = name
    return fn


# ---- headless execution -----------------------------------------------------------------------------------
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


def write_notebook(nb: Any, path: str | Path) -> Path:
    """Write `nb` as .ipynb, or as a standalone page that needs no network (`export_html`) when `path` ends in
    .html. Either way each sgnb view's output gets its static snapshot from the saved widget state first
    (`add_static_views`, which updates `nb`)."""
    import nbformat

    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".html", ".htm", ".ipynb"):
        raise ValueError(f"write a notebook as .ipynb or .html, not {path.name!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    add_static_views(nb)
    if suffix == ".ipynb":
        nbformat.write(nb, str(path))
    else:
        path.write_text(export_html(nb), encoding="utf-8")
    return path


# ---- exports that need no network ---------------------------------------------------------------------------
def saved_widget_state(nb: Any) -> dict[str, Any]:
    """The notebook's saved widget models (model id -> {model_name, ..., state}), or {} if it saved none."""
    return dict(nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {}))


def add_static_views(nb: Any) -> int:
    """Give each output that shows an sgnb view a `text/html` snapshot (`sgnb.widgets._static`) drawn from the
    view's state saved in the notebook (`metadata.widgets`: what nbclient, or JupyterLab with saveState, stores
    when the run ends), replacing the one the kernel made when the view was displayed, which is often from
    before its program ran. Renderers without the widget (GitHub, nbviewer, VS Code) then show the final
    picture. Updates `nb` in place; returns how many outputs got a snapshot."""
    saved = saved_widget_state(nb)
    if not saved:
        return 0
    from sgnb.widgets._static import snapshot_html

    updated = 0
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get(WIDGET_VIEW)
            model = saved.get(str(view.get("model_id"))) if isinstance(view, dict) else None
            snapshot = snapshot_html(model.get("state", {})) if isinstance(model, dict) else None
            if snapshot is not None:
                out["data"]["text/html"] = snapshot
                updated += 1
    return updated


def export_html(nb: Any) -> str:
    """`nb` as one HTML page (nbconvert's lab template) that shows every view with no network: see
    `OfflineHTMLExporter`. `nb` itself is not changed."""
    body, _ = _offline_exporter_class()().from_notebook_node(nb)
    return body


_OFFLINE_TEMPLATE = r"""{%- extends 'index.html.j2' -%}
{#- nbconvert's lab page, but nothing loads from the network unless an output needs it -#}
{%- block html_head_js_requirejs -%}
{%- if resources.sgnb_offline.requirejs -%}{{ super() }}{%- endif -%}
{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}
{%- if resources.sgnb_offline.mathjax -%}{{ super() }}{%- endif -%}
{%- endblock html_head_js_mathjax -%}
{% block jupyter_widgets %}
{%- if "widgets" in nb.metadata %}
<script>
{{ resources.sgnb_offline.script }}
</script>
{%- endif -%}
{% endblock jupyter_widgets %}
{%- block data_widget_view scoped %}
<div class="jupyter-widgets jp-OutputArea-output {{ extra_class }}">
{%- if 'text/html' in output.data %}
<div class="sgnb-static-output">{{ output.data['text/html'] }}</div>
{%- endif %}
<script type="application/vnd.jupyter.widget-view+json">
{{ output.data['application/vnd.jupyter.widget-view+json'] | json_dumps | escape_html_script }}
</script>
</div>
{%- endblock data_widget_view -%}
"""
_REQUIRE = re.compile(r"\brequire(?:js)?\s*[.(]")
_MATH = re.compile(r"\$|\\\(|\\\[|\\begin\{")


def _page_needs(nb: Any) -> dict[str, bool]:
    """Which of the lab page's CDN scripts an output or markdown cell of `nb` needs: require.js for JavaScript
    outputs (and HTML that calls require), MathJax for math."""
    requirejs = mathjax = False
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "markdown" and _MATH.search(cell.get("source", "")):
            mathjax = True
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            requirejs = requirejs or "application/javascript" in data or bool(_REQUIRE.search(
                str(data.get("text/html", ""))) and WIDGET_VIEW not in data)
            mathjax = mathjax or "text/latex" in data
    return {"requirejs": requirejs, "mathjax": mathjax}


def _offline_page_script() -> str:
    from sgnb.widgets import esm_path

    script = esm_path("offline_page.js").read_text(encoding="utf-8")
    assert "</script" not in script.lower(), "offline_page.js cannot sit inside a <script> tag"
    return script


@functools.cache
def _offline_exporter_class() -> type:
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter
    from traitlets import default

    class OfflineHTMLExporter(HTMLExporter):
        """nbconvert's HTML (lab template) for a page that works with no network.

        The views are drawn from the widget state saved in the notebook by a small script inlined in the page
        (`sgnb/widgets/offline_page.js`), which imports each anywidget's ES module from the state itself,
        instead of the CDN copies of require.js, @jupyter-widgets/html-manager and anywidget that nbconvert's
        page loads (blank offline, and flaky online). Each view's output also carries its static snapshot
        (`add_static_views`), shown until the script replaces it, or for good where scripts do not run.
        require.js and MathJax still load from their CDN when an output or markdown cell needs them.

        `jupyter nbconvert --to sgnb.notebook.OfflineHTMLExporter NB.ipynb` uses it from the command line.
        """

        export_from_notebook = "HTML (offline views)"

        @default("template_file")
        def _template_file_default(self) -> str:
            return "sgnb_offline.html.j2"

        @default("extra_loaders")
        def _extra_loaders_default(self) -> list[Any]:
            return [DictLoader({"sgnb_offline.html.j2": _OFFLINE_TEMPLATE})]

        def from_notebook_node(self, nb: Any, resources: dict[str, Any] | None = None,  # type: ignore[override]
                               **kw: Any) -> tuple[str, dict[str, Any]]:
            import copy

            nb = copy.deepcopy(nb)
            add_static_views(nb)
            resources = dict(resources or {})
            resources["sgnb_offline"] = {"script": _offline_page_script(), **_page_needs(nb)}
            return super().from_notebook_node(nb, resources, **kw)

    OfflineHTMLExporter.__module__, OfflineHTMLExporter.__qualname__ = __name__, "OfflineHTMLExporter"
    return OfflineHTMLExporter


def __getattr__(name: str) -> Any:
    # OfflineHTMLExporter subclasses nbconvert's exporter: built on first use, so importing this module stays cheap
    if name == "OfflineHTMLExporter":
        return _offline_exporter_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- importing a notebook ---------------------------------------------------------------------------------
_CELL_MAGIC = re.compile(r"\A\s*%%(\w+)")


def _is_definition(stmt: ast.stmt) -> bool:
    if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return True
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        if len(names) != len(targets) or stmt.value is None:
            return False
        if all(n.isupper() for n in names):  # CONSTANT = <any expression>
            return True
        try:
            ast.literal_eval(stmt.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return False
        return True
    return False


def _definitions(source: str, filename: str) -> types.CodeType | None:
    tree = ast.parse(source, filename)
    tree.body = [s for s in tree.body if _is_definition(s)]
    return compile(tree, filename, "exec") if tree.body else None


def load_notebook(path: str | Path, name: str | None = None) -> types.ModuleType:
    """Import a notebook's definitions as a module, without running its programs.

    From every code cell, only the top-level statements that define things run, in order: `import` /
    `from ... import`, `def` / `async def` / `class` (with their decorators, so `@function` programs), and
    assignments of a literal (`N = 3`, `FEW_SHOT = \"\"\"...\"\"\"`) or to an ALL-CAPS name (`EXAMPLES = [...]`).
    Everything else (calls such as `qa.run(...)`, `set_default_backend(...)`, expressions, `%magics`,
    `!shell`) is skipped. `%%sgl` cells contribute their definitions too, with the primitives in scope as in
    the kernel, except program cells (those using `s`), which are skipped whole; other `%%magic` cells are
    skipped. Nothing is registered in sys.modules. Tracebacks show the notebook's cells.
    """
    import nbformat
    from IPython.core.inputtransformer2 import TransformerManager

    path = Path(path)
    nb = nbformat.read(str(path), as_version=4)
    module = types.ModuleType(name or re.sub(r"\W", "_", path.stem))
    module.__file__ = str(path)
    transform = TransformerManager().transform_cell
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        source = cell.source
        filename = f"{path}#cell{i + 1}"
        magic = _CELL_MAGIC.match(source)
        if magic and magic.group(1) == "sgl":
            body = source.split("\n", 1)[1] if "\n" in source else ""
            cell_code = compile_cell(body, filename)
            if cell_code.is_program:
                continue
            code = _definitions(body, filename)
            if code is not None:
                namespace = CellNamespace(module.__dict__)
                exec(code, namespace)
                namespace.commit()
            continue
        if magic:
            continue
        python = transform(source)  # %magics and !shell become get_ipython() calls, which are skipped
        register_source(filename, python)
        code = _definitions(python, filename)
        if code is not None:
            exec(code, module.__dict__)
    return module


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


__all__ = ["BACKEND_ENV", "CellCode", "CellNamespace", "add_static_views", "backend_from_spec",
           "cell_function", "compile_cell", "execute", "execute_notebook", "export_html", "inject_parameters",
           "load_notebook", "parse_parameter", "pinned_backend", "prelude", "read_jsonl", "register_source",
           "run_dataset", "run_definitions", "saved_widget_state", "write_notebook"]
