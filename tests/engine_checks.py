"""Checks the engine tests share (a helper module, not a test: tests/conftest.py puts tests/ on sys.path)."""

from __future__ import annotations

import time


def tree_slots(tree):
    """Every KV slot the radix tree's nodes own, in one tensor."""
    import numpy as np
    import torch

    with tree.lock:
        parts = [n.value for n in tree.nodes.values() if n is not tree.root]
        return torch.from_numpy(np.concatenate(parts) if parts else np.empty(0, dtype=np.int64))


def assert_pool_consistent(engine) -> None:
    """Idle engine: every KV slot is free or owned by the tree, none locked."""
    deadline = time.time() + 10
    while engine.scheduler.busy and time.time() < deadline:
        time.sleep(0.01)
    pool, tree = engine.runner.kv_pool, engine.tree
    assert tree.protected_size == 0
    assert pool.available + tree.total_size == pool.size
    slots = tree_slots(tree)
    assert slots.unique().numel() == slots.numel()
    assert 0 not in slots.tolist()
    # slot 0 pads batched gathers: it must stay zero (garbage there once leaked NaN into cascade attention)
    assert all(not buf[0].any() for buf in (*pool.cache.k_buffers, *pool.cache.v_buffers))
