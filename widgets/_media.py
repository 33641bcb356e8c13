"""What the views show of images and videos: small thumbnails, and radix keys read the way the engine reads them.

A radix key holds an image (video) as a run of pad ids, hundreds of them, all equal to one content-hash id
(sgnb.engine.media). The views label a key with the engine's own `key_text` / `key_media` (what
`Engine.tree_snapshot` shows: "[image]" once per image, and the image's kind, short hash, thumbnail and token
count), so the notebook widget, the lab panel and the snapshot agree. A label's token budget counts an image as
one token, so the text after an image stays in the label.

Thumbnails travel in synced traits (saved with the notebook) and in every panel snapshot, so they are shrunk to
small JPEGs here, whatever size arrives. Pillow is imported only when an image is actually shown.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
from pathlib import Path
from typing import Any

THUMB_PX = 72  # an image in a ProgramView (drawn 48 px high)
FRAME_PX = 48  # one frame of a ProgramView's video strip (drawn 36 px high)
CHIP_PX = 48  # a tree node's chip (drawn 28 px; more pixels for a high-DPI screen)
MAX_FRAMES = 16  # frames kept per video strip
_MAX_SOURCE_BYTES = 8 << 20  # a larger data: URL or file is not decoded for a thumbnail


def small_image(source: Any, px: int) -> str:
    """A JPEG data: URL of the image `source` (a data: URL or a file path) shrunk to fit px x px, or "" when it
    is not an image pillow reads (a video file, a URL, text)."""
    if not isinstance(source, str) or not source:
        return ""
    if source.startswith("data:"):
        return _shrink_data_url(source, px)
    try:
        p = Path(source)
        if not p.is_file() or p.stat().st_size > _MAX_SOURCE_BYTES:
            return ""
        return _jpeg(p.read_bytes(), px)
    except (OSError, ValueError):
        return ""


@functools.lru_cache(maxsize=512)
def _shrink_data_url(url: str, px: int) -> str:
    # cached: the tree views ask for the same image's chip at every sync
    head, _, data = url.partition(",")
    if not head.startswith("data:image/") or not head.endswith(";base64") or len(data) > _MAX_SOURCE_BYTES:
        return ""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return ""
    return _jpeg(raw, px)


def _jpeg(raw: bytes, px: int) -> str:
    try:
        from PIL import Image

        with Image.open(io.BytesIO(raw)) as src:
            src.draft("RGB", (px, px))  # JPEG sources decode at a reduced scale
            im = src.convert("RGB")
            im.thumbnail((px, px))
            buf = io.BytesIO()
            im.save(buf, format="JPEG", quality=75)
    except Exception:  # not an image pillow reads (a video, truncated bytes): the view shows a name instead
        return ""
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


# ---- radix keys -------------------------------------------------------------------------------------------
def _pad_base() -> int:
    from sgnb.engine.media import PAD_BASE  # lazy: only a view over a live engine gets here (torch is loaded)

    return PAD_BASE


def key_text(engine: Any, ids: list[int]) -> str:
    """A run of key ids as text, each image's (video's) pad ids as one "[image]" ("[video]")."""
    text_of = getattr(engine, "key_text", None)
    if text_of is not None:
        return str(text_of(ids))
    return str(engine.tokenizer.decode(ids, False))  # an engine that knows no images (test doubles)


def key_label(engine: Any, key: list[int], limit: int, px: int | None = CHIP_PX) -> tuple[str, list[dict]]:
    """A radix key's label and media: the text of its first `limit` tokens, where an image's whole run of pad
    ids counts as one token (so the text after it shows), and one entry per image or video anywhere in the
    key: {"kind", "hash", "tokens" (its pad ids in this key), "thumbnail"} with the thumbnail shrunk to `px`
    (None: the engine's own, up to 96 px). Reads `key` only (a live node's key is replaced, never mutated)."""
    if not key or max(key) < _pad_base():  # the common case: a C-speed scan, no Python loop
        return key_text(engine, list(key[:limit])), []
    pad_base = _pad_base()
    short: list[int] = []  # the key with each pad run cut to one id, up to `limit` ids
    last = None
    for t in key:
        if t >= pad_base and t == last:
            continue
        last = t
        short.append(t)
        if len(short) >= limit:
            break
    return key_text(engine, short), key_media(engine, key, px)


def key_media(engine: Any, key: list[int], px: int | None = CHIP_PX) -> list[dict]:
    """The images / videos a key holds (see `key_label`); [] for an engine that knows no images."""
    media_of = getattr(engine, "key_media", None)
    if media_of is None:
        return []
    out = []
    for m in media_of(list(key)):
        thumb = m.get("thumbnail") or ""
        out.append({"kind": m.get("kind", "image"), "hash": m.get("hash", ""), "tokens": int(m.get("tokens", 0)),
                    "thumbnail": small_image(thumb, px) if px is not None else thumb})
    return out
