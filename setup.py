"""Build hook: compile the JupyterLab extension (labextension/, with npm) and ship it as data files, so the
wheel (and an editable install) carries `share/jupyter/labextensions/sgnb/`. The rest is in pyproject.toml.

The build needs node and npm and, the first time, the npm registry (`npm ci` from package-lock.json); it is
skipped when the bundle is newer than every source it comes from (labextension/ and the widgets' drawing
modules it bundles). SGNB_SKIP_LABEXTENSION=1 builds a wheel without it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build

ROOT = Path(__file__).resolve().parent
LABEXT = ROOT / "labextension"
OUTPUT = LABEXT / "build"  # package.json "jupyterlab.outputDir"
DEST = "share/jupyter/labextensions/sgnb"


def _sources() -> list[Path]:
    """What the bundle is built from: the extension's sources and the widgets' ES modules it imports."""
    files = [LABEXT / n for n in ("package.json", "package-lock.json", "tsconfig.json", "webpack.config.js")]
    files += [f for d in ("src", "style") for f in (LABEXT / d).rglob("*") if f.is_file()]
    return files + sorted((ROOT / "widgets").glob("*.js"))


def _npm(*args: str) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("building sgnb's JupyterLab extension needs npm (and node >= 20) on PATH")
    subprocess.run([npm, *args], cwd=LABEXT, check=True)


class build_labextension(Command):
    description = "build the JupyterLab extension (npm) and add it to the data files"
    user_options: list = []

    def initialize_options(self) -> None:
        self.editable_mode = False  # set by setuptools' editable_wheel

    def finalize_options(self) -> None:
        pass

    def run(self) -> None:
        if os.environ.get("SGNB_SKIP_LABEXTENSION") == "1" or not LABEXT.is_dir():
            return
        installed = LABEXT / "node_modules" / ".package-lock.json"
        lock = LABEXT / "package-lock.json"
        if not installed.exists() or installed.stat().st_mtime < lock.stat().st_mtime:
            _npm("ci", "--no-audit", "--no-fund")
        built, dev_log = OUTPUT / "package.json", OUTPUT / "build_log.json"  # the log: a development build
        newest = max(f.stat().st_mtime for f in _sources())
        if not built.exists() or dev_log.exists() or built.stat().st_mtime < newest:
            dev_log.unlink(missing_ok=True)
            _npm("run", "build:prod")
        by_dir: dict[str, list[str]] = {}
        for f in sorted(OUTPUT.rglob("*")):
            if f.is_file():
                rel = f.parent.relative_to(OUTPUT).as_posix()
                target = DEST if rel == "." else f"{DEST}/{rel}"
                by_dir.setdefault(target, []).append(f.relative_to(ROOT).as_posix())
        # install_data took a reference to this list when it was set up: extend it in place
        files = self.distribution.data_files
        assert files is not None
        files.extend(by_dir.items())
        if self.editable_mode:
            # editable_wheel installs no data files (setuptools 84 asks for `has_data`, which no Distribution
            # has): copy them into the editable wheel's data directory, set up by editable_wheel, ourselves
            data_root = Path(self.distribution.get_command_obj("install").install_data)
            for target, sources in by_dir.items():
                (data_root / target).mkdir(parents=True, exist_ok=True)
                for src in sources:
                    shutil.copy2(ROOT / src, data_root / target)

    def get_outputs(self) -> list[str]:
        return []  # data files, installed by install_data


class build_with_labextension(build):
    sub_commands = [("build_labextension", None), *build.sub_commands]


setup(cmdclass={"build": build_with_labextension, "build_labextension": build_labextension}, data_files=[])
