"""`load_notebook`: a notebook's definitions imported as a module, its programs not run (`sgnb.load_notebook`,
and `sgnb run NB --function F` before it maps F over a dataset)."""

from __future__ import annotations

import ast
import re
import types
from pathlib import Path

from sgnb.cell import CellNamespace, compile_cell, register_source

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


__all__ = ["load_notebook"]
