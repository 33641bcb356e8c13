"""sglang.lang.backend.base_backend: sgnb's BaseBackend."""

from sgnb.backends.base import Backend as BaseBackend

__all__ = ["BaseBackend"]
