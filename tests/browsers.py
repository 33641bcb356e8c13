"""Real browsers for the tests (a helper module, not tests; its fixtures come in through `pytest_plugins` in
tests/conftest.py): headless Debian chromium driven by Playwright, and JupyterLab 4 / Notebook 7 servers for it to
open. The browser tests (tests/widgets/test_*_browser.py, tests/labextension/test_panel.py,
tests/notebooks/test_offline_export.py) share what is here; what each page shows stays in its own file.
"""

from __future__ import annotations

import contextlib
import http.cookiejar
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"  # screenshots and pages, for a person to look at
CHROMIUM = "/usr/bin/chromium"
ORIGIN = "http://sgnb.test/"  # a page served by a Playwright route: nothing else answers there
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
               "--disable-sync", "--no-first-run", "--disable-quic"]


@pytest.fixture(scope="session")
def chromium() -> str:
    """The path of Debian's chromium (installed with apt-get when missing; skipped where that cannot be), with
    Playwright importable."""
    pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        apt = shutil.which("apt-get")
        if apt is None:
            pytest.skip("no /usr/bin/chromium and no apt-get to install Debian's chromium")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run([apt, "update", "-q"], check=True, env=env, capture_output=True, timeout=300)
        done = subprocess.run([apt, "install", "-y", "-q", "chromium"], env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"apt-get install chromium failed:\n{done.stderr[-2000:]}"
    return CHROMIUM


@contextlib.contextmanager
def open_browser(chromium: str = CHROMIUM) -> Iterator[Any]:
    """A headless chromium (Playwright's Browser), closed on exit. One Playwright per thread at a time: a
    module uses this in its tests or the `browser` fixture, not both."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=LAUNCH_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def browser(chromium):
    """One headless chromium for the tests of a module."""
    with open_browser(chromium) as b:
        yield b


def shoot(locator: Any, name: str, **options: Any) -> Path:
    """A screenshot of a page or locator as test-artifacts/NAME."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    locator.screenshot(path=str(path), **options)
    return path


def notebook_failed(page: Any, name: str) -> AssertionError:
    """A notebook page that did not get where a test waited: its full-page screenshot as test-artifacts/NAME, and
    an error saying the kernel's status, the cells' prompts, any dialog, what the cells printed (a traceback, a
    dead kernel) and the tail of the latest Jupyter server's log, which is all that CI's log shows of it. Raise it
    `from` the wait's exception."""
    shoot(page, name, full_page=True)
    outputs = page.locator(".jp-OutputArea").all_inner_texts()
    prompts = [p.strip() for p in page.locator(".jp-InputPrompt").all_inner_texts()]
    status = page.locator(".jp-Notebook-ExecutionIndicator").get_attribute("data-status")
    dialogs = page.locator(".jp-Dialog").all_inner_texts()  # "Kernel Restarting", "Select Kernel", ...
    log = _SERVER_LOGS[-1].read_text(errors="replace")[-2500:] if _SERVER_LOGS else ""
    return AssertionError(f"kernel {status}; prompts {prompts}; dialogs {dialogs}; cell outputs: {outputs}\n"
                          f"server log:\n{log}")


# ---- Jupyter servers -------------------------------------------------------------------------------------------
def write_notebook(path: Path, cells: Sequence[str]) -> Path:
    """A notebook of code cells for the python3 kernel."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.write(nb, str(path))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SERVER_LOGS: list[Path] = []  # the servers' logs, latest last: a failed page's error quotes its tail


@contextlib.contextmanager
def jupyter_server(tmp_path: Path, module: str = "jupyterlab", *, root: Path | None = None,
                   settings: Mapping[str, Any] | None = None, args: Sequence[str] = (),
                   timeout: float = 60.0, kernels_for: Sequence[str] = ()) -> Iterator[str]:
    """`python -m jupyterlab` (or `notebook`) over `root` (default `tmp_path`) on a free port with no token;
    yields its URL once it answers; stopped with SIGTERM (its kernels too). Its log is tmp_path/server.log.

    With `settings` ({file under @jupyterlab/apputils-extension: JSON}, e.g. {"themes": {"theme": "JupyterLab
    Dark"}}) it runs with config, settings and workspaces of its own under tmp_path, no "fetch news?" toast.

    `kernels_for` (notebook paths under root) get their session, its kernel started, before the URL is yielded,
    so the page that opens one connects to that kernel. Left to the page, JupyterLab at times starts two kernels for a
    notebook in the same few milliseconds, the second start shutting down the first while it still launches; the
    page then shows an idle kernel that never runs a cell, or "Disconnected" (seen in CI and here, ~1 run in 4)."""
    pytest.importorskip(module)
    root = tmp_path if root is None else root
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if settings is not None:
        folder = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
        folder.mkdir(parents=True, exist_ok=True)
        files = {"notification": {"fetchNews": "false", "checkForUpdates": False}, **settings}
        for name, value in files.items():
            (folder / f"{name}.jupyterlab-settings").write_text(json.dumps(value))
        env.update(JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"))
    url = f"http://127.0.0.1:{_free_port()}"
    log_path = tmp_path / "server.log"
    _SERVER_LOGS.append(log_path)
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", module, "--allow-root", "--no-browser", f"--port={url.rsplit(':', 1)[1]}",
             "--ServerApp.token=", "--ServerApp.password=", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.root_dir={root}", *args],
            cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/api/status", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                assert server.poll() is None, log_path.read_text(errors="replace")[-3000:]
                assert time.monotonic() < deadline, f"{module} did not start in {timeout:.0f} s"
                time.sleep(0.25)
            for path in kernels_for:
                start_kernel(url, path)
            yield url
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def start_kernel(url: str, path: str) -> None:
    """A session for the notebook at `path` (POST /api/sessions: its python3 kernel started; the page that
    opens the notebook connects to it and waits for it to be idle)."""
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    with opener.open(f"{url}/lab", timeout=30):  # the page sets the _xsrf cookie a POST must echo
        pass
    xsrf = next((c.value for c in jar if c.name == "_xsrf"), "")
    body = json.dumps({"path": path, "name": Path(path).name, "type": "notebook",
                       "kernel": {"name": "python3"}}).encode()
    request = urllib.request.Request(f"{url}/api/sessions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "X-XSRFToken": xsrf})
    with opener.open(request, timeout=60) as r:  # answers once the kernel process has started
        assert json.load(r)["kernel"]["id"]


def built_labextension() -> Path:
    """labextension/build, rebuilt by the same setup.py step the wheel uses when a source is newer."""
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_labextension"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = ROOT / "labextension" / "build"
    assert (out / "package.json").exists()
    return out


def labextension_args(tmp_path: Path) -> list[str]:
    """Server arguments that put this checkout's built extension first on the extension path (JupyterLab and
    Notebook 7 read the same setting)."""
    ext_dir = tmp_path / "labextensions"
    ext_dir.mkdir(exist_ok=True)
    link = ext_dir / "sgnb"
    if not link.exists():
        link.symlink_to(built_labextension(), target_is_directory=True)
    return [f"--LabServerApp.extra_labextensions_path={ext_dir}"]


# a cell ran or runs: its prompt reads [*] or [n]
STARTED = "() => [...document.querySelectorAll('.jp-InputPrompt')].some(e => /\\[[*0-9]/.test(e.textContent))"


# a Select Kernel dialog's choice of the kernel the notebook's session already has ("live.ipynb (1e6b52f9)"), if
# it lists one: choosing it keeps that kernel, where the default choice (a new Python 3 kernel) shuts it down
KEEP_SESSION_KERNEL = """() => {
  const select = document.querySelector('.jp-Dialog select');
  if (!select) return false;
  const own = [...select.options].find(o => /\\([0-9a-f]{8}\\)$/.test(o.textContent.trim()));
  if (!own) return false;
  select.value = own.value;
  select.dispatchEvent(new Event('change', {bubbles: true}));
  return true;
}"""


def dismiss_dialogs(page: Any) -> bool:
    """Accept any modal dialog JupyterLab opened by itself (seen in CI-like runs: a jp-Dialog over the menu bar
    took Run All Cells' click for 30 s; a "Select Kernel" dialog that Run All Cells opened although the notebook
    had its kernel), printing its text so a failing test shows what it was. Returns whether there was one."""
    seen = False
    for _ in range(3):
        dialog = page.locator(".jp-Dialog")
        if not dialog.count():
            return seen
        seen = True
        print("JupyterLab dialog dismissed:", dialog.first.inner_text(timeout=5_000)[:300].replace("\n", " | "))
        page.evaluate(KEEP_SESSION_KERNEL)
        accept = page.locator(".jp-Dialog .jp-mod-accept")
        if accept.count():
            accept.first.click(timeout=5_000)
        else:
            page.keyboard.press("Escape")
        # wait until it is gone before looking again: a closing "Select Kernel" dialog stays in the page a moment,
        # and a second click on its button starts another kernel, whose start shuts down the first one's (seen
        # here: three kernels in one second, the notebook left "Disconnected")
        try:
            page.wait_for_function("() => !document.querySelector('.jp-Dialog')", timeout=10_000)
        except Exception:
            pass  # still there (or another one): the next round looks at it
    return seen


# the notebook's session has its kernel, connected and idle. Not the execution indicator alone: it reads "idle"
# from the start, while the toolbar still says "No Kernel" (seen 0.25 s apart on a quiet machine here). Run All
# Cells in that window finds no kernel and opens "Select Kernel", and a cell that runs while the dialog's choice is
# applied can find none again: in CI (a fresh machine, two test workers) the last cell of four sat unrun behind
# such a dialog for 180 s.
KERNEL_READY = """() => {
  const name = document.querySelector('.jp-KernelName')?.textContent.trim();
  const status = document.querySelector('.jp-Notebook-ExecutionIndicator')?.dataset.status;
  return !!name && name !== 'No Kernel' && status === 'idle';
}"""


def wait_kernel_ready(page: Any, timeout_ms: float = 90_000) -> None:
    """Wait until the notebook's kernel is connected and idle (KERNEL_READY), twice 0.3 s apart."""
    page.wait_for_function(KERNEL_READY, timeout=timeout_ms)
    page.wait_for_timeout(300)
    page.wait_for_function(KERNEL_READY, timeout=timeout_ms)


def run_all_cells(page: Any, tries: int = 3) -> None:
    """Run > Run All Cells, until a cell shows it ran or runs (within 20 s of a click): on a loaded machine the
    first click can land before the notebook panel takes commands. Only the click is retried: once a cell has
    started, what the cells do next is the caller's to wait for (a retry then would run them all twice). A
    dialog the click opened (Select Kernel) held the run back: once it is answered, the cells run without
    another click. The first click waits for the kernel (`wait_kernel_ready`)."""
    try:
        wait_kernel_ready(page)
    except Exception:  # a page whose kernel is still starting: the dialogs below deal with what comes
        pass
    for _ in range(tries):
        if dismiss_dialogs(page):
            try:
                page.wait_for_function(STARTED, timeout=20_000)
                return
            except Exception:
                pass
        try:
            page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click(timeout=15_000)
            page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click(timeout=15_000)
        except Exception:  # a dialog that opened meanwhile took the click: dismissed on the next try
            page.keyboard.press("Escape")
            continue
        try:  # a cell started, or a dialog opened (answered on the next round)
            page.wait_for_function(f"() => ({STARTED})() || !!document.querySelector('.jp-Dialog')", timeout=20_000)
            if page.evaluate(STARTED):
                return
        except Exception:
            page.keyboard.press("Escape")
    raise AssertionError("Run All Cells did not start any cell")
