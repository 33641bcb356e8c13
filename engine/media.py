"""Images and videos inside requests: where they sit in the token sequence, how the radix cache keys them, and the
cache of their encoder outputs.

A prompt names each image (video) with the model's image (video) token, e.g. "<image>"; `expand` replaces each
such token by `item.num_tokens` copies of a *pad id* derived from the item's content hash. Those pad ids are the
radix-cache key of the image's KV: the same image after the same text hits the cache, a different image never
does. Pad ids lie above every vocabulary (>= PAD_BASE), so they can never be confused with a token: the model
never sees them (the scheduler puts a placeholder id in their place and the encoder's features in their rows),
penalties and prompt logprobs skip them.

`EncoderCache` keeps encoder outputs by content hash (LRU, bounded in bytes): a repeated image costs no second
vision-tower pass even after its KV was evicted. Only the scheduler thread uses it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sgnb.engine.multimodal import MMItem

PAD_BASE = 1 << 40  # pad ids are PAD_BASE + 48 bits of the content hash: far above any vocabulary
PLACEHOLDER_ID = 0  # what the model's embedding gets at an image row (then overwritten by the features)


def pad_id(item: MMItem) -> int:
    return PAD_BASE + int(item.hash[:12], 16)


def is_pad(token: int) -> bool:
    return token >= PAD_BASE


@dataclass(frozen=True)
class Placement:
    """One image or video in a request: its tokens are positions [offset, offset + item.num_tokens)."""

    item: MMItem
    offset: int

    @property
    def end(self) -> int:
        return self.offset + self.item.num_tokens


def expand(ids: list[int], items: list[MMItem], image_token: int, video_token: int | None,
           image_text: str, video_text: str | None) -> tuple[list[int], list[Placement]]:
    """Replace the n-th image (video) token of `ids` by the n-th image (video) item's pad ids. `items` is in
    prompt order per kind. Raises ValueError when the counts of tokens and items differ."""
    images = [it for it in items if it.kind == "image"]
    videos = [it for it in items if it.kind == "video"]
    n_img = sum(t == image_token for t in ids)
    n_vid = sum(t == video_token for t in ids) if video_token is not None else 0
    if n_img != len(images):
        raise ValueError(f"the prompt has {n_img} image token(s) {image_text!r} for {len(images)} image(s): put "
                         f"{image_text!r} in the text where each image goes")
    if n_vid != len(videos):
        where = f"{video_text!r} tokens" if video_text else "no video token (this model takes no videos)"
        raise ValueError(f"the prompt has {n_vid} video token(s) for {len(videos)} video(s): {where}")
    out: list[int] = []
    placements: list[Placement] = []
    next_image, next_video = iter(images), iter(videos)
    for t in ids:
        if t == image_token or (video_token is not None and t == video_token):
            item = next(next_image) if t == image_token else next(next_video)
            placements.append(Placement(item, len(out)))
            out.extend([pad_id(item)] * item.num_tokens)
        else:
            out.append(t)
    return out, placements


def media_of(items: Any, kind: str) -> list[Any]:
    """One prompt's image_data / video_data as a list (None -> [], one item -> [item])."""
    if items is None:
        return []
    if isinstance(items, (list, tuple)) and not (kind == "video" and _is_video_spec(items)):
        return list(items)
    return [items]


def _is_video_spec(x: Any) -> bool:
    """(path, num_frames): one video, not a list of two."""
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], int)


def video_args(spec: Any, default_frames: int = 8) -> tuple[Any, int]:
    """A video_data entry -> (the video, num_frames). The video is a file path, encoded bytes or a data: URL;
    the entry is the video, (video, num_frames), or {"path" (or "data"): video, "num_frames": n}."""
    if isinstance(spec, dict):
        if ("path" in spec) == ("data" in spec) or set(spec) - {"path", "data", "num_frames"}:
            raise ValueError("a video given as a dict is {'path' (or 'data'): the video, 'num_frames': n}, got "
                             f"the keys {sorted(spec)}")
        return spec.get("path", spec.get("data")), int(spec.get("num_frames", default_frames))
    if _is_video_spec(spec):
        return spec[0], spec[1]
    return spec, default_frames


class EncoderCache:
    """Encoder outputs by content hash, least recently used evicted first once over `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()

    def get(self, key: str) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: str, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if key in self._entries or size > self.max_bytes:
            return
        self._entries[key] = value
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()

    def __len__(self) -> int:
        return len(self._entries)
