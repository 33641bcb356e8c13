"""The example notebooks run top to bottom on the default model; `sgnb run` (parameters, HTML, --backend,
dataset mode) and `load_notebook`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

import sgnb
from sgnb.notebook import execute_notebook, inject_parameters

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def server(engine):
    """`sgnb serve` over the session's engine, for runs with --backend (their kernels load no model)."""
    from sgnb.server import start_server_thread

    srv = start_server_thread(engine, port=0)
    yield srv
    srv.stop()


def _sgnb(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sgnb.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_notebooks_are_saved_clean_and_small():
    names = {p.stem for p in NOTEBOOKS}
    assert {"quickstart", "few_shot_select", "tree_of_thought_fork", "json_regex", "multi_turn_chat",
            "image_qa"} <= names
    for path in NOTEBOOKS:
        assert path.stat().st_size < 20_000, path
        nb = nbformat.read(str(path), as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, (path.name, cell.source[:40])
        assert "%load_ext sgnb" in nb.cells[1].source


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path):
    t0 = time.perf_counter()
    nb = execute_notebook(path, timeout=120)  # a failing cell raises CellExecutionError
    elapsed = time.perf_counter() - t0
    assert elapsed < 120, f"{path.name} took {elapsed:.0f} s"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    # %sgl model ...: its phases and summary, one display updated in place
    assert "loaded in" in "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in code[0].outputs)
    if path.stem == "image_qa":
        _check_image_qa(nb)


def _check_image_qa(nb) -> None:
    """The questions reuse the picture's cached tokens, and the saved widget state (what an HTML export shows)
    holds the thumbnails, the video's frames and the tree's image chips."""
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    counts = [(int(a), int(b)) for a, b in re.findall(r"(\d+) of (\d+) prompt tokens cached", printed)]
    # one request computes the picture, the other three find it cached (what the notebook's text says)
    assert len(counts) == 4 and sum(cached > total // 2 for cached, total in counts) == 3, counts
    assert printed.count("(computed the image)") == 1 and printed.count("(found it cached)") == 3, printed
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    segments = [seg for m in state.values() for p in m["state"].get("programs", []) for seg in p["segments"]]
    images = [seg for seg in segments if seg["k"] == "image"]
    assert len(images) == 2 and all(seg["thumb"].startswith("data:image/jpeg") for seg in images)
    (video,) = [seg for seg in segments if seg["k"] == "video"]
    assert video["num_frames"] == 8 and len(video["frames"]) >= 4
    rows = [r for m in state.values() for r in m["state"].get("nodes", []) if r.get("media")]
    assert sorted(m["kind"] for r in rows for m in r["media"]) == ["image", "image", "video"]


def _parameters_notebook(path: Path) -> Path:
    nb = new_notebook(cells=[
        new_markdown_cell("# a test notebook"),
        new_code_cell("%load_ext sgnb\n%sgl model smollm2"),
        new_code_cell('topic = "cats"\nn = 1', metadata={"tags": ["parameters"]}),
        new_code_cell('%%sgl --max-tokens 4 --temperature 0\ns += f"A fact about {topic}:"\ns += gen("fact")'),
        new_code_cell('import sgnb as sgl\nprint("TOPIC", topic, n, type(n).__name__, '
                      'type(sgl.get_default_backend()).__name__)'),
    ])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
    return path


def test_inject_parameters_after_the_parameters_cell():
    nb = new_notebook(cells=[new_code_cell("a = 1"), new_code_cell("b = 2", metadata={"tags": ["parameters"]}),
                             new_code_cell("c = 3")])
    inject_parameters(nb, {"b": 5, "name": "x"})
    assert [c.source.splitlines()[-1] for c in nb.cells] == ["a = 1", "b = 2", "name = 'x'", "c = 3"]
    inject_parameters(nb, {"b": 6})  # a second injection replaces the first
    assert len(nb.cells) == 4 and nb.cells[2].source.endswith("b = 6\n")
    plain = new_notebook(cells=[new_code_cell("a = 1")])
    inject_parameters(plain, {"a": 2})
    assert plain.cells[0].metadata["tags"] == ["injected-parameters"]


@pytest.mark.slow
def test_sgnb_run_with_parameters_backend_and_html(server, engine, tmp_path):
    nb_path = _parameters_notebook(tmp_path / "params.ipynb")
    before = engine.get_stats()["requests_finished"]
    r = _sgnb("run", str(nb_path), "-p", "topic=dogs", "-p", "n=3", "--backend", server.url,
              "-o", str(tmp_path / "out.ipynb"))
    assert r.returncode == 0, r.stderr
    assert "Kernel is running over TCP" not in r.stderr
    out = nbformat.read(str(tmp_path / "out.ipynb"), as_version=4)
    tags = [c.metadata.get("tags", []) for c in out.cells]
    assert tags.index(["injected-parameters"]) == tags.index(["parameters"]) + 1
    printed = "".join(o.get("text", "") for c in out.cells if c.cell_type == "code" for o in c.outputs)
    assert "TOPIC dogs 3 int RuntimeEndpoint" in printed
    assert "pinned" in printed  # %sgl model kept the --backend
    assert engine.get_stats()["requests_finished"] > before  # the kernel's program ran on this engine
    r = _sgnb("run", str(nb_path), "--backend", server.url, "-o", str(tmp_path / "out.html"))
    assert r.returncode == 0, r.stderr
    html = (tmp_path / "out.html").read_text()
    assert "<html" in html and "TOPIC cats 1 int RuntimeEndpoint" in html


def test_sgnb_run_reports_a_failing_cell(tmp_path):
    nb = new_notebook(cells=[new_code_cell("x = 1"), new_code_cell("raise ValueError('boom')"),
                             new_code_cell("y = 2")])
    nbformat.write(nb, str(tmp_path / "fail.ipynb"))
    r = _sgnb("run", str(tmp_path / "fail.ipynb"), "-o", str(tmp_path / "fail.out.ipynb"))
    assert r.returncode == 1 and "boom" in r.stderr
    out = nbformat.read(str(tmp_path / "fail.out.ipynb"), as_version=4)
    assert out.cells[1].outputs[0].output_type == "error" and out.cells[2].execution_count is None
    assert _sgnb("run", str(tmp_path / "fail.ipynb"), "-o", "x.txt").returncode != 0
    assert _sgnb("run", str(tmp_path / "fail.ipynb"), "-p", "1x=2").returncode != 0


def test_load_notebook_imports_definitions_only(engine):
    before = engine.get_stats()["requests_finished"]
    quick = sgnb.load_notebook(ROOT / "notebooks" / "quickstart.ipynb")
    assert isinstance(quick.qa, sgnb.SglFunction)
    assert quick.question == "What is a radix tree?"  # a literal assignment
    assert not hasattr(quick, "states") and not hasattr(quick, "meta")  # calls are not run
    few = sgnb.load_notebook(ROOT / "notebooks" / "few_shot_select.ipynb")  # definitions in a %%sgl cell
    assert len(few.EXAMPLES) == 4 and isinstance(few.classify, sgnb.SglFunction)
    chat = sgnb.load_notebook(ROOT / "notebooks" / "multi_turn_chat.ipynb")
    assert chat.history == [] and callable(chat.say)
    assert engine.get_stats()["requests_finished"] == before  # loading ran no program
    runtime = sgnb.Runtime(engine=engine)
    state = few.classify.run(review="Wonderful, I loved it.", backend=runtime)
    assert state["label"] in (" positive", " negative")
    state = quick.qa.run(question="What is 1 + 1?", backend=runtime, max_new_tokens=4, temperature=0)
    assert state["answer"]


@pytest.mark.slow
def test_sgnb_run_function_over_a_dataset(server, tmp_path):
    rows = [{"review": "Lovely food and kind staff."}, {"review": "Cold soup, rude waiter."}, {"text": "bad"},
            [1, 2], {"review": "Great concert!"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = _sgnb("run", "notebooks/few_shot_select.ipynb", "--function", "classify", "--input",
              str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--backend", server.url,
              "--num-threads", "2")
    assert r.returncode == 1, r.stderr  # a failed row fails the run (every row is still in the output)
    assert "5 inputs" in r.stderr and "2 failed" in r.stderr
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["index"] for o in out] == [0, 1, 2, 3, 4]
    for i in (0, 1, 4):
        assert out[i]["error"] is None and out[i]["variables"]["label"] in (" positive", " negative")
    assert "text" in out[2]["error"] and "JSON object" in out[3]["error"]
    (tmp_path / "good.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (rows[0], rows[4])))
    r = _sgnb("run", "notebooks/few_shot_select.ipynb", "--function", "classify", "--input",
              str(tmp_path / "good.jsonl"), "--backend", server.url)
    assert r.returncode == 0 and "0 failed" in r.stderr, r.stderr
    r = _sgnb("run", "notebooks/few_shot_select.ipynb", "--function", "nope", "--input", str(tmp_path / "in.jsonl"))
    assert r.returncode != 0 and "classify" in r.stderr
