"""What a `%%sgl` cell means: the code its body compiles to, and the namespace that code runs in.

- `compile_cell(source, filename)`: a `%%sgl` cell body becomes the program `def __sgl_cell__(s): <body>`, or,
  when the body never mentions `s` at its top level, plain definitions (e.g. `@function` programs).
- Its code runs in a `CellNamespace`: the user's names, then sgnb's primitives (gen, select, roles, `function`,
  `sgl`, ...: `prelude()`) as if they were builtins. Names the cell binds are written back to the user's namespace.
- `run_definitions` runs a definitions cell; `cell_function` makes a program cell's SglFunction.

The `%%sgl` magic (`kernel_ext/program_magics.py`) parses its options, then calls these; `load_notebook`
(`sgnb.notebook_import`) reads a saved notebook's `%%sgl` cells through them too.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import linecache
import symtable
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgnb.function import SglFunction

CELL_FUNCTION = "__sgl_cell__"
_PRIMITIVES = ("gen", "gen_int", "gen_string", "select", "image", "video", "system", "user", "assistant",
               "system_begin", "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end",
               "tool", "separate_reasoning", "function", "set_default_backend", "get_default_backend", "flush_cache")


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


__all__ = ["CELL_FUNCTION", "CellCode", "CellNamespace", "cell_function", "compile_cell", "prelude",
           "references_s", "register_source", "run_definitions"]
