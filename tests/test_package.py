"""Packaging contract: one import package `sgnb`, cheap to import, no stray top-level names."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_import_sgnb_imports_no_torch(tmp_path):
    r = _run("import sys, sgnb, sgnb.engine; from sgnb import Engine as _E\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy')))",
             tmp_path)
    # touching sgnb.Engine imports torch by design, so check the cheap part alone too
    r2 = _run("import sys, sgnb, sgnb.engine, sgnb.kernel_ext, sgnb.widgets\n"
              "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')])", tmp_path)
    assert r2.returncode == 0, r2.stderr
    assert r2.stdout.strip() == "[]"
    assert r.returncode == 0, r.stderr


def test_folders_are_not_top_level_packages(tmp_path):
    for name in ("engine", "kernels", "widgets", "kernel_ext"):
        r = _run(f"import importlib.util as u; s = u.find_spec({name!r}); print(s and s.origin)", tmp_path)
        assert r.returncode == 0, r.stderr
        origin = r.stdout.strip()
        # a third-party top-level package of the same name is fine (transformers >= 5.25 installs HF's `kernels`,
        # and .venv lives under ROOT); our folder must not be importable as one
        ours = ROOT / name
        assert origin == "None" or not Path(origin).resolve().is_relative_to(ours), \
            f"{name} resolves to our folder: {origin}"
    r = _run("import sgnb.kernels.attention as a; print(a.__name__)", tmp_path)
    assert r.stdout.strip() == "sgnb.kernels.attention", r.stderr


def test_a_checkout_root_on_sys_path_does_not_shadow_hf_kernels():
    """`python -m sgnb.demo` (or a kernel) started in a checkout puts its root on sys.path, where kernels/ would
    stand in for Hugging Face's `kernels`, which transformers >= 5.25 imports when it loads a tokenizer or model:
    the first GGUF conversion of a fresh machine failed with `cannot import name 'CUDAProperties'`."""
    r = _run("import kernels, transformers.activations, sgnb.kernels as k\n"
             "print(kernels.__file__); print(k.__name__, k.__file__)", ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    theirs, ours = r.stdout.split("\n")[:2]
    if theirs != "None":
        assert not Path(theirs).resolve().is_relative_to(ROOT / "kernels"), theirs
    assert ours == f"sgnb.kernels {ROOT / 'kernels' / '__init__.py'}"


def test_wheel_ships_only_sgnb(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    wheel = next(tmp_path.glob("sgnb-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    dist = "-".join(wheel.name.split("-")[:2])
    assert tops <= {"sgnb", f"{dist}.dist-info", f"{dist}.data"}, tops
    # the prebuilt JupyterLab extension, as data files: installed in sys.prefix/share/jupyter/labextensions
    labext = f"{dist}.data/data/share/jupyter/labextensions/sgnb/"
    assert all(n.startswith(labext) for n in names if n.startswith(f"{dist}.data/")), names
    meta = json.loads(zipfile.ZipFile(wheel).read(labext + "package.json"))
    assert meta["name"] == "sgnb" and meta["jupyterlab"]["_build"]["load"].startswith("static/remoteEntry.")
    assert labext + meta["jupyterlab"]["_build"]["load"] in names
    assert "sgnb/engine/models/configs/tiny.json" in names
    assert "sgnb/kernels/attention.py" in names
    assert "sgnb/backends/runtime.py" in names
