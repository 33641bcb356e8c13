"""ModelRunner: owns the model weights, the KV pools and the device; runs one forward per batch."""

from __future__ import annotations

import logging
import os

import torch

from sgnb.engine.config import EngineConfig
from sgnb.engine.forward_batch import ForwardBatch
from sgnb.engine.kv_pool import KVPool, ReqToTokenPool
from sgnb.engine.model_loader import ModelSource, load_state_dict
from sgnb.engine.models.llama import LlamaForCausalLM

log = logging.getLogger("sgnb.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_KV_BUDGET_BYTES = 2 << 30  # default KV pool on CPU: 2 GiB
CPU_MAX_KV_TOKENS = 1 << 16


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {name!r}")
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource) -> None:
        self.config = config
        self.source = source
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else resolve_dtype(config.kv_cache_dtype, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        mcfg = source.config
        self.model_config = mcfg
        self.context_length = config.context_length or mcfg.max_position_embeddings

        with torch.device("meta"):  # no random init of weights about to be replaced
            model = LlamaForCausalLM(mcfg, max_positions=self.context_length)
        if source.dummy:
            model.init_dummy_weights(self.device, self.dtype, config.random_seed)
        else:
            model.load_hf_state_dict(load_state_dict(source, self.device, self.dtype), self.device, self.dtype)
        self.model = model.eval()

        self.kv_pool = KVPool(self._kv_slots(kv_dtype, mcfg), mcfg.num_hidden_layers, mcfg.num_key_value_heads,
                              mcfg.head_dim, kv_dtype, self.device)
        self.req_pool = ReqToTokenPool(config.max_running_requests + 8, self.context_length + 1, self.device)
        log.info("model %s on %s/%s, KV pool %d tokens", source.name, self.device, self.dtype, self.kv_pool.size)

    def _kv_slots(self, kv_dtype: torch.dtype, mcfg) -> int:
        if self.config.max_total_tokens is not None:
            return self.config.max_total_tokens
        per_token = 2 * mcfg.num_hidden_layers * mcfg.num_key_value_heads * mcfg.head_dim * kv_dtype.itemsize
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1.0 - self.config.mem_fraction_static)
            return max(int(budget // per_token), 16)
        return max(min(CPU_KV_BUDGET_BYTES // per_token, CPU_MAX_KV_TOKENS), min(self.context_length, CPU_MAX_KV_TOKENS))

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states (T, hidden) of the batch's new tokens; writes their K/V into the pool."""
        return self.model(fb)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)
