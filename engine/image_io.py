"""Reading encoded media (no torch): file bytes and data: URLs, with errors that say what was wrong.

Shared by the engine's preprocessing (engine/multimodal.py) and the language's thumbnails and data URLs
(sgnb/media.py), which must not import torch.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any


def read_file(path: Any, what: str) -> bytes:
    """The bytes of file `path`; ValueError naming `what` ("image", "video") when it is missing or unreadable."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"{what} file {str(path)!r} does not exist" if not p.exists()
                         else f"{what} path {str(path)!r} is not a file")
    try:
        return p.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {what} file {str(path)!r}: {e}") from None


def data_url_bytes(url: str) -> bytes:
    """The payload of a base64 "data:...;base64,..." URL; ValueError when it is malformed or corrupt."""
    header, sep, payload = url.strip().partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise ValueError(f"a data: URL must look like 'data:image/png;base64,...', got {url[:40]!r}")
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"the data: URL's base64 payload is corrupt: {e}") from None


def image_from_array(data: Any) -> Any:
    """A uint8 (H, W, 3) / (H, W) / (H, W, 4) numpy array as a PIL image; ValueError for any other array."""
    import numpy as np
    from PIL import Image

    if data.dtype != np.uint8 or data.ndim not in (2, 3) or (data.ndim == 3 and data.shape[2] not in (3, 4)):
        raise ValueError(f"an image array must be uint8 of shape (H, W, 3) (or (H, W) / (H, W, 4)), got "
                         f"{data.dtype} {data.shape}")
    if min(data.shape[:2]) == 0:
        raise ValueError(f"the image array is empty: shape {data.shape}")
    return Image.fromarray(np.ascontiguousarray(data))
