"""One exclusive lock per cache folder across processes: `with folder_lock(folder): ...`.

Processes that start together (a kernel, a server, test workers) and each find a cache entry missing (a converted
model, the compiled C kernels) would each make it; under the lock the first makes it and the others, once they
hold the lock, find it made. An flock on the folder itself (no lock file in it), released when the block ends or
the process dies. Where the file system refuses locks the block runs unlocked: callers write their entry
atomically (a temporary name renamed into place), so that only costs the duplicate work.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on `folder` (made if missing) for the block."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
