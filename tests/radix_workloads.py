"""Large radix trees for the tree views' tests (a helper module, not tests): the engine's own `RadixCache`, filled
as a `run_batch` of classification programs fills it (a shared few-shot prefix, then per program a review, a
select between two labels, both scored, and a short gen after the chosen one), with one token per character so
that no model is needed. ~4.6 nodes a program: 1,100 programs make a tree of ~5,000 nodes."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np

from sgnb.engine.radix_cache import RadixCache
from sgnb.widgets._tree_rows import Node

FEWSHOT = ("Classify the sentiment of each review as positive or negative.\n\n"
           "Review: A delightful film with a warm heart.\nSentiment: positive\n\n"
           "Review: Dull, slow and far too long.\nSentiment: negative\n\n")
ADJ = "great dull warm slow brilliant boring lovely awful clever tedious".split()
NOUN = "film story cast plot ending score script pace".split()
VERB = "was is felt seemed became".split()
ADV = "wonderful terrible moving flat fresh stale sharp clumsy".split()
CHOICES = (" positive", " negative")


def program_texts(i: int, rng: random.Random) -> list[str]:
    """What program `i` caches: its prompt with each choice (select scores both), then the gen after one."""
    review = (f"Review: The {rng.choice(ADJ)} {rng.choice(NOUN)} {rng.choice(VERB)} {rng.choice(ADV)}, "
              f"{rng.choice(ADJ)} #{i}.\nSentiment:")
    prompt = FEWSHOT + review
    gen = "".join(rng.choice("abcdefgh ") for _ in range(12))
    return [prompt + c for c in CHOICES] + [prompt + rng.choice(CHOICES) + "\nBecause: " + gen]


class ClassifyBatch:
    """A RadixCache grown program by program (`add(n)`); `nodes()` as the row builder reads them, the nodes
    inserted since the last `nodes(mark_new=True)` call marked "new"; `label` gives a node's text."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.cache = RadixCache(lambda slots: None)
        self.programs = 0
        self._seen: set[int] = set()

    def add(self, programs: int) -> None:
        for _ in range(programs):
            for text in program_texts(self.programs, self.rng):
                key = [ord(c) for c in text]
                self.cache.insert(key, np.arange(len(key)))
            self.programs += 1

    def insert_text(self, text: str) -> None:
        key = [ord(c) for c in text]
        self.cache.insert(key, np.arange(len(key)))

    def nodes(self, mark_new: bool = False) -> list[Node]:
        out = []
        for n in self._walk():
            node = Node(n.id, n.parent.id if n.parent is not None else None, len(n.key), hits=n.hit_count)
            if mark_new and n.id not in self._seen and n.parent is not None:
                node.state = "new"
            out.append(node)
        if mark_new:
            self._seen = {n.id for n in out}
        return out

    def label(self, node_id: int, tokens: int) -> tuple[str, list]:
        return "".join(map(chr, self.cache.nodes[node_id].key[:tokens])), []

    def _walk(self) -> Iterator:
        stack = [self.cache.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children[k] for k in sorted(n.children, reverse=True))
