"""Lay the source tree out as the installed `sgnb` package, with links: DEST/sgnb holds a link to each entry of sgnb/
and to each folder pyproject.toml's package-dir maps from outside sgnb/ (engine, kernels, kernel_ext, widgets).
One place for that layout, used by `make typecheck` (mypy knows no package-dir), the device calls
(benchmarks/gpu/setup.sh) and benchmarks/gpu/ab_suite.py (a base commit's engine/ in place of the tree's).

    python3 .ci/package_tree.py DEST [--use engine=DIR ...]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def mapped_folders(root: Path = ROOT) -> dict[str, Path]:
    """Subpackage name -> its folder, for the `sgnb.X` that package-dir maps to a folder outside sgnb/."""
    project = tomllib.loads((root / "pyproject.toml").read_text())
    package_dir = project["tool"]["setuptools"]["package-dir"]
    return {name.split(".", 1)[1]: root / folder for name, folder in package_dir.items()
            if name.count(".") == 1 and not folder.startswith("sgnb")}


def lay_out(dest: Path, use: dict[str, Path] | None = None, root: Path = ROOT) -> Path:
    """DEST/sgnb as described above (replaced if there); `use` names other folders for mapped subpackages."""
    folders = {**mapped_folders(root), **(use or {})}
    unknown = set(use or {}) - set(mapped_folders(root))
    if unknown:
        raise ValueError(f"not a mapped subpackage: {sorted(unknown)}; mapped: {sorted(mapped_folders(root))}")
    pkg = dest / "sgnb"
    shutil.rmtree(pkg, ignore_errors=True)
    pkg.mkdir(parents=True)
    for entry in (root / "sgnb").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name, folder in folders.items():
        (pkg / name).symlink_to(folder.resolve())
    return pkg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", type=Path)
    ap.add_argument("--use", action="append", default=[], metavar="NAME=DIR",
                    help="lay out NAME (e.g. engine) from DIR instead of the tree's folder")
    args = ap.parse_args()
    use = dict(item.split("=", 1) for item in args.use)
    lay_out(args.dest, {k: Path(v) for k, v in use.items()})


if __name__ == "__main__":
    main()
