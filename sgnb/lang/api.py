"""sglang.lang.api: the primitives and the backend functions (sgnb's, by SGLang's names)."""

from typing import TYPE_CHECKING, Any

from sgnb import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    image,
    select,
    separate_reasoning,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)

if TYPE_CHECKING:
    from sgnb.backends.runtime import Runtime
    from sgnb.engine import Engine


def __getattr__(name: str) -> Any:  # Engine and Runtime load torch: only when used
    if name in ("Engine", "Runtime"):
        import sgnb

        return getattr(sgnb, name)
    raise AttributeError(name)


__all__ = ["Engine", "Runtime", "assistant", "assistant_begin", "assistant_end", "flush_cache", "function", "gen",
           "gen_int", "gen_string", "get_server_info", "image", "select", "separate_reasoning", "set_default_backend",
           "system", "system_begin", "system_end", "user", "user_begin", "user_end", "video"]
