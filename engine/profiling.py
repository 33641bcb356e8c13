"""torch's profiler over an engine's work: `Engine.start_profile` / `stop_profile`.

One profile runs at a time per engine: CPU ops of every thread, and CUDA kernels on a GPU, until `stop`, which
writes a Chrome trace. Not thread-safe: start and stop it from one thread at a time.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any


class Profiler:
    """An engine's profile: at most one running."""

    def __init__(self, cuda: bool) -> None:
        """`cuda`: the engine runs on a GPU (its kernels are recorded too)."""
        self.cuda = cuda
        self._profile: Any = None  # the running torch profiler
        self._dir = ""

    def start(self, output_dir: str | None, with_stack: bool) -> None:
        """Start profiling; the trace goes to `output_dir` (default: $SGLANG_TORCH_PROFILER_DIR, else the
        temporary directory). RuntimeError when a profile is running."""
        from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

        if self._profile is not None:
            raise RuntimeError("a profile is already running: stop_profile() first")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        # without profile_all_threads torch records only the calling thread's ops: the trace would miss the
        # scheduler thread, where all of the engine's work runs
        self._profile = profile(activities=activities, with_stack=with_stack, record_shapes=True,
                                experimental_config=_ExperimentalConfig(profile_all_threads=True))
        self._dir = output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or tempfile.gettempdir()
        self._profile.start()

    def stop(self) -> str:
        """Stop the running profile and write its Chrome trace; returns the trace's path. RuntimeError when none
        runs."""
        profile, self._profile = self._profile, None
        if profile is None:
            raise RuntimeError("no profile is running: start_profile() first")
        profile.stop()
        path = Path(self._dir) / f"sgnb-trace-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(path))
        return str(path)
