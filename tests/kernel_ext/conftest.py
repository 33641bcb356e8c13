"""A real kernel for the tests that talk to one as JupyterLab does (jupyter_client)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A python3 kernel with `%load_ext sgnb` (no model loaded): its blocking client."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path_factory.mktemp("kernel")),
                              extra_arguments=["--IPKernelApp.log_level=ERROR"])
    try:
        reply = kc.execute_interactive("%load_ext sgnb", timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
