"""Which waiting request goes first: lpm (longest cached prefix), dfs-weight (depth-first over the radix tree,
heaviest subtrees first, so requests sharing a prefix run together), fcfs (arrival order)."""

from __future__ import annotations

from collections import defaultdict

from sgnb.engine.radix_cache import RadixCache, TreeNode
from sgnb.engine.request import Req

# Past this many waiting requests, lpm costs more than it saves: fall back to arrival order (as SGLang does).
LPM_MAX_QUEUE = 128
# lpm ranks by cached prefix only from this many tokens: a shorter match (a shared "Request 1" of distinct
# prompts) saves next to nothing, and ranking by it would only reorder arrivals (a workload with no reuse ran
# slower with the cache than without before this threshold: NOTES.md).
LPM_MIN_PREFIX = 16


def order_waiting(policy: str, waiting: list[Req], tree: RadixCache) -> list[Req]:
    if policy == "fcfs" or tree.disable or len(waiting) <= 1:
        return list(waiting)
    if policy == "lpm":
        if len(waiting) > LPM_MAX_QUEUE:
            return list(waiting)
        keyed = [(n if (n := cached_prefix_len(tree, r)) >= LPM_MIN_PREFIX else 0, i, r)
                 for i, r in enumerate(waiting)]
        keyed.sort(key=lambda x: (-x[0], x[1]))  # stable: ties keep arrival order
        return [r for _, _, r in keyed]
    if policy == "dfs-weight":
        return _dfs_weight(waiting, tree)
    raise ValueError(f"unknown schedule policy {policy!r}")


def cached_prefix_len(tree: RadixCache, req: Req) -> int:
    """tree.prefix_len of a waiting request's tokens, walking on from where its previous walk ended
    (req.lpm_hint; the tokens of a waiting request do not change): each round then compares only what the
    tree gained, not a long prompt from its start. lpm's ranking and admission both walk through here."""
    n, req.lpm_hint = tree.prefix_walk(req.fill_view(), req.lpm_hint)
    return n


def _dfs_weight(waiting: list[Req], tree: RadixCache) -> list[Req]:
    at_node: dict[int, list[Req]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    for req in waiting:
        node = tree.match_prefix(req.fill_ids).last_node
        at_node[node.id].append(req)
        walk: TreeNode | None = node
        while walk is not None:
            weight[walk.id] += 1
            walk = walk.parent
    out: list[Req] = []
    stack = [tree.root]
    while stack:
        node = stack.pop()
        out.extend(at_node.get(node.id, ()))
        children = [c for c in node.children.values() if weight.get(c.id)]
        children.sort(key=lambda c: weight[c.id])  # heaviest popped first
        stack.extend(children)
    return out
