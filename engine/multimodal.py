"""Images and videos for LLaVA-family models: decoding, preprocessing, hashing, and how many prompt tokens each fills.

`MultimodalProcessor(source).image(data)` / `.video(path)` turn user input into an `MMItem`: the pixel values the
model's encoder takes (`LlavaForConditionalGeneration.encode`), the number of placeholder tokens the item
occupies in the prompt (= the encoder's feature rows), and a content hash for cache keys.

- Preprocessing is transformers' own image processor, built from the checkpoint's preprocessor_config.json
  (or a dummy config's `sgnb_processor` settings), always its PIL backend: pixel values do not depend on
  whether torchvision is installed. Video frames are sampled uniformly with PyAV and each frame goes through
  the video processor's settings (resize the shortest edge, center crop, rescale, normalize) with the PIL
  backend too (transformers' own video processors need torchvision).
- The anyres geometry of LLaVA-NeXT (which grid of tiles an image gets, how much of the padded grid is image)
  is defined here once: the processor counts tokens with it and the model packs its features with it.
- `MMItem.hash` digests the decoded RGB pixels (size included) with every setting that changes the pixel
  values or the token count, so the same image given as a path, PIL image, array, bytes or data: URL hashes
  equal.

Nothing here touches the network: http(s) URLs are refused.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sgnb.engine.image_io import data_url_bytes, image_from_array, open_video, read_file, video_source

if TYPE_CHECKING:
    from PIL import Image

    from sgnb.engine.model_config import VisionSpec
    from sgnb.engine.model_loader import ModelSource

THUMBNAIL_PX = 96
# Bump when decoding or sampling changes the pixels an item hashes (a cache must not reuse older features).
_PIPELINE_VERSION = 1
# The settings of a frame processor that transformers' CLIP image processor also takes.
_FRAME_KEYS = ("do_resize", "size", "resample", "do_center_crop", "crop_size", "do_rescale", "rescale_factor",
               "do_normalize", "image_mean", "image_std")


@dataclass(frozen=True, eq=False)
class MMItem:
    """One preprocessed image or video.

    - `kind`: "image" or "video".
    - `hash`: hex sha256 of the decoded pixels (frames) and the preprocessing settings.
    - `num_tokens`: placeholder tokens this item occupies in the prompt, = rows of `model.encode(item)`.
    - `pixel_values`: float32, (views, 3, S, S): LLaVA-1.5 one view; LLaVA-NeXT the base view then the tiles
      row by row; a video one view per sampled frame.
    - `extra`: "image_size" (height, width) of the decoded image; for videos "num_frames", "frame_indices",
      "total_frames".
    - `thumbnail`: a PNG data: URL at most THUMBNAIL_PX on a side (a video's first sampled frame), for views.
    Compared and hashed by identity (it holds a tensor); use `hash` for content.
    """

    kind: str
    hash: str
    num_tokens: int
    pixel_values: torch.Tensor
    extra: dict[str, Any] = field(default_factory=dict)
    thumbnail: str = ""


# ---- anyres geometry (LLaVA-NeXT) ---------------------------------------------------------------------------
def best_resolution(height: int, width: int, pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The (height, width) among `pinpoints` that keeps the most of the image's pixels once it is scaled to fit
    inside (never counting more than it has), then the one that wastes the least area."""
    best, kept_best, waste_best = pinpoints[0], -1, math.inf
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        waste = ph * pw - kept
        if kept > kept_best or (kept == kept_best and waste < waste_best):
            best, kept_best, waste_best = (ph, pw), kept, waste
    return best


def anyres_grid(spec: VisionSpec, height: int, width: int) -> tuple[int, int]:
    """(rows, cols) of tiles, each one tower view, that an image of this size is cut into."""
    assert spec.image_grid_pinpoints is not None, "anyres needs image_grid_pinpoints"
    gh, gw = best_resolution(height, width, spec.image_grid_pinpoints)
    return gh // spec.image_size, gw // spec.image_size


def unpad_window(height: int, width: int, rows: int, cols: int) -> tuple[int, int, int, int]:
    """(r0, r1, c0, c1): the part of a rows x cols feature grid that shows the image rather than the padding the
    processor added around it (the image was scaled to touch one pair of sides and centered on the other)."""
    if width / height > cols / rows:  # wider than the grid: full width, bands above and below
        kept = int(round(height * (cols / width), 7))
        pad = (rows - kept) // 2
        return pad, rows - pad, 0, cols
    kept = int(round(width * (rows / height), 7))
    pad = (cols - kept) // 2
    return 0, rows, pad, cols - pad


def image_token_count(spec: VisionSpec, height: int, width: int) -> int:
    """Placeholder tokens of one height x width image: LLaVA-1.5 one view; LLaVA-NeXT the base view, then the
    unpadded tile grid with one newline token after each of its rows."""
    if spec.kind == "llava":
        return spec.tokens_per_view
    rows, cols = anyres_grid(spec, height, width)
    side = spec.patches_per_side
    r0, r1, c0, c1 = unpad_window(height, width, rows * side, cols * side)
    return spec.tokens_per_view + (r1 - r0) * (c1 - c0 + 1)


def video_token_count(spec: VisionSpec, num_frames: int) -> int:
    """Placeholder tokens of a video: each frame's patch grid pooled by spatial_pool_stride (floor)."""
    assert spec.spatial_pool_stride is not None, "videos need a llava_next_video model"
    pooled = spec.patches_per_side // spec.spatial_pool_stride
    return num_frames * pooled * pooled


# ---- the processor ------------------------------------------------------------------------------------------
class MultimodalProcessor:
    """Turns images and videos into MMItems for one LLaVA-family model.

    Built from the model's source: its directory's preprocessor_config.json (and video_preprocessor_config.json
    for LLaVA-NeXT-Video, else the image processor's resize/crop/normalize settings serve for frames), or a
    dummy config's processor settings. Imports transformers and PyAV lazily. Thread-safety: image() and video()
    keep no state between calls, but transformers' processors are not documented thread-safe: use one thread.
    """

    def __init__(self, source: ModelSource, max_image_pixels: int | None = None,
                 max_video_frames: int | None = None) -> None:
        # what one image / video may cost (EngineConfig's limits): checked from headers before anything is decoded
        self.max_image_pixels = max_image_pixels
        self.max_video_frames = max_video_frames
        spec = source.config.vision
        if spec is None:
            raise ValueError(f"{source.name} is not a multimodal model: it takes no images or videos")
        self.spec = spec
        image_settings, video_settings = _processor_settings(source, spec)
        self._image_proc = _image_processor(image_settings)
        self._frame_proc = None if video_settings is None else _frame_processor(video_settings)
        geometry = {"kind": spec.kind, "image_size": spec.image_size, "patch_size": spec.patch_size,
                    "select_strategy": spec.select_strategy, "pinpoints": spec.image_grid_pinpoints,
                    "pool": [spec.spatial_pool_stride, spec.spatial_pool_mode], "version": _PIPELINE_VERSION}
        self._image_key = _digest({"model": geometry, "image": self._image_proc.to_dict()})
        self._video_key = None if self._frame_proc is None else _digest(
            {"model": geometry, "video": self._frame_proc.to_dict()})

    def image(self, data: Any) -> MMItem:
        """An image given as a path (str or Path), a PIL image, a uint8 array (H, W, 3), encoded bytes, or a
        "data:image/...;base64," URL. Raises ValueError for URLs that would need the network, missing or
        unreadable files, bytes that are not an image, and arrays of the wrong shape or dtype."""
        img = decode_image(data, self.max_image_pixels)
        height, width = img.height, img.width
        out = self._image_proc(images=[img], return_tensors="pt")
        pixels = out["pixel_values"]
        spec = self.spec
        if spec.kind == "llava":
            views = 1
        else:  # (images, views, 3, S, S); a single image is padded to no more views than its own
            pixels = pixels[0]
            rows, cols = anyres_grid(spec, height, width)
            views = 1 + rows * cols
        if tuple(pixels.shape) != (views, 3, spec.image_size, spec.image_size):
            raise ValueError(f"the image processor made pixel values of shape {tuple(pixels.shape)}, but the model "
                             f"takes {views} view(s) of 3 x {spec.image_size} x {spec.image_size}: its "
                             "preprocessor settings (size, crop_size, image_grid_pinpoints) disagree with config.json")
        h = hashlib.sha256(self._image_key.encode())
        h.update(f"image {width}x{height}".encode())
        h.update(img.tobytes())
        return MMItem(kind="image", hash=h.hexdigest(), num_tokens=image_token_count(spec, height, width),
                      pixel_values=pixels.float().contiguous(), extra={"image_size": (height, width)},
                      thumbnail=thumbnail(img))

    def video(self, data: Any, num_frames: int = 8) -> MMItem:
        """`num_frames` frames sampled uniformly (first to last; repeated when the video has fewer) from a
        video given as a file path, encoded bytes or a data: URL, decoded with PyAV. Raises ValueError when the
        model takes no videos, the file is missing or is not a video of a known container, has no video stream,
        no frames, or a codec that cannot be decoded."""
        if self._frame_proc is None:
            raise ValueError(f"a {self.spec.kind} model takes no videos (LLaVA-NeXT-Video does)")
        if isinstance(num_frames, bool) or not isinstance(num_frames, numbers.Integral) or num_frames < 1:
            raise ValueError(f"num_frames must be a positive int, got {num_frames!r}")
        num_frames = int(num_frames)
        if self.max_video_frames is not None and num_frames > self.max_video_frames:
            raise ValueError(f"num_frames={num_frames}: at most {self.max_video_frames} frames per video on this "
                             "engine (max_video_frames; sgnb serve --max-video-frames)")
        frames, indices, total = read_video(data, num_frames, self.max_image_pixels)
        from PIL import Image

        images = [Image.fromarray(f) for f in frames]
        pixels = self._frame_proc(images=images, return_tensors="pt")["pixel_values"]  # (F, 3, S, S)
        size = self.spec.image_size
        if tuple(pixels.shape[1:]) != (3, size, size):
            raise ValueError(f"the video processor made frames of shape {tuple(pixels.shape[1:])}, but the model "
                             f"takes 3 x {size} x {size}: its size/crop_size disagree with config.json")
        assert self._video_key is not None
        h = hashlib.sha256(self._video_key.encode())
        h.update(f"video {num_frames}".encode())
        for f in frames:
            h.update(f"{f.shape[1]}x{f.shape[0]}".encode())
            h.update(f.tobytes())
        return MMItem(kind="video", hash=h.hexdigest(), num_tokens=video_token_count(self.spec, len(frames)),
                      pixel_values=pixels.float().contiguous(),
                      extra={"num_frames": len(frames), "frame_indices": indices, "total_frames": total},
                      thumbnail=thumbnail(images[0]))


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _processor_settings(source: ModelSource, spec: VisionSpec) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(image processor settings, frame settings or None when the model takes no videos)."""
    if source.path is not None:
        image_file = source.path / "preprocessor_config.json"
        if not image_file.is_file():
            raise ValueError(f"{source.name}: {str(source.path)!r} has no preprocessor_config.json, which a "
                             "multimodal model needs (save its image processor with save_pretrained)")
        image = json.loads(image_file.read_text())
        video_file = source.path / "video_preprocessor_config.json"
        video = json.loads(video_file.read_text()) if video_file.is_file() else image
    else:
        settings = spec.processor_settings
        if not settings or "image_processor" not in settings:
            raise ValueError(f"{source.name}: a dummy multimodal config needs 'sgnb_processor': "
                             '{"image_processor": {...}} (preprocessor_config.json settings)')
        image = settings["image_processor"]
        video = settings.get("video_processor", image)
    return image, (video if spec.kind == "llava_next_video" else None)


def _image_processor(settings: dict[str, Any]) -> Any:
    """transformers' image processor named by settings["image_processor_type"], PIL backend."""
    from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name

    name = settings.get("image_processor_type")
    if not name:
        raise ValueError("the preprocessor settings lack 'image_processor_type'")
    base = name.removesuffix("Fast").removesuffix("Pil")
    cls = get_image_processor_class_from_name(base + "Pil")
    if cls is None:
        raise ValueError(f"transformers has no PIL image processor for {name!r}")
    return cls.from_dict({k: v for k, v in settings.items() if k not in ("image_processor_type", "processor_class")})


def _frame_processor(settings: dict[str, Any]) -> Any:
    """A CLIP-style image processor (resize the shortest edge, center crop, rescale, normalize) with a video
    processor's settings: what LLaVA-NeXT-Video's video processor does to each frame."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(**{k: settings[k] for k in _FRAME_KEYS if k in settings})


# ---- decoding -----------------------------------------------------------------------------------------------
def decode_image(data: Any, max_pixels: int | None = None) -> Image.Image:
    """`data` (see MultimodalProcessor.image) as an RGB PIL image: EXIF orientation applied and transparency
    composited onto white, as transformers' image loading does. Raises ValueError naming what was wrong; encoded
    data of more than `max_pixels` pixels (read from its header) is refused before it is decoded."""
    from PIL import Image, ImageOps

    def _open_bytes(raw: bytes, what: str) -> Image.Image:
        return _open_image(raw, what, max_pixels)

    if isinstance(data, Path):
        img = _open_bytes(read_file(data, "image"), f"image file {str(data)!r}")
    elif isinstance(data, str):
        text = data.strip()
        if text.lower().startswith(("http://", "https://")):
            raise ValueError(f"image URL {text[:80]!r} not fetched: no network access; pass a path, bytes or a "
                             "data: URL")
        if text.lower().startswith("data:"):
            img = _open_bytes(data_url_bytes(text), "the data: URL")
        else:
            img = _open_bytes(read_file(Path(text).expanduser(), "image"), f"image file {text!r}")
    elif isinstance(data, (bytes, bytearray, memoryview)):
        img = _open_bytes(bytes(data), "the image bytes")
    elif isinstance(data, Image.Image):
        img = data
    elif isinstance(data, np.ndarray):
        img = image_from_array(data)
    else:
        raise ValueError(f"cannot read an image from a {type(data).__name__}: pass a path, PIL image, uint8 array "
                         "(H, W, 3), encoded bytes or a data: URL")
    try:  # a PIL image opened lazily by the caller is decoded only here
        img = ImageOps.exif_transpose(img)
        if "A" in img.getbands() or "transparency" in img.info:
            rgba = img.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return img if img.mode == "RGB" else img.convert("RGB")
    except (OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"the image cannot be decoded: {e}") from None


def _open_image(raw: bytes, what: str, max_pixels: int | None) -> Image.Image:
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(raw))  # reads the header only
        _check_pixels(img.width, img.height, max_pixels, what)
        img.load()  # decode now: a truncated file fails here, not inside the processor
    except Image.DecompressionBombError as e:  # Pillow's own limit, past twice its MAX_IMAGE_PIXELS
        if max_pixels is not None:
            raise ValueError(f"{what}: over this engine's limit of {max_pixels:,} pixels per image "
                             f"(max_image_pixels; sgnb serve --max-image-pixels): {e}") from None
        raise ValueError(f"{what} is not a readable image ({len(raw)} bytes): {e}") from None
    except (OSError, SyntaxError, ValueError) as e:
        if isinstance(e, _TooManyPixels):
            raise ValueError(str(e)) from None
        raise ValueError(f"{what} is not a readable image ({len(raw)} bytes): {e}") from None
    return img


class _TooManyPixels(ValueError):
    pass


def _check_pixels(width: int, height: int, max_pixels: int | None, what: str) -> None:
    if max_pixels is not None and width * height > max_pixels:
        raise _TooManyPixels(f"{what} is {width} x {height} = {width * height:,} pixels, over this engine's limit "
                             f"of {max_pixels:,} per image (max_image_pixels; sgnb serve --max-image-pixels)")


def thumbnail(img: Image.Image) -> str:
    """A PNG data: URL of `img` shrunk to fit THUMBNAIL_PX x THUMBNAIL_PX (aspect ratio kept)."""
    small = img.copy()
    small.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX))
    buf = io.BytesIO()
    small.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def uniform_indices(total: int, num_frames: int) -> list[int]:
    """`num_frames` frame indices spread evenly from the first frame to the last (repeats when total is less)."""
    return np.linspace(0, total - 1, num_frames).round().astype(int).tolist()


def read_video(data: Any, num_frames: int, max_pixels: int | None = None) -> tuple[list[np.ndarray], list[int], int]:
    """(frames as uint8 (H, W, 3) RGB arrays, their indices, the video's frame count) of a video given as a file
    path, bytes or a data: URL (`image_io.video_source`; opened with `image_io.open_video`: known containers
    only, nothing they name is opened).

    Uses the container's frame count when it has one (one decoding pass that keeps only the sampled frames),
    else counts the frames first. Raises ValueError for every way the input can fail to give frames, and (before
    any frame is decoded) for frames of more than `max_pixels` pixels as the container states their size."""
    source, where = video_source(data)
    declared = _video_frames(source, where, None, max_pixels)[1]
    total = declared if declared > 0 else _video_frames(source, where, [], max_pixels)[2]
    if total == 0:
        raise ValueError(f"{where} has no frames")
    indices = uniform_indices(total, num_frames)
    frames, _, seen = _video_frames(source, where, indices, max_pixels)
    if len(frames) < len(indices):  # the container declared more frames than it holds: sample what is there
        if seen == 0:
            raise ValueError(f"{where} has no frames")
        total, indices = seen, uniform_indices(seen, num_frames)
        frames, _, _ = _video_frames(source, where, indices, max_pixels)
    return frames, indices, total


def _video_frames(source: Path | bytes, where: str, wanted: list[int] | None,
                  max_pixels: int | None = None) -> tuple[list[np.ndarray], int, int]:
    """Open the video and return (the frames at `wanted`, in that order, the declared frame count (0: unknown),
    how many frames were decoded). wanted=None only opens and checks it (the frame size against `max_pixels`
    too); [] decodes every frame to count them."""
    import av

    with open_video(source, where) as container:
        if not container.streams.video:
            raise ValueError(f"{where} has no video stream")
        stream = container.streams.video[0]
        declared = int(stream.frames or 0)
        if wanted is None:
            if stream.codec_context is None:
                raise ValueError(f"{where}: no decoder for its video codec")
            try:
                _check_pixels(stream.codec_context.width, stream.codec_context.height, max_pixels, f"{where}'s frame")
            except _TooManyPixels as e:
                raise ValueError(str(e)) from None
            return [], declared, 0
        want = set(wanted)
        last = max(wanted) if wanted else None
        got: dict[int, np.ndarray] = {}
        seen = 0
        try:
            for i, frame in enumerate(container.decode(stream)):
                seen = i + 1
                if i in want:
                    _check_pixels(frame.width, frame.height, max_pixels, f"{where}'s frame {i}")  # size changes
                    got[i] = frame.to_ndarray(format="rgb24")  # (H, W, 3) uint8
                if last is not None and i >= last:
                    break
        except _TooManyPixels as e:
            raise ValueError(str(e)) from None
        except (av.FFmpegError, ValueError) as e:
            raise ValueError(f"{where} cannot be decoded: {e}") from None
    if not want:
        return [], declared, seen
    return [got[i] for i in wanted if i in got], declared, seen
