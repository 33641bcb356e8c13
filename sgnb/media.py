"""Images and videos in programs: what `sgl.image(x)` / `sgl.video(path)` record, the thumbnails their events
carry, and the data: URLs that remote backends send.

- `Media` is one image or video of a program, as the program gave it; a state keeps them in the order they were
  added (forks and copies inherit them).
- `check_image` / `check_video` say at the primitive's line whether a value can be an image / a video at all.
- `thumbnail(media)` / `video_frames(media)` read the input once, so a file that is missing or not an image fails
  at the image() line, and give small PNG data: URLs for views, whatever form the input had.
- `data_url(media)` is the wire form: a data: URL (files are read and encoded here, by the client), or an
  http(s) URL as it is.
- `with_media_parts(messages, media, part)` splits chat messages on the markers chat backends write where an image
  or video is (IMAGE_MARKER, VIDEO_MARKER), into text parts and media parts.

Language side only: PIL (and PyAV for video frames) load on first use; nothing here imports torch or the engine.
Nothing here touches the network: http(s) URLs are passed on (a server may fetch them), never fetched.
"""

from __future__ import annotations

import base64
import functools
import io
import mimetypes
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sgnb.engine.image_io import data_url_bytes, image_from_array, open_video, read_file, video_source

THUMBNAIL_PX = 96
VIDEO_THUMBNAIL_FRAMES = 4
DEFAULT_NUM_FRAMES = 8
# what chat backends (OpenAI, Anthropic) write into a program's text where an image / a video is; each message's
# content is split on them again when it is sent
IMAGE_MARKER = "<image>"
VIDEO_MARKER = "<video>"
_MARKERS = re.compile(f"({re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)})")
# the image formats every API takes as they are; anything else is re-encoded as PNG
_SNIFF = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
          (b"GIF89a", "image/gif"))


@dataclass(frozen=True, eq=False)
class Media:
    """One image or video of a program. `data` is what the program gave: for an image a path (str or Path), a
    PIL image, a uint8 array (H, W, 3), encoded bytes, a data: URL or an http(s) URL; for a video a path or an
    http(s) URL. `num_frames`: the frames a video is sampled to. Compared by identity."""

    kind: str  # "image" | "video"
    data: Any
    num_frames: int | None = None


def is_url(data: Any) -> bool:
    return isinstance(data, str) and data.strip().lower().startswith(("http://", "https://"))


def is_data_url(data: Any) -> bool:
    return isinstance(data, str) and data.strip().lower().startswith("data:")


def _kind_of(data: Any) -> str:
    """"path", "url", "data_url", "bytes", "pil", "array" or "" (none of these)."""
    if isinstance(data, str):
        return "url" if is_url(data) else "data_url" if is_data_url(data) else "path"
    if isinstance(data, os.PathLike):
        return "path"
    if isinstance(data, (bytes, bytearray, memoryview)):
        return "bytes"
    module = type(data).__module__
    if module.startswith("PIL.") and hasattr(data, "save"):
        return "pil"
    if module == "numpy" and hasattr(data, "__array_interface__"):
        return "array"
    return ""


def check_image(data: Any) -> None:
    """Raise TypeError unless `data` has a form an image can have (its content is read when the program runs)."""
    if not _kind_of(data):
        raise TypeError(f"image() takes a path, a PIL image, a uint8 array (H, W, 3), encoded bytes, a data: URL "
                        f"or an http(s) URL; got a {type(data).__name__}")
    if isinstance(data, str) and not data.strip():
        raise ValueError("image() got an empty string")


def check_video(data: Any, num_frames: Any) -> None:
    if _kind_of(data) not in ("path", "url"):
        raise TypeError(f"video() takes the video's file path (or an http(s) URL); got a {type(data).__name__}")
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
        raise ValueError(f"video num_frames must be an int >= 1, got {num_frames!r}")


def describe(media: Media) -> str:
    """A short label for views and messages: the path or URL, else what the value is."""
    data, kind = media.data, _kind_of(media.data)
    if kind in ("path", "url"):
        return str(data)[:200]
    if kind == "data_url":
        return f"{str(data)[:30]}... ({len(data)} chars)"
    if kind == "bytes":
        return f"{len(data)} bytes"
    if kind == "pil":
        return f"PIL image {data.width}x{data.height}"
    return f"array {'x'.join(str(n) for n in data.shape)} {data.dtype}"


# ---- reading -------------------------------------------------------------------------------------------------
def _encoded(data: Any) -> bytes | None:
    """The encoded file bytes of an image given as a path, bytes or a data: URL (None for PIL images / arrays)."""
    kind = _kind_of(data)
    if kind == "path":
        return read_file(data, "image")
    if kind == "data_url":
        return data_url_bytes(data)
    if kind == "bytes":
        return bytes(data)
    return None


def open_image(data: Any, draft: int | None = None) -> Any:
    """`data` as an RGB PIL image (not for URLs). `draft`: a size the caller will shrink to, so a JPEG may decode
    at a fraction of its size. Raises ValueError naming what is wrong."""
    from PIL import Image

    kind = _kind_of(data)
    if kind == "pil":
        img = data
    elif kind == "array":
        img = image_from_array(data)
    else:
        raw = _encoded(data)
        if raw is None:
            raise ValueError(f"cannot read an image from {describe(Media('image', data))}")
        what = f"image file {str(data)!r}" if kind == "path" else "the data: URL" if kind == "data_url" \
            else "the image bytes"
        try:
            img = Image.open(io.BytesIO(raw))
            if draft is not None:
                img.draft("RGB", (draft, draft))  # JPEG: decode at a reduced scale
            img.load()
        except (Image.DecompressionBombError, OSError, SyntaxError, ValueError) as e:
            raise ValueError(f"{what} is not a readable image ({len(raw)} bytes): {e}") from None
    try:  # as the engine reads images: EXIF orientation applied, transparency composited onto white
        from PIL import ImageOps

        img = ImageOps.exif_transpose(img)
        if "A" in img.getbands() or "transparency" in img.info:
            rgba = img.convert("RGBA")
            return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
        return img if img.mode == "RGB" else img.convert("RGB")
    except (OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"the image cannot be decoded: {e}") from None


def _png_url(img: Any) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _small(img: Any, px: int) -> str:
    small = img.copy()
    small.thumbnail((px, px))
    return _png_url(small)


def thumbnail(media: Media, px: int = THUMBNAIL_PX) -> str | None:
    """A PNG data: URL of the image (a video's first frame) at most `px` on a side; None for an http(s) URL (not
    fetched). Reads the input: raises ValueError when it is not a readable image (video)."""
    if is_url(media.data):
        return None
    if media.kind == "video":
        frames = video_frames(media, 1, px)
        return frames[0] if frames else None
    return _small(open_image(media.data, draft=2 * px), px)


def video_frames(media: Media, count: int = VIDEO_THUMBNAIL_FRAMES, px: int = THUMBNAIL_PX) -> list[str]:
    """PNG data: URLs of `count` frames spread over the video (first to last), at most `px` on a side; [] for an
    http(s) URL. Raises ValueError when the file is missing, not a video, or has no frames."""
    if is_url(media.data):
        return []
    import av

    source, where = video_source(media.data)
    with open_video(source, where) as container:
        if not container.streams.video:
            raise ValueError(f"{where} has no video stream")
        try:
            frames = _spread_frames(container, container.streams.video[0], count)
        except (av.FFmpegError, OSError) as e:
            raise ValueError(f"{where} is not a readable video: {e}") from None
    if not frames:
        raise ValueError(f"{where} has no frames")
    return [_small(f.to_image(), px) for f in frames]


def _spread_frames(container: Any, stream: Any, count: int) -> list[Any]:
    """About `count` frames from first to last, by seeking (a thumbnail costs a keyframe interval of decoding,
    not the whole video); the first `count` frames when the stream has no duration or cannot seek."""
    import av

    duration, start = stream.duration, stream.start_time or 0
    if duration and count > 1:
        try:
            got = []
            for i in range(count):
                target = start + (duration - 1) * i // (count - 1)
                container.seek(target, stream=stream)  # the keyframe at or before target
                last = None
                for last in container.decode(stream):
                    if last.pts is None or last.pts >= target:
                        break
                if last is not None:  # (the stream may end before the last target: its last frame)
                    got.append(last)
            if got:
                return got
        except av.FFmpegError:
            container.seek(0)
    return [frame for _, frame in zip(range(count), container.decode(stream))]


# ---- the wire ------------------------------------------------------------------------------------------------
def _mime(raw: bytes) -> str | None:
    for magic, mime in _SNIFF:
        if raw.startswith(magic):
            return mime
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "image/webp"
    return None


@functools.lru_cache(maxsize=16)
def data_url(media: Media) -> str:
    """What a remote backend sends for `media`: an http(s) or data: URL as it is; else a data: URL of the file's
    (the bytes') own encoding when it is PNG, JPEG, GIF or WebP, of a PNG otherwise (PIL images, arrays, other
    formats). Videos: the file's bytes, typed by its suffix. Cached for the last few items (a program sends its
    images with every gen)."""
    data = media.data
    if is_url(data) or is_data_url(data):
        return str(data).strip()
    if media.kind == "video":
        mime = mimetypes.guess_type(str(data))[0] or "video/mp4"
        return f"data:{mime};base64," + base64.b64encode(read_file(data, "video")).decode()
    raw = _encoded(data)
    sniffed = _mime(raw) if raw is not None else None
    if raw is not None and sniffed is not None:
        return f"data:{sniffed};base64," + base64.b64encode(raw).decode()
    return _png_url(open_image(data))


def split_data_url(url: str) -> tuple[str, str]:
    """A base64 data: URL -> (media type, base64 payload)."""
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().startswith("data:") or not header.lower().endswith(";base64"):
        raise ValueError(f"not a base64 data: URL: {url[:40]!r}")
    return header[5:-7] or "application/octet-stream", payload


def with_media_parts(messages: list[dict[str, Any]], media: list[Media],
                     part: Callable[[Media], dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each content that holds IMAGE_MARKER / VIDEO_MARKER as a list of parts: {"type": "text",
    "text": ...} for the text between markers (empty text left out) and part(m) for each marker's item. The n-th
    image marker over all messages is the n-th image of `media`, videos alike. Raises ValueError when the markers
    and the items do not pair up."""
    queues = {kind: [m for m in media if m.kind == kind] for kind in ("image", "video")}
    used = {"image": 0, "video": 0}
    out = []
    for msg in messages:
        content = msg.get("content")
        if not isinstance(content, str) or not _MARKERS.search(content):
            out.append(msg)
            continue
        parts: list[dict[str, Any]] = []
        for piece in _MARKERS.split(content):
            kind = "image" if piece == IMAGE_MARKER else "video" if piece == VIDEO_MARKER else None
            if kind is None:
                if piece:
                    parts.append({"type": "text", "text": piece})
                continue
            if used[kind] >= len(queues[kind]):
                raise ValueError(f"the messages hold more {piece!r} markers than the program has {kind}s: write "
                                 f"{piece!r} only through sgl.{kind}()")
            parts.append(part(queues[kind][used[kind]]))
            used[kind] += 1
        out.append({**msg, "content": parts})
    for kind, items in queues.items():
        if used[kind] < len(items):
            raise ValueError(f"{len(items) - used[kind]} {kind}(s) of the program are outside every chat message: "
                             f"a chat model gets only messages, so put sgl.{kind}() inside a role, e.g. "
                             f"user(sgl.{kind}(...) + 'question')")
    return out
