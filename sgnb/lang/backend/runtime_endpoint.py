"""sglang.lang.backend.runtime_endpoint: sgnb's RuntimeEndpoint."""

from sgnb.backends.endpoint import RuntimeEndpoint

__all__ = ["RuntimeEndpoint"]
