"""LLaVA-family vision-language models (llava-hf's LLaVA-1.5, LLaVA-NeXT, LLaVA-NeXT-Video) over our Llama.

One class for the three kinds (`cfg.vision.kind`): transformers' CLIP or SigLIP vision tower, built from the
checkpoint's vision_config (never from a hub name) and driven layer by layer here; a two-layer projector
(linear_1, activation, linear_2) into the language model's embedding space; and our LlamaForCausalLM.
`encode(item)` turns one preprocessed image or video (an MMItem from engine/multimodal.py) into
item.num_tokens rows of input embeddings; the engine puts them at the item's placeholder tokens
(fb.mm_rows / fb.mm_embeds) and the language model runs as for text.

- LLaVA-1.5: the tower's hidden states at `feature_layer` (several concatenated), class token dropped by the
  "default" strategy, projected: one row per patch.
- LLaVA-NeXT (anyres): the base view's rows, then the tiles' patch grids stitched into one grid, cropped to the
  image's aspect ratio (dropping the processor's padding) and followed by `image_newline` after each row.
- LLaVA-NeXT-Video: images as NeXT; each video frame one view whose patch grid is pooled (average or max over
  spatial_pool_stride x stride) before the projector.

The tower and projector run in the model's dtype (bf16 on GPU, like the language model); their outputs are in
that dtype too. Tensor parallelism is not supported: build with tp size 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sgnb.engine.forward_batch import ForwardBatch
from sgnb.engine.model_config import ModelConfig, VisionSpec
from sgnb.engine.models.llama import LlamaForCausalLM
from sgnb.engine.multimodal import MMItem, anyres_grid, unpad_window
from sgnb.engine.tensor_parallel import TPGroup

if TYPE_CHECKING:
    from collections.abc import Callable

# Views (tiles, frames) the tower encodes at once: bounds its activations for long videos.
VIEWS_PER_BATCH = 16
# Checkpoint prefixes of the parts of a llava-hf model; newer layouts nest them under "model.".
_PARTS = ("language_model.", "vision_tower.", "multi_modal_projector.", "image_newline")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": nn.functional.gelu,
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "quick_gelu": _quick_gelu,
    "relu": nn.functional.relu,
    "silu": nn.functional.silu,
}


class Projector(nn.Module):
    """Vision features -> language-model embeddings: linear_1, activation, linear_2 (HF's parameter names)."""

    def __init__(self, in_features: int, hidden: int, bias: bool, act: str) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden, bias=bias)
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def make_vision_tower(spec: VisionSpec) -> nn.Module:
    """transformers' vision model for the checkpoint's vision_config (CLIPVisionModel, SiglipVisionModel).
    Built wherever the caller's default device is (the meta device in build_model): no weights are fetched."""
    from transformers import AutoConfig, AutoModel

    vc = spec.vision_config
    config = AutoConfig.for_model(vc.pop("model_type"), **vc)
    return AutoModel.from_config(config, attn_implementation="sdpa")


class LlavaForConditionalGeneration(nn.Module):
    """A LLaVA-family model: vision tower + projector (+ image_newline for NeXT) + our Llama.

    Parameters are named as in HF: `language_model.*` (our Llama's names), `vision_tower.*` (transformers'),
    `multi_modal_projector.linear_{1,2}.*`, `image_newline`.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        if tp is not None and tp.size > 1:
            raise ValueError(f"{cfg.architecture} models do not support tensor parallelism: use tp_size=1 "
                             f"(got {tp.size})")
        if cfg.vision is None:
            raise ValueError(f"architecture {cfg.architecture!r} has no vision config")
        self.config = cfg
        self.spec = spec = cfg.vision
        self.language_model = LlamaForCausalLM(cfg, max_positions)
        self.vision_tower = make_vision_tower(spec)
        # transformers >= 5 puts CLIP's modules on the vision model itself; older ones under .vision_model
        # transformers' vision model (CLIP / SigLIP): untyped here
        self._body: Any = getattr(self.vision_tower, "vision_model", self.vision_tower)
        self._tower_prefix = "vision_tower.vision_model." if self._body is not self.vision_tower else "vision_tower."
        width = spec.vision_hidden_size * len(spec.feature_layers)
        self.multi_modal_projector = Projector(width, cfg.hidden_size, spec.projector_bias, spec.projector_act)
        self.image_newline: nn.Parameter | None = (
            None if spec.kind == "llava" else nn.Parameter(torch.empty(cfg.hidden_size)))
        self.pool: nn.Module | None = None
        if spec.kind == "llava_next_video":
            assert spec.spatial_pool_stride is not None
            pool = nn.AvgPool2d if spec.spatial_pool_mode == "average" else nn.MaxPool2d
            self.pool = pool(kernel_size=spec.spatial_pool_stride, stride=spec.spatial_pool_stride)

    @property
    def dtype(self) -> torch.dtype:
        return self.multi_modal_projector.linear_1.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.multi_modal_projector.linear_1.weight.device

    # ---- language model ------------------------------------------------------------------------------------
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states (T, hidden) of the batch's new tokens; rows fb.mm_rows take fb.mm_embeds."""
        return self.language_model(fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.language_model.compute_logits(hidden)

    # ---- encoder -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, item: MMItem) -> torch.Tensor:
        """(item.num_tokens, hidden) input embeddings of one image or video, in the model's dtype and device."""
        if item.kind == "image":
            out = self._encode_image(item)
        elif item.kind == "video":
            if self.pool is None:
                raise ValueError(f"a {self.spec.kind} model takes no videos")
            out = self._encode_video(item)
        else:
            raise ValueError(f"unknown item kind {item.kind!r} (expected 'image' or 'video')")
        if out.shape[0] != item.num_tokens:
            raise ValueError(f"the encoder made {out.shape[0]} feature rows for a {item.kind} that claims "
                             f"{item.num_tokens} tokens: was it preprocessed for another model?")
        return out

    def _features(self, pixels: torch.Tensor) -> torch.Tensor:
        """(V, 3, S, S) views -> (V, tokens_per_view, width): the tower's hidden states at the feature layers
        (0 = the embeddings), concatenated; the class token dropped by the "default" strategy. Layers past the
        deepest feature layer are not run (LLaVA reads the second-to-last)."""
        spec, body = self.spec, self._body
        wanted = spec.feature_layers
        chunks = []
        for views in pixels.to(self.device, self.dtype).split(VIEWS_PER_BATCH):
            h = body.embeddings(views)  # (v, tokens, D)
            if hasattr(body, "pre_layrnorm"):  # CLIP
                h = body.pre_layrnorm(h)
            states = {0: h}
            for i, layer in enumerate(body.encoder.layers[: max(wanted)], start=1):
                h = layer(h, None)
                states[i] = h
            x = torch.cat([states[i] for i in wanted], dim=-1)  # (v, tokens, D * len(wanted))
            chunks.append(x[:, 1:] if spec.select_strategy == "default" else x)
        return torch.cat(chunks)

    def _encode_image(self, item: MMItem) -> torch.Tensor:
        spec = self.spec
        feats = self.multi_modal_projector(self._features(item.pixel_values))  # (V, T, hidden)
        if spec.kind == "llava":
            return feats.flatten(0, 1)  # (T, hidden)
        height, width = item.extra["image_size"]
        rows, cols = anyres_grid(spec, height, width)
        side = spec.patches_per_side
        if feats.shape[0] != 1 + rows * cols:
            raise ValueError(f"a {height}x{width} image needs 1 + {rows}x{cols} views, the item has "
                             f"{feats.shape[0]}")
        base, tiles = feats[0], feats[1:]  # (T, hidden), (rows * cols, T, hidden)
        grid = (tiles.view(rows, cols, side, side, -1)  # (rows, cols, side, side, hidden)
                .permute(0, 2, 1, 3, 4)  # (rows, side, cols, side, hidden): patch rows of a tile row together
                .reshape(rows * side, cols * side, -1))  # (R, C, hidden)
        r0, r1, c0, c1 = unpad_window(height, width, rows * side, cols * side)
        grid = grid[r0:r1, c0:c1]  # (r, c, hidden)
        assert self.image_newline is not None
        newline = self.image_newline.to(grid.dtype).expand(grid.shape[0], 1, -1)  # (r, 1, hidden)
        grid = torch.cat([grid, newline], dim=1).flatten(0, 1)  # (r * (c + 1), hidden)
        return torch.cat([base, grid])  # (num_tokens, hidden)

    def _encode_video(self, item: MMItem) -> torch.Tensor:
        assert self.pool is not None
        x = self._features(item.pixel_values)  # (F, side * side, width)
        frames, side = x.shape[0], self.spec.patches_per_side
        x = x.view(frames, side, side, -1).permute(0, 3, 1, 2)  # (F, width, side, side)
        x = self.pool(x).flatten(2).transpose(1, 2)  # (F, pooled * pooled, width)
        return self.multi_modal_projector(x).flatten(0, 1)  # (F * pooled^2, hidden)

    # ---- weights -------------------------------------------------------------------------------------------
    def shard_hf(self, name: str, tensor: Any) -> torch.Tensor:
        """The whole tensor (a safetensors slice is read whole): LLaVA runs at tp size 1 only."""
        return tensor if isinstance(tensor, torch.Tensor) else tensor[:]

    def _vision_params(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters() if not n.startswith("language_model.")}

    def _split_name(self, name: str) -> tuple[str, str] | None:
        """("lm", the Llama's HF name) or ("vision", our parameter name) for a checkpoint tensor name, or None
        for tensors that are not weights. Accepts transformers 4/5's saved layout (language_model.model.*,
        language_model.lm_head.weight, vision_tower[.vision_model].*, multi_modal_projector.*, image_newline)
        and the newer one (model.language_model.*, model.vision_tower.*, model.multi_modal_projector.*,
        model.image_newline, lm_head.weight)."""
        n = name
        if n.startswith("model.") and n[len("model."):].startswith(_PARTS):
            n = n[len("model."):]
        if n.endswith(("position_ids", "rotary_emb.inv_freq")):
            return None  # buffers some checkpoints carry; rebuilt here
        if n == "lm_head.weight":
            return "lm", n
        if n.startswith("language_model."):
            rest = n[len("language_model."):]
            # a whole LlamaForCausalLM (model.*, lm_head.*) in the old layout; a bare LlamaModel in the new one
            return "lm", rest if rest.startswith(("model.", "lm_head.")) else "model." + rest
        if n.startswith("vision_tower."):
            return "vision", self._tower_prefix + n[len("vision_tower."):].removeprefix("vision_model.")
        if n.startswith("multi_modal_projector.") or n == "image_newline":
            return "vision", n
        raise ValueError(f"checkpoint has an unexpected tensor {name!r}")

    def load_hf_state_dict(self, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> None:
        """Adopt a llava-hf checkpoint's tensors (either key layout, see _split_name); works on a model built on
        the meta device. Every parameter must be given (lm_head may be tied); the tower, projector and
        image_newline take `dtype` too."""
        lm: dict[str, torch.Tensor] = {}
        vision: dict[str, torch.Tensor] = {}
        for name in list(state):
            split = self._split_name(name)
            if split is None:
                state.pop(name)
                continue
            part, ours = split
            (lm if part == "lm" else vision)[ours] = state.pop(name)
        own = self._vision_params()
        missing = [n for n in own if n not in vision]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} vision tensors, e.g. {missing[:3]}")
        unexpected = [n for n in vision if n not in own]
        if unexpected:
            raise ValueError(f"checkpoint has an unexpected tensor {unexpected[0]!r}")
        for n, t in vision.items():
            if tuple(t.shape) != tuple(own[n].shape):
                raise ValueError(f"{n}: checkpoint shape {tuple(t.shape)} != model {tuple(own[n].shape)}")
        self.language_model.load_hf_state_dict(lm, device, dtype)
        weights = {n: t.to(device=device, dtype=dtype) for n, t in vision.items()}
        self.load_state_dict(weights, strict=False, assign=True)
        self._rebuild_buffers(device)

    def init_dummy_weights(self, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        """Random weights of the real shape, made on the device: the language model as LlamaForCausalLM does;
        the vision side normal(0, 0.02) from its own seed, LayerNorms at weight 1 / bias 0, biases 0."""
        self.language_model.init_dummy_weights(device, dtype, seed)
        for part in (self.vision_tower, self.multi_modal_projector):
            part.to_empty(device=device)
            part.to(dtype)
        if self.image_newline is not None:
            self.image_newline = nn.Parameter(torch.empty_like(self.image_newline, device=device, dtype=dtype))
        norms = {id(p) for m in self.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()}
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + 999_983)
        with torch.no_grad():
            for name, p in self._vision_params().items():
                if id(p) in norms:
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02, generator=gen)
        self._rebuild_buffers(device)

    def _rebuild_buffers(self, device: torch.device) -> None:
        """The tower's non-persistent buffers are in no checkpoint, and meta construction or to_empty leaves
        them without values: set them again. CLIP and SigLIP have one kind, embeddings.position_ids."""
        for mod_name, module in self.vision_tower.named_modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                if name != "position_ids":
                    raise AssertionError(f"vision tower buffer {mod_name}.{name}: no rule to rebuild it")
                positions = torch.arange(buf.shape[-1], dtype=torch.int64, device=device)
                setattr(module, name, positions.expand(buf.shape))
