"""sglang.lang.global_config: the process-wide frontend settings (see sgnb.function.GlobalConfig)."""

from sgnb.function import GlobalConfig, global_config

__all__ = ["GlobalConfig", "global_config"]
