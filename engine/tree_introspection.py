"""The radix tree as views read it: a snapshot of every node, one node's key or path, a key as text and media.

Node ids are those of the tree's events. Everything here is safe from any thread while the scheduler runs:
`snapshot` and `node_path` read the tree under its lock; `node_key` is one dict read and hands out the node's own
key list, which a split replaces and nothing mutates (callers must not modify it either).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sgnb.engine.media import is_pad

if TYPE_CHECKING:
    from sgnb.engine.radix_cache import RadixCache
    from sgnb.engine.request_media import RequestMedia

UNKNOWN_MEDIA = {"kind": "image", "hash": "", "thumbnail": None}  # a pad id whose item was forgotten


def snapshot(tree: RadixCache, media: RequestMedia, key_text: Callable[[list[int]], str],
             max_key_tokens: int) -> dict:
    """{"nodes": [...] (each with its key's first `max_key_tokens` tokens, their text, and the media of a key
    that holds any), "total_tokens", "evictable_tokens", "protected_tokens"}."""
    nodes = tree.snapshot(key_text, max_key=max_key_tokens)
    if media.any_shown:
        for node in nodes:
            if any(is_pad(t) for t in node["key"]):
                node["media"] = key_media(media, node["key"])
    return {"nodes": nodes, "total_tokens": tree.total_size, "evictable_tokens": tree.evictable_size,
            "protected_tokens": tree.protected_size}


def node_key(tree: RadixCache, node_id: int) -> list[int] | None:
    """The node's key (its own list), None when the node is gone."""
    node = tree.nodes.get(node_id)  # one dict read
    return None if node is None else node.key


def node_path(tree: RadixCache, node_id: int) -> list[int] | None:
    """Ids of the nodes from the root (excluded) down to `node_id` (included), None when it is gone."""
    with tree.lock:
        node = tree.nodes.get(node_id)
        if node is None:
            return None
        path = []
        while node.parent is not None:
            path.append(node.id)
            node = node.parent
    return path[::-1]


def key_text(ids: list[int], decode: Callable[[list[int]], str], token_text: Callable[[int], str]) -> str:
    """A radix key as text: runs of tokens decoded together (`decode`), each image's (video's) run of pad ids
    once, as `token_text` names it."""
    parts: list[str] = []
    run: list[int] = []
    last_pad = None
    for t in ids:
        if is_pad(t):
            if run:
                parts.append(decode(run))
                run = []
            if t != last_pad:
                parts.append(token_text(t))
            last_pad = t
        else:
            run.append(t)
            last_pad = None
    if run:
        parts.append(decode(run))
    return "".join(parts)


def key_media(media: RequestMedia, ids: list[int]) -> list[dict[str, Any]]:
    """The images / videos a radix key holds: kind, short hash, thumbnail (data: URL), tokens in this key."""
    counts: dict[int, int] = {}
    for t in ids:
        if is_pad(t):
            counts[t] = counts.get(t, 0) + 1
    return [{**(media.shown(t) or UNKNOWN_MEDIA), "tokens": n} for t, n in counts.items()]
