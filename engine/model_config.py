"""ModelConfig: the shape of a Llama/Mistral/Qwen2-style decoder, read from (and written as) HF config.json.

One frozen, hashable dataclass built once by the model loader and passed to the model, the KV pool and the
runner. It knows nothing of weights or devices; `from_hf_dict` is the only place HF's config conventions
(defaults, aliases, the transformers-5 `rope_parameters` form) are interpreted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# model_type -> the HF class name written into config.json "architectures".
_HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# RoPE variants the model implements; "default" is plain RoPE and is stored as rope_scaling=None.
_ROPE_TYPES = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
               "linear": ("factor",)}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a decoder-only transformer in the Llama family.

    Contract:
    - `architecture` is the HF model_type: "llama", "mistral" or "qwen2" (all three share one implementation).
    - `attention_bias` means q/k/v projections carry a bias (Qwen2); o_proj never has one here.
    - `rope_scaling` is None for plain RoPE, else a sorted tuple of (key, value) items that always contains
      "rope_type" ("llama3" or "linear") and that type's fields; a tuple keeps the config hashable.
      Use `rope_scaling_dict` for a fresh dict.
    - `sliding_window` is recorded (Mistral v0.1 declares 4096) but not applied by the engine: outputs are
      exact only while a sequence stays within it.
    - `eos_token_ids` lists every id that ends generation, most important first.
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

    def __post_init__(self) -> None:
        if self.architecture not in _HF_CLASSES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: {sorted(_HF_CLASSES)}")
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
        """
        model_type = d.get("model_type")
        if model_type is None:
            by_class = {v: k for k, v in _HF_CLASSES.items()}
            model_type = next((by_class[a] for a in d.get("architectures") or () if a in by_class), None)
        if model_type not in _HF_CLASSES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(_HF_CLASSES)}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}; only 'silu' (SwiGLU) is implemented")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if model_type == "qwen2":
            attention_bias = True  # Qwen2 hard-codes q/k/v bias (and no o_proj bias); config.json omits it
        elif d.get("attention_bias"):
            # In HF Llama/Mistral, attention_bias also adds an o_proj bias, which the model does not have.
            raise ValueError(f"attention_bias=True is not supported for {model_type} (it implies an o_proj bias)")
        else:
            attention_bias = False

        heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or int(d["hidden_size"]) // heads
        # transformers >= 5 folds rope_theta and the scaling fields into one "rope_parameters" dict.
        rope_params = dict(d.get("rope_parameters") or {})
        rope_theta = d.get("rope_theta", rope_params.pop("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or rope_params or None
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
        sliding_window = d.get("sliding_window")
        if model_type == "qwen2" and not d.get("use_sliding_window", False):
            sliding_window = None  # Qwen2 declares a window but disables it by default
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
            rope_theta=float(rope_theta),
            rope_scaling=None if scaling is None else tuple(scaling.items()),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=None if sliding_window is None else int(sliding_window),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """Read an HF config.json file (see from_hf_dict)."""
        with open(path, encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f))

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF config.json dict: `LlamaConfig(**d)` / `MistralConfig(**d)` / `Qwen2Config(**d)` accept it.

        Uses the classic rope_theta / rope_scaling keys, which transformers 4.x reads and 5.x converts.
        """
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
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        }
        if self.architecture == "llama":
            d["attention_bias"] = False
            d["mlp_bias"] = False
        elif self.architecture == "mistral":
            d["sliding_window"] = self.sliding_window
        else:  # qwen2: q/k/v bias is implied by the class; the window is opt-in
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
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
