"""ModelConfig: the shape of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 3 text), read from (and
written as) HF config.json.

One frozen, hashable dataclass built once by the model loader and passed to the model, the KV pool and the
runner. It knows nothing of weights or devices; `from_hf_dict` is the only place HF's config conventions
(defaults, aliases, the transformers-5 `rope_parameters` form) are interpreted.

LLaVA-family models (llava-hf's LLaVA-1.5, LLaVA-NeXT, LLaVA-NeXT-Video) are the same decoder plus a
`VisionSpec`: the text fields are the language model's, `vision` holds everything about the image/video side.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# model_type -> the HF class name written into config.json "architectures".
_HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
               "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# MLP activations the models implement (the gate's; HF's hidden_act / hidden_activation names)
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# HF layer_types values: a layer attends to every earlier key, or to the last `sliding_window` ones
_LAYER_TYPES = ("full_attention", "sliding_attention")
# mixture-of-experts architectures (engine/models/moe.py)
_MOE_TYPES = ("mixtral", "qwen3_moe")
# RoPE variants the model implements; "default" is plain RoPE and is stored as rope_scaling=None.
_ROPE_TYPES = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
               "linear": ("factor",)}
# LLaVA model_type -> HF class. Their config.json nests the decoder under "text_config".
_MULTIMODAL_CLASSES = {"llava": "LlavaForConditionalGeneration", "llava_next": "LlavaNextForConditionalGeneration",
                       "llava_next_video": "LlavaNextVideoForConditionalGeneration"}
# transformers fills a partial text_config / vision_config from its config class's defaults (llava-hf's published
# config.json lists only what differs from them); these are those defaults, for the fields the engine reads.
_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
              "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-6, "sliding_window": 4096, "bos_token_id": 1, "eos_token_id": 2},
}
# Gemma3TextConfig's defaults (published Gemma 3 configs list only what differs from them)
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1,
    "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
}
_VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip_vision_model": {"image_size": 224, "patch_size": 32, "hidden_size": 768, "intermediate_size": 3072,
                          "num_hidden_layers": 12, "num_attention_heads": 12, "num_channels": 3,
                          "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5, "projection_dim": 512},
    "siglip_vision_model": {"image_size": 224, "patch_size": 16, "hidden_size": 768, "intermediate_size": 3072,
                            "num_hidden_layers": 12, "num_attention_heads": 12, "num_channels": 3,
                            "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "vision_use_head": True},
}
# keys that say nothing about the tower's inference (every transformers config carries the generic ones; the
# others only matter for training): dropped, and the defaults above filled in, so that a config.json and
# transformers' full to_dict() of it give equal (and equally hashed) specs
_GENERIC_CONFIG_KEYS = ("_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype",
                        "id2label", "label2id", "is_encoder_decoder", "output_attentions", "output_hidden_states",
                        "problem_type", "return_dict", "transformers_version", "_attn_implementation_autoset",
                        "initializer_range", "initializer_factor", "attention_dropout", "dropout")
_VISION_HAS_CLS = {"clip_vision_model": True, "siglip_vision_model": False}  # a class token before the patches
_PROJECTOR_ACTS = ("gelu", "gelu_pytorch_tanh", "gelu_new", "quick_gelu", "relu", "silu")
_DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))  # HF's LlavaNextConfig default


@dataclass(frozen=True)
class VisionSpec:
    """The image/video side of a LLaVA-family model (hashable: part of ModelConfig).

    Contract:
    - `kind` is the HF model_type: "llava" (one view per image), "llava_next" (anyres: a base view plus tiles
      on the best of `image_grid_pinpoints`, (height, width) pairs) or "llava_next_video" (anyres images, and
      videos whose frames are pooled with `spatial_pool_mode` over `spatial_pool_stride` patches).
    - `vision_config_json` is the HF vision_config as canonical JSON (sorted keys): every architectural field
      present (missing ones filled with transformers' defaults), training-only and generic keys dropped.
    - `feature_layer` indexes the tower's hidden states as transformers does (0 = the embeddings, -1 = the
      last layer); a tuple concatenates several along the feature dim. `select_strategy` "default" drops the
      class token, "full" keeps it.
    - `processor_json`: image/video preprocessing settings for models without a preprocessor_config.json
      (dummy models), as canonical JSON {"image_processor": {...}, "video_processor": {...}}; else None.
    - `text_architecture` is the decoder's model_type ("llama", "mistral"), for writing config.json back.
    """

    kind: str
    image_token_index: int
    vision_config_json: str
    text_architecture: str = "llama"
    video_token_index: int | None = None
    image_token: str = "<image>"
    video_token: str | None = None
    feature_layer: int | tuple[int, ...] = -2
    select_strategy: str = "default"
    projector_act: str = "gelu"
    projector_bias: bool = True
    image_grid_pinpoints: tuple[tuple[int, int], ...] | None = None
    spatial_pool_stride: int | None = None
    spatial_pool_mode: str | None = None
    processor_json: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in _MULTIMODAL_CLASSES:
            raise ValueError(f"unsupported multimodal kind {self.kind!r}; supported: {sorted(_MULTIMODAL_CLASSES)}")
        vc = json.loads(self.vision_config_json)
        vtype = vc.get("model_type", "clip_vision_model")
        if vtype not in _VISION_DEFAULTS:
            raise ValueError(f"unsupported vision tower {vtype!r}; supported: {sorted(_VISION_DEFAULTS)}")
        vc = {"model_type": vtype, **_VISION_DEFAULTS[vtype],
              **{k: v for k, v in vc.items() if k not in _GENERIC_CONFIG_KEYS}}
        object.__setattr__(self, "vision_config_json", json.dumps(vc, sort_keys=True))
        layer = self.feature_layer
        layer = int(layer) if isinstance(layer, int) else tuple(int(i) for i in layer)
        object.__setattr__(self, "feature_layer", layer)
        for i in (layer,) if isinstance(layer, int) else layer:
            if not -(self.num_vision_layers + 1) <= i <= self.num_vision_layers:
                raise ValueError(f"vision_feature_layer {i} is outside the tower's {self.num_vision_layers} layers")
        if self.select_strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full', got {self.select_strategy!r}")
        if self.select_strategy == "default" and not self.has_cls:
            raise ValueError(f"vision_feature_select_strategy 'default' drops a class token that {vtype} lacks")
        if self.projector_act not in _PROJECTOR_ACTS:
            raise ValueError(f"unsupported projector_hidden_act {self.projector_act!r}; supported: {_PROJECTOR_ACTS}")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.kind == "llava":
            object.__setattr__(self, "image_grid_pinpoints", None)
        else:
            pins = self.image_grid_pinpoints or _DEFAULT_PINPOINTS
            pins = tuple((int(h), int(w)) for h, w in pins)
            bad = [p for p in pins if p[0] % self.image_size or p[1] % self.image_size or min(p) <= 0]
            if bad:
                raise ValueError(f"image_grid_pinpoints {bad} are not positive multiples of the vision image_size "
                                 f"{self.image_size}")
            object.__setattr__(self, "image_grid_pinpoints", pins)
            if self.tokens_per_view != self.patches_per_side**2:
                raise ValueError("anyres (LLaVA-NeXT) features need one token per patch: use "
                                 "vision_feature_select_strategy 'default' with a CLIP tower, 'full' with SigLIP")
        if self.kind == "llava_next_video":
            if self.video_token_index is None:
                raise ValueError("llava_next_video needs a video_token_index")
            object.__setattr__(self, "video_token", self.video_token or "<video>")
            object.__setattr__(self, "spatial_pool_stride", int(self.spatial_pool_stride or 2))
            object.__setattr__(self, "spatial_pool_mode", self.spatial_pool_mode or "average")
            if self.spatial_pool_mode not in ("average", "max"):
                raise ValueError(f"spatial_pool_mode {self.spatial_pool_mode!r} is not supported ('average', 'max')")
        else:
            for name in ("video_token_index", "video_token", "spatial_pool_stride", "spatial_pool_mode"):
                object.__setattr__(self, name, None)
        if self.processor_json is not None:
            object.__setattr__(self, "processor_json", json.dumps(json.loads(self.processor_json), sort_keys=True))

    # ---- the tower's geometry ------------------------------------------------------------------------------
    @property
    def vision_config(self) -> dict[str, Any]:
        """A fresh dict of the HF vision_config."""
        return json.loads(self.vision_config_json)

    @property
    def vision_model_type(self) -> str:
        return str(self.vision_config["model_type"])

    @property
    def image_size(self) -> int:
        """Side of one square view the tower takes, in pixels."""
        return int(self.vision_config["image_size"])

    @property
    def patch_size(self) -> int:
        return int(self.vision_config["patch_size"])

    @property
    def vision_hidden_size(self) -> int:
        return int(self.vision_config["hidden_size"])

    @property
    def num_vision_layers(self) -> int:
        return int(self.vision_config["num_hidden_layers"])

    @property
    def has_cls(self) -> bool:
        return _VISION_HAS_CLS[self.vision_model_type]

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_view(self) -> int:
        """Feature rows of one view: the patches, plus the class token when the strategy keeps it."""
        return self.patches_per_side**2 + int(self.has_cls and self.select_strategy == "full")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """`feature_layer` as non-negative hidden-state indices (0 = the embeddings, L = the last layer)."""
        layers = (self.feature_layer,) if isinstance(self.feature_layer, int) else self.feature_layer
        return tuple(i % (self.num_vision_layers + 1) for i in layers)

    @property
    def processor_settings(self) -> dict[str, Any] | None:
        return None if self.processor_json is None else json.loads(self.processor_json)

    # ---- HF config.json ------------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], text_architecture: str) -> VisionSpec:
        """The vision part of a llava-hf config.json dict (see ModelConfig.from_hf_dict)."""
        kind = d["model_type"]
        layer = d.get("vision_feature_layer", -2)
        pins = d.get("image_grid_pinpoints")
        processor = d.get("sgnb_processor")
        return cls(
            kind=kind,
            image_token_index=int(_first(d, "image_token_index", "image_token_id",
                                         default=32001 if kind == "llava_next_video" else 32000)),
            video_token_index=(int(_first(d, "video_token_index", "video_token_id", default=32000))
                               if kind == "llava_next_video" else None),
            vision_config_json=json.dumps(dict(d.get("vision_config") or {})),
            text_architecture=text_architecture,
            image_token=d.get("sgnb_image_token", "<image>"),
            video_token=d.get("sgnb_video_token", "<video>") if kind == "llava_next_video" else None,
            feature_layer=int(layer) if isinstance(layer, int) else tuple(layer),
            select_strategy=d.get("vision_feature_select_strategy", "default"),
            projector_act=d.get("projector_hidden_act", "gelu"),
            projector_bias=bool(d.get("multimodal_projector_bias", True)),
            image_grid_pinpoints=None if pins is None else tuple(tuple(p) for p in pins),
            spatial_pool_stride=d.get("spatial_pool_stride"),
            spatial_pool_mode=d.get("spatial_pool_mode"),
            processor_json=None if processor is None else json.dumps(processor),
        )

    def hf_fields(self) -> dict[str, Any]:
        """The top-level config.json fields of this vision side (ModelConfig.to_hf_dict adds text_config)."""
        d: dict[str, Any] = {
            "image_token_index": self.image_token_index,
            "vision_config": self.vision_config,
            "vision_feature_layer": (self.feature_layer if isinstance(self.feature_layer, int)
                                     else list(self.feature_layer)),
            "vision_feature_select_strategy": self.select_strategy,
            "projector_hidden_act": self.projector_act,
            "multimodal_projector_bias": self.projector_bias,
        }
        if self.image_grid_pinpoints is not None:
            d["image_grid_pinpoints"] = [list(p) for p in self.image_grid_pinpoints]
        if self.kind == "llava_next_video":
            d |= {"video_token_index": self.video_token_index, "spatial_pool_mode": self.spatial_pool_mode,
                  "spatial_pool_stride": self.spatial_pool_stride}
            if self.video_token != "<video>":
                d["sgnb_video_token"] = self.video_token
        if self.image_token != "<image>":
            d["sgnb_image_token"] = self.image_token
        if self.processor_json is not None:
            d["sgnb_processor"] = json.loads(self.processor_json)
        return d


def _int_if_whole(x: Any) -> float | int:
    """x as an int when it is whole (transformers' config classes type such fields int), else a float."""
    return int(x) if float(x).is_integer() else float(x)


def _first(d: dict[str, Any], *keys: str, default: Any) -> Any:
    return next((d[k] for k in keys if d.get(k) is not None), default)


@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts side of a decoder (Mixtral, Qwen3-MoE); hashable, part of ModelConfig.

    Contract:
    - each token's router picks `top_k` of `num_experts` experts (softmax over all, then the top k); with
      `norm_topk_prob` their weights are renormalized to sum to 1 (Mixtral always; Qwen3-MoE per its config).
    - every expert is a SwiGLU MLP of width `intermediate_size` (HF's moe_intermediate_size for Qwen3-MoE; a
      dense layer keeps ModelConfig.intermediate_size).
    - `sparse_layers` lists the layers whose MLP is the expert block (Qwen3-MoE's decoder_sparse_step and
      mlp_only_layers, resolved); the others are dense.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.intermediate_size <= 0:
            raise ValueError(f"expert intermediate size must be positive, got {self.intermediate_size}")
        object.__setattr__(self, "sparse_layers", tuple(sorted(int(i) for i in self.sparse_layers)))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], model_type: str) -> MoESpec:
        layers = int(d["num_hidden_layers"])
        if model_type == "mixtral":
            return cls(num_experts=int(d.get("num_local_experts", 8)), top_k=int(d.get("num_experts_per_tok", 2)),
                       intermediate_size=int(d["intermediate_size"]), norm_topk_prob=True,
                       sparse_layers=tuple(range(layers)))
        # qwen3_moe; transformers 5 writes num_experts back as num_local_experts
        experts = int(_first(d, "num_experts", "num_local_experts", default=128))
        step = int(d.get("decoder_sparse_step", 1))
        dense = set(d.get("mlp_only_layers") or ())
        sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
        return cls(num_experts=experts, top_k=int(d.get("num_experts_per_tok", 8)),
                   intermediate_size=int(d.get("moe_intermediate_size", 768)),
                   norm_topk_prob=bool(d.get("norm_topk_prob", False)), sparse_layers=sparse)

    def hf_fields(self, model_type: str, num_layers: int) -> dict[str, Any]:
        """The config.json fields of this MoE side (ModelConfig.to_hf_dict adds them)."""
        if model_type == "mixtral":
            return {"num_local_experts": self.num_experts, "num_experts_per_tok": self.top_k}
        return {"num_experts": self.num_experts, "num_experts_per_tok": self.top_k,
                "moe_intermediate_size": self.intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i in range(num_layers) if i not in self.sparse_layers]}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a decoder-only transformer in the Llama family.

    Contract:
    - `architecture` is the HF model_type: "llama", "mistral" or "qwen2" (all three share one implementation).
    - `attention_bias` means q/k/v projections carry a bias (Qwen2); o_proj never has one here.
    - `rope_scaling` is None for plain RoPE, else a sorted tuple of (key, value) items that always contains
      "rope_type" ("llama3" or "linear") and that type's fields; a tuple keeps the config hashable.
      Use `rope_scaling_dict` for a fresh dict.
    - `sliding_window` W: a layer whose `layer_types` entry is "sliding_attention" attends to the last W keys
      only (its own position and the W - 1 before it, as transformers' mask); `layer_types` None means every
      layer is "sliding_attention" when sliding_window is set (Mistral), else "full_attention". The radix
      cache keeps whole prefixes; only the attention reads are windowed (`window_of`).
    - `qk_norm`: an RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3).
    - `hidden_act` is the MLP gate's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma).
    - `rope_local_theta`: the RoPE base of sliding-window layers when it differs from `rope_theta` (Gemma 3's
      local layers, which also take no rope scaling); None: every layer uses rope_theta / rope_scaling.
    - `query_pre_attn_scalar`: attention scores are scaled by its -1/2 power instead of head_dim's (Gemma 3).
    - "gemma3_text" also implies what its architecture hard-codes: (1 + w) RMSNorms, four norms per layer,
      embeddings scaled by sqrt(hidden_size).
    - `eos_token_ids` lists every id that ends generation, most important first.
    - Mixture of experts ("mixtral", "qwen3_moe"; `moe` is None for dense models): see MoESpec.
    - `quant_method` "fp8": the checkpoint stores e4m3 weights with scales (HF quantization_config), per tensor
      or per channel, or per 128x128 block when `weight_block_size` is (128, 128); None: unquantized.
    - `vision` is None for text models; for LLaVA-family models `architecture` is "llava", "llava_next" or
      "llava_next_video" (= vision.kind) and every other field describes the language model.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    vision: VisionSpec | None = None
    qk_norm: bool = False
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | int | None = None
    moe: MoESpec | None = None
    quant_method: str | None = None
    weight_block_size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.vision is not None:
            if self.architecture != self.vision.kind:
                raise ValueError(f"a {self.vision.kind} vision side needs architecture {self.vision.kind!r}, "
                                 f"got {self.architecture!r}")
        elif self.architecture not in _HF_CLASSES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: "
                             f"{sorted(_HF_CLASSES) + sorted(_MULTIMODAL_CLASSES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if (self.moe is not None) != (self.architecture in _MOE_TYPES):
            raise ValueError(f"architecture {self.architecture!r} {'needs' if self.moe is None else 'takes no'} "
                             "mixture-of-experts fields (ModelConfig.moe)")
        if self.moe is not None and any(i >= self.num_hidden_layers for i in self.moe.sparse_layers):
            raise ValueError(f"MoE layers {self.moe.sparse_layers} exceed the {self.num_hidden_layers} layers")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: {_ACTIVATIONS}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(str(t) for t in self.layer_types))
            bad = sorted(set(self.layer_types) - set(_LAYER_TYPES))
            if bad:
                raise ValueError(f"unsupported layer_types {bad}; supported: {_LAYER_TYPES}")
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types lists {len(self.layer_types)} layers, the model has "
                                 f"{self.num_hidden_layers}")
        # Normalise the containers so that equal configs compare and hash equal whatever the caller passed.
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", _normalize_rope_scaling(dict(self.rope_scaling)))

    # ---- derived sizes -------------------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        """Width of the q projection output: num_attention_heads * head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the k and v projection outputs: num_key_value_heads * head_dim."""
        return self.num_key_value_heads * self.head_dim

    def window_of(self, layer_id: int) -> int | None:
        """The sliding window of layer `layer_id` (the keys it reads: the last W), None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer_id] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return float(self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        """A fresh dict of the RoPE scaling fields (HF's names), or None for plain RoPE."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    # ---- HF config.json ------------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from an HF config.json dict (transformers 4.x or 5.x form).

        Infers head_dim = hidden_size // num_attention_heads when absent or null, num_key_value_heads =
        num_attention_heads when absent, and attention_bias=True for qwen2. Raises ValueError for features the
        engine does not implement (other activations, MLP bias, o_proj bias, unknown RoPE types), so a model
        never loads silently wrong. Unknown keys (e.g. "_comment", "torch_dtype") are ignored.

        llava-hf configs (model_type llava / llava_next / llava_next_video) nest the decoder under
        "text_config" (a partial one is completed with transformers' defaults for its model_type) and the tower
        under "vision_config"; they become a text config plus a VisionSpec.
        """
        model_type = d.get("model_type")
        if model_type is None:
            by_class = {v: k for k, v in (_HF_CLASSES | _MULTIMODAL_CLASSES).items()}
            model_type = next((by_class[a] for a in d.get("architectures") or () if a in by_class), None)
        if model_type in _MULTIMODAL_CLASSES:
            return cls._from_llava_dict({**d, "model_type": model_type})
        if model_type == "gemma3":  # Gemma 3 4B/12B/27B: the text decoder of the multimodal checkpoint
            return cls._from_gemma3_dict(d)
        if model_type not in _HF_CLASSES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(_HF_CLASSES)}")
        gemma = model_type == "gemma3_text"
        if gemma:
            d = {**_GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in d.items() if v is not None or k == "sliding_window"}}
            for key in ("final_logit_softcapping", "attn_logit_softcapping"):
                if d.get(key) is not None:
                    raise ValueError(f"{key} is not supported (Gemma 3 checkpoints leave it null)")
            if d.get("use_bidirectional_attention"):
                raise ValueError("use_bidirectional_attention=True (an embedding model) is not supported")
        act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}; implemented: {', '.join(_ACTIVATIONS)}")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if model_type == "qwen2":
            attention_bias = True  # Qwen2 hard-codes q/k/v bias (and no o_proj bias); config.json omits it
        elif d.get("attention_bias"):
            # In HF Llama/Mistral/Qwen3/Gemma 3, attention_bias also adds an o_proj bias, which the model lacks.
            raise ValueError(f"attention_bias=True is not supported for {model_type} (it implies an o_proj bias)")
        else:
            attention_bias = False

        heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or int(d["hidden_size"]) // heads
        # transformers >= 5 folds rope_theta and the scaling fields into one "rope_parameters" dict (Gemma 3:
        # one such dict per layer type)
        rope_params = dict(d.get("rope_parameters") or {})
        local_params: dict[str, Any] = {}
        if gemma and "full_attention" in rope_params:
            local_params = dict(rope_params.get("sliding_attention") or {})
            rope_params = dict(rope_params.get("full_attention") or {})
        theta: Any = d.get("rope_theta", rope_params.pop("rope_theta", 1_000_000.0 if gemma else 10000.0))
        rope_theta = float(theta)
        scaling = d.get("rope_scaling") or rope_params or None
        rope_local_theta = None
        if gemma:
            if local_params.get("rope_type", "default") != "default":
                raise ValueError("Gemma 3 sliding layers with rope scaling are not supported")
            rope_local_theta = float(d.get("rope_local_base_freq", local_params.get("rope_theta", 10000.0)))
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
        sliding_window = d.get("sliding_window")
        layer_types = d.get("layer_types")
        if model_type in ("qwen2", "qwen3", "qwen3_moe"):
            if not d.get("use_sliding_window", False):
                sliding_window, layer_types = None, None  # declared but disabled by default
            elif layer_types is None:  # transformers' rule: the layers from max_window_layers on use the window
                first = int(d.get("max_window_layers", 28))
                layer_types = ["sliding_attention" if i >= first else "full_attention"
                               for i in range(int(d["num_hidden_layers"]))]
        elif model_type in ("mistral", "mixtral"):
            layer_types = None  # every layer, when a window is declared
        elif model_type == "llama":
            sliding_window, layer_types = None, None
        elif gemma and layer_types is None:
            pattern = int(d.get("sliding_window_pattern", 6))
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(int(d["num_hidden_layers"]))]
        if sliding_window is None:
            layer_types = None
        moe = MoESpec.from_hf_dict(d, model_type) if model_type in _MOE_TYPES else None
        quant = dict(d.get("quantization_config") or {})
        quant_method, block = quant.get("quant_method"), quant.get("weight_block_size")
        if quant_method not in (None, "fp8"):
            raise ValueError(f"quantization_config quant_method {quant_method!r} is not supported (only 'fp8')")
        if block is not None and tuple(block) != (128, 128):
            raise ValueError(f"FP8 weight_block_size {block} is not supported (only [128, 128])")
        return cls(
            architecture=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=None if scaling is None else tuple(scaling.items()),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
            attention_bias=attention_bias,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=None if sliding_window is None else int(sliding_window),
            moe=moe,
            quant_method=quant_method,
            weight_block_size=None if block is None else (128, 128),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            hidden_act=act,
            layer_types=None if layer_types is None else tuple(layer_types),
            rope_local_theta=rope_local_theta,
            query_pre_attn_scalar=_int_if_whole(d["query_pre_attn_scalar"]) if gemma else None,
        )

    @classmethod
    def _from_gemma3_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """The language model of a Gemma 3 image-text checkpoint (its vision tower is not loaded)."""
        text = {**dict(d.get("text_config") or {}), "model_type": "gemma3_text"}
        for key in ("eos_token_id", "bos_token_id"):
            if d.get(key) is not None:
                text.setdefault(key, d[key])
        text.pop("architectures", None)
        return cls.from_hf_dict(text)

    @classmethod
    def _from_llava_dict(cls, d: dict[str, Any]) -> ModelConfig:
        text = dict(d.get("text_config") or {})
        text_type = text.get("model_type", "llama")
        if text_type not in _HF_CLASSES:
            raise ValueError(f"unsupported text_config model_type {text_type!r}; supported: {sorted(_HF_CLASSES)}")
        text = {**_TEXT_DEFAULTS.get(text_type, {}), **text, "model_type": text_type}
        text.pop("architectures", None)
        text_cfg = cls.from_hf_dict(text)
        # transformers ties the output embedding when either level asks for it
        tied = text_cfg.tie_word_embeddings or bool(d.get("tie_word_embeddings", False))
        vision = VisionSpec.from_hf_dict(d, text_type)
        return dataclasses.replace(text_cfg, architecture=vision.kind, tie_word_embeddings=tied, vision=vision)

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """Read an HF config.json file (see from_hf_dict)."""
        with open(path, encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f))

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF config.json dict: `LlamaConfig(**d)` / `MistralConfig(**d)` / `Qwen2Config(**d)` accept it.

        Uses the classic rope_theta / rope_scaling keys, which transformers 4.x reads and 5.x converts.
        A LLaVA-family config gives the llava-hf form (`LlavaConfig(**d)` etc. accept it).
        """
        if self.vision is not None:
            text = dataclasses.replace(self, architecture=self.vision.text_architecture, vision=None).to_hf_dict()
            text.pop("architectures")
            return {"architectures": [_MULTIMODAL_CLASSES[self.architecture]], "model_type": self.architecture,
                    "text_config": text, **self.vision.hf_fields(), "tie_word_embeddings": self.tie_word_embeddings}
        eos: int | list[int] | None
        eos = None if not self.eos_token_ids else (
            self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids))
        d: dict[str, Any] = {
            "architectures": [_HF_CLASSES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        }
        if self.moe is not None:
            d |= self.moe.hf_fields(self.architecture, self.num_hidden_layers)
        if self.quant_method is not None:
            d["quantization_config"] = {"quant_method": self.quant_method, "activation_scheme": "dynamic"}
            if self.weight_block_size is not None:
                d["quantization_config"]["weight_block_size"] = list(self.weight_block_size)
        if self.architecture == "llama":
            d["attention_bias"] = False
            d["mlp_bias"] = False
        elif self.architecture in ("mistral", "mixtral"):
            d["sliding_window"] = self.sliding_window
        elif self.architecture == "gemma3_text":
            d["hidden_activation"] = d.pop("hidden_act")
            d["attention_bias"] = False
            d["query_pre_attn_scalar"] = self.query_pre_attn_scalar
            d["sliding_window"] = self.sliding_window
            d["rope_local_base_freq"] = self.rope_local_theta
        else:  # qwen2 / qwen3: q/k/v bias is implied by the class (qwen2); the window is opt-in
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
            if self.architecture in ("qwen3", "qwen3_moe"):
                d["attention_bias"] = False
        if self.layer_types is not None:
            d["layer_types"] = list(self.layer_types)
        if (self.architecture in ("qwen2", "qwen3", "qwen3_moe") and self.sliding_window is not None
                and self.layer_types is None):
            d["max_window_layers"] = 0  # every layer
        return d


def _normalize_rope_scaling(scaling: dict[str, Any]) -> tuple[tuple[str, Any], ...] | None:
    """Validate an HF rope_scaling dict and return it as sorted items, or None when it is plain RoPE."""
    # Older configs spell the key "type"; rope_theta may ride along in transformers-5 rope_parameters.
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    if rope_type == "default":
        return None
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, {', '.join(_ROPE_TYPES)}")
    fields = _ROPE_TYPES[rope_type]
    missing = [k for k in fields if scaling.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks {missing}")
    # Keep only the fields this rope type uses so that two spellings of one config hash equal.
    items = {"rope_type": rope_type, **{k: scaling[k] for k in fields}}
    if "original_max_position_embeddings" in items:
        items["original_max_position_embeddings"] = int(items["original_max_position_embeddings"])
    for k in ("factor", "low_freq_factor", "high_freq_factor"):
        if k in items:
            items[k] = float(items[k])
    return tuple(sorted(items.items()))
