"""One ES module text per widget, with its relative imports inlined.

anywidget takes a widget's `_esm` as a string (it travels in the widget state, so a saved notebook renders with
no kernel), so a module cannot import a sibling file at run time. The drawing modules (`radix_tree_draw.js`,
`stats_draw.js`) stay plain ES modules that the JupyterLab extension imports as they are; here each line
`import { a, b } from "./x.js";` is replaced by the text of x.js (once per file). Their exports become exports of
the widget module, which is harmless; inlined files must not declare the same top-level names.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

HERE = Path(__file__).resolve().parent
_IMPORT = re.compile(r'^import\s*\{[^}]*\}\s*from\s*["\']\./([\w.-]+\.js)["\'];?[ \t]*$', re.M)


@cache
def bundle(name: str) -> str:
    """The module `name` (a .js file beside this one) with its relative imports inlined."""
    seen: set[Path] = set()

    def inline(path: Path) -> str:
        seen.add(path)

        def replace(m: re.Match[str]) -> str:
            dep = (path.parent / m.group(1)).resolve()
            if dep.parent != HERE:
                raise ValueError(f"{path.name}: only sibling modules can be inlined, not {m.group(1)}")
            return "" if dep in seen else f"// ---- inlined {dep.name} ----\n{inline(dep)}\n// ---- end {dep.name} ----"

        return _IMPORT.sub(replace, path.read_text(encoding="utf-8"))

    return inline(HERE / name)
