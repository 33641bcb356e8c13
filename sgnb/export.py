"""Notebooks for readers with no kernel and no network (`sgnb export`, `sgnb run -o`).

- `add_static_views`: each sgnb view's output gets a static HTML snapshot drawn from the widget state saved in
  the notebook (`sgnb.widgets._static`), for GitHub, nbviewer and VS Code.
- `export_html` / `OfflineHTMLExporter` (`jupyter nbconvert --to sgnb_html`): a page that shows the views with
  no network: the saved widget state drawn by a script inlined in the page, not by the CDN's widget manager.
- `write_notebook`: the notebook as .ipynb or as that page, by the path's suffix.

nbconvert loads lazily: `OfflineHTMLExporter` (it subclasses nbconvert's HTMLExporter) is built on first use.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


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

        `jupyter nbconvert --to sgnb_html NB.ipynb` (or `--to sgnb.notebook.OfflineHTMLExporter`) uses it from the
        command line.
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


__all__ = ["WIDGET_STATE", "WIDGET_VIEW", "add_static_views", "export_html", "saved_widget_state",
           "write_notebook"]
