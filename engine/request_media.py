"""A request's images and videos, for one engine: loaded and checked in the caller's thread, placed in its ids.

`RequestMedia.items` loads and preprocesses a prompt's images and videos (errors name the item); `place` puts
each item's run of pad ids where the prompt holds its image (video) token (engine/media.py's `expand`) and
checks the result against the prompt limit. Each placed item is remembered under its pad id, with what views show
for it (kind, short hash, thumbnail; the latest 4,096 items): `shown` reads that back, for token texts and the
tree's views. `check_media_tokens` runs before the weights load: the tokenizer must know the model's tokens.

Thread-safe: the processor is made once under the lock and writes of the shown items take it; a read of one item
is a single dict read and takes none.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from sgnb.engine.sampling_params import is_strict_int

log = logging.getLogger("sgnb.engine")
SHOWN_ITEMS = 4096  # the placed items whose view info is kept (older pad ids read as a plain "[image]")


def check_media_tokens(source: Any, tokenizer: Any) -> None:
    """The tokenizer must turn the image (video) token text into the model's image (video) token id; a dummy
    model's borrowed tokenizer gets them added."""
    vs = source.config.vision
    assert vs is not None  # called for multimodal models only
    for text, want in ((vs.image_token, vs.image_token_index), (vs.video_token, vs.video_token_index)):
        if text is None or want is None:
            continue
        got = tokenizer.token_to_id(text)
        if got is None and source.dummy and tokenizer.vocab_size == want:
            got = tokenizer.add_special_token(text)  # the next free id is the model's
        if got == want:
            continue
        if not source.dummy:
            raise ValueError(f"{source.name}: the tokenizer maps {text!r} to {got}, the model expects "
                             f"token id {want}")
        # a dummy of a real shape (e.g. llava-1.5-7b, vocab 32064) cannot take SmolLM2's text anyway:
        # such benchmarks pass input_ids that hold the model's image token id
        log.info("%s: %r is not a token of the borrowed tokenizer; put id %d in input_ids where an image "
                 "goes", source.name, text, want)


class RequestMedia:
    """One engine's request media: loading, checks, placement, and what views show for each pad id."""

    def __init__(self, source: Any, max_image_pixels: int, max_video_frames: int, prompt_limit: int) -> None:
        """`prompt_limit`: a prompt holds fewer tokens (the context length or the KV pool, the smaller)."""
        self.source = source
        self.vision = getattr(source.config, "vision", None)  # None for text-only models
        self.max_image_pixels = max_image_pixels
        self.max_video_frames = max_video_frames
        self.prompt_limit = prompt_limit
        self._processor: Any = None
        self._shown: OrderedDict[int, dict[str, Any]] = OrderedDict()  # pad id -> what views show for it
        self._lock = threading.Lock()

    def processor(self) -> Any:
        """Image / video loading and preprocessing for this model (made on first use)."""
        with self._lock:
            if self._processor is None:
                from sgnb.engine.multimodal import MultimodalProcessor

                self._processor = MultimodalProcessor(self.source, self.max_image_pixels, self.max_video_frames)
            return self._processor

    def shown(self, pad: int) -> dict[str, Any] | None:
        """What views show for the item of pad id `pad` ({"kind", "hash", "thumbnail"}), None when unknown."""
        return self._shown.get(pad)

    @property
    def any_shown(self) -> bool:
        return bool(self._shown)

    def items(self, image_data: Any, video_data: Any) -> list[Any]:
        """Load and preprocess one prompt's images and videos (in this thread, not the scheduler's). Errors
        name the item."""
        from sgnb.engine.media import media_of, video_args

        images, videos = media_of(image_data, "image"), media_of(video_data, "video")
        if not images and not videos:
            return []
        if self.vision is None:
            raise ValueError(f"{self.source.name} is a text-only model: it takes no images or videos")
        proc = self.processor()
        items = []
        for n, data in enumerate(images):
            try:
                items.append(proc.image(data))
            except ValueError as e:
                raise ValueError(f"image {n + 1} of {len(images)}: {e}") from None
        for n, spec in enumerate(videos):
            if self.vision.video_token is None:
                raise ValueError(f"{self.source.name} takes images but no videos")
            path, frames = video_args(spec)
            self._check_frames(frames, proc)
            try:
                items.append(proc.video(path, frames))
            except ValueError as e:
                raise ValueError(f"video {n + 1} of {len(videos)}: {e}") from None
        return items

    def _check_frames(self, frames: Any, proc: Any) -> None:
        """num_frames within max_video_frames and the context, before the video is opened."""
        if not is_strict_int(frames) or frames < 1:
            return  # the processor words that error
        most = self.max_video_frames
        if frames > most:
            raise ValueError(f"num_frames={frames}: at most {most} frames per video on this engine "
                             "(max_video_frames; sgnb serve --max-video-frames)")
        from sgnb.engine.multimodal import video_token_count

        tokens, limit = video_token_count(proc.spec, frames), self.prompt_limit
        if tokens >= limit:
            raise ValueError(f"num_frames={frames}: {tokens} video tokens, more than this engine takes in one prompt "
                             f"({limit - 1})")

    def place(self, ids: list[int], image_data: Any, video_data: Any,
              items: list[Any] | None = None) -> tuple[list[int], list[Any]]:
        """ids with each image / video token replaced by its pad ids, and where each item sits (`items`: the
        prompt's items loaded already, else loaded here from image_data / video_data)."""
        if items is None:
            items = self.items(image_data, video_data)
        vs = self.vision
        if not items:
            if vs is not None and (vs.image_token_index in ids or (vs.video_token_index is not None
                                                                   and vs.video_token_index in ids)):
                raise ValueError(f"the prompt holds the image/video token {vs.image_token!r} but no image was "
                                 "given (image_data= / video_data=, or sgl.image(...) in a program)")
            return ids, []
        from sgnb.engine.media import expand, pad_id

        assert vs is not None  # media were given and checked against the model
        ids, placements = expand(ids, items, vs.image_token_index, vs.video_token_index, vs.image_token,
                                 vs.video_token)
        limit = self.prompt_limit
        if len(ids) >= limit:
            raise ValueError(f"the prompt with its images has {len(ids)} tokens ("
                             f"{sum(p.item.num_tokens for p in placements)} of them image/video tokens); this "
                             f"engine takes at most {limit - 1}")
        with self._lock:
            for p in placements:
                self._shown[pad_id(p.item)] = {"kind": p.item.kind, "hash": p.item.hash[:12],
                                               "thumbnail": p.item.thumbnail}
                self._shown.move_to_end(pad_id(p.item))
            while len(self._shown) > SHOWN_ITEMS:
                self._shown.popitem(last=False)
        return ids, placements

    def trailing_items(self, ids: list[int], items: list[Any]) -> list[Any]:
        """The items whose tokens a suffix of the prompt holds (the last ones of each kind): an unconditional
        scoring context that starts on an image keeps that image."""
        if self.vision is None:
            return []
        vs = self.vision
        n_img = ids.count(vs.image_token_index)
        n_vid = ids.count(vs.video_token_index) if vs.video_token_index is not None else 0
        images = [it for it in items if it.kind == "image"]
        videos = [it for it in items if it.kind == "video"]
        return images[len(images) - n_img:] + videos[len(videos) - n_vid:]
