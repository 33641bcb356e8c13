"""`sgnb.notebook`'s public names live in one module per concept (`sgnb.cell`: what a `%%sgl` cell means;
`sgnb.headless`: `sgnb run`; `sgnb.export`: pages with no network; `sgnb.notebook_import`: `load_notebook`) and
stay importable from `sgnb.notebook`, as users, pyproject's nbconvert entry point and `--to` name them."""

from __future__ import annotations

import importlib
import subprocess
import sys

import sgnb.notebook as notebook

HOMES = ("sgnb.cell", "sgnb.headless", "sgnb.export", "sgnb.notebook_import")


def test_each_name_of_sgnb_notebook_is_its_home_module_s():
    modules = [importlib.import_module(m) for m in HOMES]
    for name in notebook.__all__:
        homes = [m for m in modules if name in m.__all__]
        assert len(homes) == 1, f"{name} is public in {[m.__name__ for m in homes]}"
        assert getattr(notebook, name) is getattr(homes[0], name)
    # and nothing public of the homes is missing from sgnb.notebook
    assert {n for m in modules for n in m.__all__} == set(notebook.__all__)


def test_the_offline_exporter_resolves_by_the_names_nbconvert_is_given():
    from importlib.metadata import entry_points

    from nbconvert.exporters import get_exporter
    from traitlets.utils.importstring import import_item

    from sgnb.export import OfflineHTMLExporter

    (entry,) = [e for e in entry_points(group="nbconvert.exporters") if e.name == "sgnb_html"]
    assert entry.value == "sgnb.notebook:OfflineHTMLExporter"
    assert entry.load() is OfflineHTMLExporter
    assert import_item("sgnb.notebook.OfflineHTMLExporter") is OfflineHTMLExporter  # `--to sgnb.notebook....`
    assert get_exporter("sgnb_html") is OfflineHTMLExporter


def test_importing_the_notebook_modules_loads_no_jupyter_package():
    code = ("import sys, sgnb.notebook, " + ", ".join(HOMES) + "\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'IPython', 'jinja2', 'nbclient', 'nbconvert',"
            " 'nbformat', 'torch'}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
