"""The rows both radix-tree views draw (the RadixTreeView widget and the lab panel), built in one place.

Each view adapts its own source of nodes into `Node`s with a state: the widget keeps a mirror of the tree from the
engine's events, the panel reads a snapshot at each poll. `build_rows` turns them into the rows that
`radix_tree_draw.js` documents (its header is the format's reference):

- which nodes to show within a row budget: the root, then nodes best first (children of `expanded` nodes, then
  subtrees with live changes, then the biggest, the most hit, the newest), each after its parent; the rest of a
  node's children become one "+N" group row, or, when none of them is shown, a count on the node itself
  (`below`: a cold subtree folded into its top, one row). Among siblings of one shape (e.g. hundreds of leaves,
  or of one-node-one-leaf branches) at most `sibling_cap` are shown: a few examples of each kind and a count,
  not a slice of identical leaves;
- a tree with more nodes than the budget gets an overview instead of a slice: at most `overview_rows` rows, at
  most `breadth` children shown per node, so the levels near the root, where the sharing is, read at a glance
  and every row says how much lies under it; the user opens what they want to see (a "+N" row or a folded
  node's "+" adds it to `expanded`, whose children come on top of the overview, up to `max_nodes` more);
- labels: the first `label_tokens` tokens of a node's key, with chat-template markers ("<|im_start|>user\\n",
  "<|eot_id|>", ...) turned into role glyphs (one private-use character each, drawn as a small chip), and
  `diff`: where the label departs from its siblings' labels, so the drawing shows that part when it must cut;
  a label that reads exactly like a sibling's is decoded further (up to `MAX_LABEL_TOKENS`) to find it;
- reasoning: a reasoning model's thinking markers (`<think>`, `</think>`, `[THINK]`, ...: sgnb/reasoning.py's
  formats) are glyphs too, and a row says how much of it is thinking (`think`: "all" or "part") and whether it
  starts inside a block its ancestors opened (`think_inside`), so the drawing sets the reasoning apart from the
  answer; a node that may close a block past its label is read further (up to `THINK_SCAN_TOKENS`) to know;
- heat: a level 1..HEAT_LEVELS from the node's cumulative hits (log scale, relative to the tree's most hit
  node), drawn when the node has no live state (new / hit / evicted).

The adapters share the clocks' meaning: a node is "new" (or "hit") when that happened within HIGHLIGHT_S of the
engine's latest activity, for as long as the engine was active within LIVE_S (a quick step stays visible, an
idle tree shows its heat); "evicted" nodes stay drawn for EVICTED_S.

Importable without anywidget, traitlets or torch: the lab panel's snapshot imports it in every kernel.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from typing import Any

from sgnb.reasoning import FORMATS
from sgnb.widgets._media import key_label, key_text

HIGHLIGHT_S = 1.0  # "new" and "hit" mark the changes of the latest this-many seconds of engine activity,
LIVE_S = 3.0  # until the engine has been idle this long: then every node shows its heat
EVICTED_S = 20.0  # an evicted node stays drawn (red, dashed) this long: long enough to be seen
MAX_EVICTED = 200  # evicted nodes kept at most (the most recent)
LABEL_TOKENS = 24  # tokens of a key decoded into its label
MAX_LABEL_TOKENS = 256  # how far a label that reads like a sibling's is decoded to find where they differ
SIBLING_CAP = 12  # siblings of one shape shown (the rest go into the parent's "+N" group)
OVERVIEW_ROWS = 60  # rows of a tree too big for the budget: an overview, not a slice of 300
BREADTH = 12  # children shown per node in an overview (the others: one "+N" row)
HEAT_LEVELS = 5
THINK_SCAN_TOKENS = 4096  # of a node read to find where its reasoning ends
DETAIL_TOKENS = 4096  # of the selected node's own text
DETAIL_PREFIX_TOKENS = 2000  # of the text above it
LIVE_STATES = frozenset(("new", "hit", "evicted"))

# chat-template markers -> one private-use character each (radix_tree_draw.js draws them as role chips)
GLYPHS = {"system": "\ue000", "user": "\ue001", "assistant": "\ue002", "tool": "\ue003", "role": "\ue004",
          "end": "\ue005", "special": "\ue006", "think": "\ue007", "think_end": "\ue008"}
# the reasoning formats' markers (a harmony analysis channel ends at its <|end|>)
THINK_OPEN = tuple(sorted({f.open for f in FORMATS.values()}, key=len, reverse=True))
THINK_CLOSE = tuple(sorted({f.close for f in FORMATS.values()}, key=len, reverse=True))
_ROLE_NAMES = {"system": "system", "developer": "system", "user": "user", "human": "user", "assistant": "assistant",
               "model": "assistant", "gpt": "assistant", "bot": "assistant", "tool": "tool", "ipython": "tool",
               "function": "tool"}
# a chat template's markers in text (a role's opening with its name, a turn's end, other special tokens) and
# the reasoning formats' markers: what the tree views draw as glyphs and the program view shows muted
CHAT_MARKER = re.compile(
    "(?P<think>" + "|".join(map(re.escape, THINK_OPEN)) + ")\n*"  # reasoning (before <|end|> and the specials)
    "|(?P<unthink>" + "|".join(re.escape(m) for m in THINK_CLOSE if m != "<|end|>") + ")\n*|"
    r"<\|im_start\|>(?P<chatml>\w+)\n?"  # ChatML (Qwen, SmolLM, ...)
    r"|<\|start_header_id\|>(?P<header>\w+)<\|end_header_id\|>\n*"  # Llama 3
    r"|<start_of_turn>(?P<turn>\w+)\n?"  # Gemma
    r"|<\|(?P<tag>system|user|assistant|tool)\|>\n?"  # Phi-3, Zephyr
    r"|(?P<inst>\[INST\])|(?P<einst>\[/INST\])|(?P<sys><<SYS>>)\n?"  # Llama 2, Mistral
    r"|(?P<end><\|im_end\|>|<\|eot_id\|>|<end_of_turn>|<\|end\|>|<\|endoftext\|>|</s>|<</SYS>>)\n?"
    r"|(?P<special><\|[^|<>\s]{1,40}\|>|<s>)"
)

# the characters a marker can start with: text without any holds none (a cheap test before the search)
_MARKER_STARTS = "".join(sorted({m[0] for m in (*THINK_OPEN, *THINK_CLOSE)} | {"<", "["}))


def _may_hold_marker(text: str) -> bool:
    return any(c in text for c in _MARKER_STARTS)


def has_marker(text: str) -> bool:
    """Whether `text` holds a CHAT_MARKER."""
    return _may_hold_marker(text) and CHAT_MARKER.search(text) is not None


Label = Callable[[int, int], tuple[str, list[dict[str, Any]]]]  # (node id, tokens) -> (text, media)


class Node:
    """One tree node as the row builder reads it. `state` is "", "new", "hit" or "evicted" (the adapter decides,
    on its own clock); `rids` how many requests are known to share it."""

    __slots__ = ("id", "parent", "tokens", "hits", "locked", "state", "rids")

    def __init__(self, node_id: int, parent: int | None, tokens: int, hits: int = 0, locked: bool = False,
                 state: str = "", rids: int = 0) -> None:
        self.id, self.parent, self.tokens, self.hits = node_id, parent, tokens, hits
        self.locked, self.state, self.rids = locked, state, rids

    def __repr__(self) -> str:
        return f"Node({self.id}, parent={self.parent}, tokens={self.tokens}, state={self.state!r})"


def display_label(text: str) -> str:
    """`text` with each chat-template marker replaced by its glyph (see GLYPHS)."""
    if not _may_hold_marker(text):
        return text
    return CHAT_MARKER.sub(_glyph, text)


def _glyph(m: re.Match[str]) -> str:
    if m.group("think"):
        return GLYPHS["think"]
    if m.group("unthink"):
        return GLYPHS["think_end"]
    role = m.group("chatml") or m.group("header") or m.group("turn") or m.group("tag")
    if role is not None:
        return GLYPHS[_ROLE_NAMES.get(role.lower(), "role")]
    if m.group("inst"):
        return GLYPHS["user"]
    if m.group("einst"):
        return GLYPHS["assistant"]
    if m.group("sys"):
        return GLYPHS["system"]
    return GLYPHS["end"] if m.group("end") else GLYPHS["special"]


def heat_level(hits: int, max_hits: int) -> int:
    """0 for a node never hit, else 1..HEAT_LEVELS on a log scale up to the tree's most hit node (at least 4
    hits, so that one hit in a young tree is not already the hottest colour)."""
    if hits <= 0:
        return 0
    scale = math.log1p(max(max_hits, 4))
    return 1 + min(HEAT_LEVELS - 1, int((HEAT_LEVELS - 1) * math.log1p(hits) / scale))


def _common_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _departures(labels: list[str]) -> list[int]:
    """For each label, how many leading characters it shares with the most similar other label (sorted
    neighbours are the most similar ones)."""
    order = sorted(range(len(labels)), key=labels.__getitem__)
    out = [0] * len(labels)
    for a, b in zip(order, order[1:]):
        n = _common_len(labels[a], labels[b])
        out[a], out[b] = max(out[a], n), max(out[b], n)
    return out


def build_rows(nodes: Iterable[Node], label: Label, *, max_nodes: int = 300,
               collapsed: AbstractSet[Any] = frozenset(), expanded: AbstractSet[Any] = frozenset(),
               label_tokens: int = LABEL_TOKENS, sibling_cap: int = SIBLING_CAP,
               overview_rows: int = OVERVIEW_ROWS, breadth: int = BREADTH,
               think_memo: dict[Any, tuple[bool, bool, bool]] | None = None,
               read: Callable[[int, int], str] | None = None,
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows to draw (parents first) and a summary, for `nodes` (any order; siblings are drawn in the order
    they come; exactly one has parent None, and a node whose parent is missing hangs under it).

    At most `max_nodes` rows (nodes plus one group row per node with some of its children hidden; a node with
    all of them hidden counts them itself), plus up to `max_nodes` more for the children of `expanded` nodes;
    the subtrees of `collapsed` nodes are folded. A tree of more than `max_nodes` nodes is an overview: at most
    `overview_rows` rows and `breadth` children a node (besides `expanded` nodes' children). `label(id, n)`
    is called for shown nodes only: the text of the node's first n tokens and its media (see `_media`); a node
    longer than its label is read once more, up to THINK_SCAN_TOKENS, for its reasoning markers: `read(id, n)`
    (default: label's text; an adapter that caches its labels passes a reader that does not), and `think_memo`
    (an adapter's dict, the same on every call) remembers what each node held, so that is once per node."""
    assert max_nodes >= 2, "need room for the root and one group"
    by_id: dict[int, Node] = {}
    root: Node | None = None
    for n in nodes:
        by_id[n.id] = n
        if n.parent is None and root is None:
            root = n
    if root is None:
        return [], {"nodes": 0, "shown": 0, "groups": 0, "tokens": 0, "locked": 0, "evicting": 0, "new": 0,
                    "hit": 0, "max_hits": 0, "max_nodes": max_nodes}
    children: dict[int, list[int]] = {i: [] for i in by_id}
    for n in by_id.values():
        if n is not root:
            children[n.parent if n.parent in by_id else root.id].append(n.id)

    order, stack = [], [root.id]  # preorder: parents first, siblings in their order
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(reversed(children[i]))
    count: dict[int, int] = {}
    tokens: dict[int, int] = {}
    active: dict[int, tuple[int, int, int]] = {}  # (new, hit, evicted) nodes in the subtree
    shape: dict[int, int] = {}  # equal ids: subtrees of the same shape
    shapes: dict[tuple[int, ...], int] = {}
    for i in reversed(order):
        n = by_id[i]
        c, t = 1, n.tokens
        a_new, a_hit, a_ev = int(n.state == "new"), int(n.state == "hit"), int(n.state == "evicted")
        for ch in children[i]:
            c, t = c + count[ch], t + tokens[ch]
            ca = active[ch]
            a_new, a_hit, a_ev = a_new + ca[0], a_hit + ca[1], a_ev + ca[2]
        count[i], tokens[i], active[i] = c, t, (a_new, a_hit, a_ev)
        sig = tuple(sorted(shape[ch] for ch in children[i]))
        shape[i] = shapes.setdefault(sig, len(shapes))

    # the budget: rows = kept nodes + one group row per kept node with some (not all) of its children hidden;
    # a tree too big for it gets an overview: fewer rows, fewer children a node
    overview = len(by_id) > max_nodes
    budget = min(max_nodes, max(overview_rows, 2)) if overview else max_nodes
    keep: set[int] = {root.id}
    opened: dict[int, int] = {root.id: 0 if root.id in collapsed else len(children[root.id])}  # children to show
    shown_kids: dict[int, int] = {root.id: 0}
    total = 1
    extra = 0  # rows beyond max_nodes, for the children of expanded nodes
    shown_like: dict[tuple[int, int], int] = {}  # (parent, shape) -> siblings of that shape shown
    class_size: dict[tuple[int, int], int] = {}
    for p, kids in children.items():
        for ch in kids:
            k = (p, shape[ch])
            class_size[k] = class_size.get(k, 0) + 1

    def entry(c: int, parent: int) -> tuple[int, int, int, int, int, int]:
        n = by_id[c]
        return (-(parent in expanded), -(sum(active[c]) > 0), -count[c], -n.hits, -c, c)

    def group_row(p: int, shown: int) -> int:  # whether p draws a "+N" row with `shown` of its children shown
        return 1 if 0 < shown < opened[p] else 0

    heap = [entry(c, root.id) for c in children[root.id]] if root.id not in collapsed else []
    heapq.heapify(heap)
    while heap:
        forced, lively, *_, i = heapq.heappop(heap)
        parent = by_id[i].parent
        parent = parent if parent in by_id else root.id
        like = (parent, shape[i])
        if (not forced and not lively and class_size[like] > sibling_cap + 1
                and shown_like.get(like, 0) >= sibling_cap):
            continue  # enough examples of this kind of sibling: the rest are counted in the group
        had = shown_kids[parent]
        if overview and not forced and had >= breadth:
            continue  # a level of the overview is this wide at most: the rest are counted in the group
        grows = 1 + group_row(parent, had + 1) - group_row(parent, had)
        if forced and extra + grows <= max_nodes:
            extra += grows
        elif total + grows > budget:
            if forced:
                continue
            if grows > 1:  # this child would open its parent's "+N" row: a sibling of a shown one may fit
                continue
            break
        else:
            total += grows
        keep.add(i)
        shown_kids[parent] = had + 1
        opened[i] = 0 if i in collapsed else len(children[i])
        shown_kids[i] = 0
        shown_like[like] = shown_like.get(like, 0) + 1
        for c in children[i] if opened[i] else ():
            heapq.heappush(heap, entry(c, i))

    live = [n for n in by_id.values() if n.state != "evicted"]
    max_hits = max((n.hits for n in live if n is not root), default=0)
    rows: list[dict[str, Any]] = []
    groups = folded = 0
    for i in order:
        if i not in keep:
            continue
        n = by_id[i]
        kids = children[i]
        row: dict[str, Any] = {"id": i, "parent": None if n is root else n.parent if n.parent in by_id else root.id,
                               "tokens": n.tokens, "hits": n.hits, "locked": n.locked and n is not root,
                               "state": n.state, "rids": n.rids, "kids": len(kids)}
        if n is not root:
            level = heat_level(n.hits, max_hits) if n.state != "evicted" else 0
            if level:
                row["heat"] = level
        if i in collapsed and kids:
            row["collapsed"] = True
            row["hidden"] = count[i] - 1
        lost = [c for c in kids if c not in keep]
        if lost and i not in collapsed and len(lost) == len(kids):  # a cold subtree, folded into its top
            folded += 1
            row["below"] = count[i] - 1
            row["below_tokens"] = tokens[i] - n.tokens
            new, hit, ev = (sum(active[c][k] for c in kids) for k in range(3))
            if new or hit or ev:
                row["below_state"] = "new" if new else "hit" if hit else "evicted"
        rows.append(row)
        if lost and i not in collapsed and len(lost) < len(kids):
            groups += 1
            new, hit, ev = (sum(active[c][k] for c in lost) for k in range(3))
            kinds = {shape[c] for c in lost}
            like_shown = any(shown_like.get((i, s), 0) for s in kinds)
            rows.append({"id": f"g{i}", "parent": i, "group": True, "children": len(lost),
                         "count": sum(count[c] for c in lost), "tokens": sum(tokens[c] for c in lost),
                         "leaves": sum(1 for c in lost if not children[c]), "shapes": len(kinds),
                         "like_shown": like_shown, "new": new, "hit": hit, "evicted": ev,
                         "state": "new" if new else "hit" if hit else "evicted" if ev else ""})
    _label_rows(rows, label, label_tokens, by_id)
    _mark_reasoning(rows, read or (lambda i, n: label(i, n)[0]), label_tokens,
                    {} if think_memo is None else think_memo)
    summary = {
        "nodes": len(live), "shown": len(rows) - groups, "groups": groups, "folded": folded,
        "overview": overview,
        "tokens": sum(n.tokens for n in live), "locked": sum(1 for n in live if n.locked and n is not root),
        "evicting": len(by_id) - len(live), "new": active[root.id][0], "hit": active[root.id][1],
        "max_hits": max_hits, "max_nodes": max_nodes,
    }
    return rows, summary


def _label_rows(rows: list[dict[str, Any]], label: Label, label_tokens: int, by_id: dict[int, Node]) -> None:
    """Give the node rows their text, label, media and diff (see the module's docstring)."""
    siblings: dict[Any, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("group"):
            continue
        if row["parent"] is None:
            row["text"] = ""
            continue
        text, media = label(row["id"], label_tokens)
        _set_text(row, text)
        if media:
            row["media"] = media
        siblings.setdefault(row["parent"], []).append(row)
    for kids in siblings.values():
        if len(kids) < 2:
            continue
        labels = [r.get("label", r["text"]) for r in kids]
        shared = _departures(labels)
        if any(d >= len(s) for d, s in zip(shared, labels)):
            # one reads just like a sibling as far as it goes: read those that share a start on, to the place
            # where they differ (a re-tokenized reply reads like the generated one, token ids apart)
            for r, d in zip(kids, shared):
                if d and r["tokens"] > label_tokens:
                    _set_text(r, label(r["id"], min(r["tokens"], MAX_LABEL_TOKENS))[0])
            labels = [r.get("label", r["text"]) for r in kids]
            shared = _departures(labels)
        for r, d in zip(kids, shared):
            if d:
                r["diff"] = d


def _mark_reasoning(rows: list[dict[str, Any]], read: Callable[[int, int], str], label_tokens: int,
                    memo: dict[Any, tuple[bool, bool, bool]]) -> None:
    """Say which rows hold reasoning (parents come before their children in `rows`): `think_inside` when the
    node starts inside a block its ancestors opened, `think` "all" (no answer text in it) or "part"."""
    if len(memo) > 20 * THINK_SCAN_TOKENS:
        memo.clear()
    inside_at_end: dict[Any, bool] = {}
    for row in rows:
        if row.get("group") or row["parent"] is None:
            continue
        inside = inside_at_end.get(row["parent"], False)
        if row["tokens"] <= label_tokens or row.get("state") == "evicted":  # its label is all it has
            found = reasoning_spans(row["text"], inside)
        else:  # a marker may lie past its label
            key = (row["id"], row["tokens"], inside)
            if key not in memo:
                memo[key] = reasoning_spans(read(row["id"], min(row["tokens"], THINK_SCAN_TOKENS)), inside)
            found = memo[key]
        thought, closed, inside_at_end[row["id"]] = found
        if inside:
            row["think_inside"] = True
        if thought:
            row["think"] = "all" if inside and not closed else "part"


def reasoning_spans(text: str, inside: bool) -> tuple[bool, bool, bool]:
    """Of a node's `text` that starts inside a reasoning block or not: (whether any of it is reasoning, whether
    a block closes in it, whether it ends inside one)."""
    thought, closed, pos = inside, False, 0
    while True:
        if inside:
            ends = [(at, m) for m in THINK_CLOSE if (at := text.find(m, pos)) >= 0]
            if not ends:
                return thought, closed, True
            at, m = min(ends)
            inside, closed, pos = False, True, at + len(m)
        else:
            starts = [(at, m) for m in THINK_OPEN if (at := text.find(m, pos)) >= 0]
            if not starts:
                return thought, closed, False
            at, m = min(starts)
            inside, thought, pos = True, True, at + len(m)


def _set_text(row: dict[str, Any], text: str) -> None:
    row["text"] = text
    shown = display_label(text)
    if shown != text:
        row["label"] = shown
    else:
        row.pop("label", None)


# ---- the selected node ------------------------------------------------------------------------------------
def node_details(engine: Any, node: Node, fallback_text: str = "") -> dict[str, Any]:
    """The selected node as radix_tree_draw.js's details box shows it: its own text (up to DETAIL_TOKENS
    tokens), the text of the path above it (its last DETAIL_PREFIX_TOKENS tokens), its media with the engine's
    own thumbnails, counts. Read through the engine's view API (`node_key`, `node_path`); a node that is gone
    (evicted) shows `fallback_text`."""
    info = {"id": node.id, "tokens": node.tokens, "hits": node.hits, "locked": node.locked, "state": node.state,
            "rids": [], "n_rids": node.rids, "media": []}
    key = engine.node_key(node.id)
    path = engine.node_path(node.id) if key is not None else None
    if key is None or path is None:
        return {**info, "text": fallback_text, "prefix": "", "prefix_truncated": False, "depth_tokens": node.tokens}
    text, media = key_label(engine, key, DETAIL_TOKENS, px=None)  # the engine's own thumbnails: one node's
    above: list[int] = []
    for i in path[:-1]:
        above.extend(engine.node_key(i) or ())
    prefix = key_text(engine, above[-DETAIL_PREFIX_TOKENS:]) if above else ""
    return {**info, "text": text, "prefix": prefix, "prefix_truncated": len(above) > DETAIL_PREFIX_TOKENS,
            "depth_tokens": len(above) + len(key), "media": media}
