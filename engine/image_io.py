"""Reading encoded media (no torch): file bytes and data: URLs, with errors that say what was wrong.

Shared by the engine's preprocessing (engine/multimodal.py) and the language's thumbnails and data URLs
(sgnb/media.py), which must not import torch.
"""

from __future__ import annotations

import base64
import binascii
import os
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


# ---- videos -------------------------------------------------------------------------------------------------
# The containers a video may come in, recognised by their first bytes and then opened with that demuxer alone:
# each reads only the bytes it is given. Never FFmpeg's probing, which would also take playlists (HLS, DASH),
# concat lists and image-sequence patterns: demuxers that open the files and URLs named inside the data (a
# client's "video" would make the server decode its local files).
VIDEO_CONTAINERS = "MP4/MOV, WebM/Matroska, AVI, MPEG-TS, MPEG-PS, Ogg, FLV or GIF"
_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot")


def video_container(head: bytes) -> str | None:
    """FFmpeg's demuxer name for a video whose data starts with `head` (>= 1 KB of it where there is that much),
    or None when it is none of VIDEO_CONTAINERS."""
    if head[4:8] in _MP4_BOXES:
        return "mov"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "matroska"
    if head.startswith(b"RIFF") and head[8:12] == b"AVI ":
        return "avi"
    if head.startswith(b"OggS"):
        return "ogg"
    if head.startswith(b"FLV\x01"):
        return "flv"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "gif"
    if head.startswith(b"\x00\x00\x01\xba"):
        return "mpeg"
    if len(head) > 376 and head[0] == head[188] == head[376] == 0x47:
        return "mpegts"
    return None


def open_video(source: Path | bytes, where: str) -> Any:
    """A PyAV input container over a video file (`source` a Path) or its bytes, opened with the demuxer its
    first bytes name (see VIDEO_CONTAINERS) and a protocol whitelist that lets it open nothing else.
    ValueError naming `where` when the data is not such a video or FFmpeg cannot open it."""
    import io

    import av

    if isinstance(source, Path):
        try:
            with open(source, "rb") as f:
                head = f.read(1024)
        except OSError as e:
            raise ValueError(f"cannot read {where}: {e}") from None
    else:
        head = bytes(source[:1024])
    name = video_container(head)
    if name is None:
        raise ValueError(f"{where} is not a video this engine reads: it takes {VIDEO_CONTAINERS} data, never "
                         "playlists (HLS, DASH) or concat lists")
    # the file protocol only to open the file itself; drefs (an MP4's references to other files) stay off
    options = {"protocol_whitelist": "file" if isinstance(source, Path) else "none", "enable_drefs": "0"}
    try:
        return av.open(str(source) if isinstance(source, Path) else io.BytesIO(source), format=name,
                       options=options)
    except (av.FFmpegError, OSError, ValueError) as e:
        raise ValueError(f"{where} is not a readable video: {e}") from None


def video_source(data: Any) -> tuple[Path | bytes, str]:
    """A video given as a file path (str or Path), encoded bytes or a base64 data: URL -> (the Path or the bytes,
    how errors name it). ValueError for URLs that would need the network, missing files and other types."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data), "the video bytes"
    if isinstance(data, str) and data.strip().lower().startswith("data:"):
        return data_url_bytes(data), "the video's data: URL"
    if isinstance(data, str) and data.strip().lower().startswith(("http://", "https://")):
        raise ValueError(f"video URL {data.strip()[:80]!r} not fetched: no network access; pass a file path, bytes "
                         "or a data: URL")
    if not isinstance(data, (str, os.PathLike)):
        raise ValueError(f"a video is given by its file path, bytes or a data: URL, got a {type(data).__name__}")
    p = Path(data).expanduser()
    if not p.is_file():
        raise ValueError(f"video file {str(data)!r} does not exist" if not p.exists()
                         else f"video path {str(data)!r} is not a file")
    return p, f"video file {str(data)!r}"
