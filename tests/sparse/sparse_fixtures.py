"""Shared SCSA test helpers: small operator settings and synthetic clustered caches.

The sparse tests all build the same kind of case -- a clustered synthetic cache
(``longattn.sparse.synthetic``), queries aimed at a few of its components, and a small
``SCSAConfig`` whose clusters, blocks and rebuilds are tiny enough that a cache of a few
thousand tokens crosses every boundary. They live here once.

    from sparse_fixtures import small_cfg, attn_case, decode_run

Every test under tests/sparse runs on one intra-op thread (the ``_one_thread_for_tiny_ops``
autouse fixture in tests/conftest.py).
"""

from __future__ import annotations

import torch

from longattn.sparse import SCSAConfig
from longattn.sparse.synthetic import synthetic_cache

# Tiny clusters/blocks so ~1K-token caches seal several blocks; always sparse from the first call.
# No outliers unless a test asks (the default 8 would be half of a 16-key cluster); the tests of
# the invariants parametrize them in.
# dense_when_cheaper off: on caches this small the cost rule would send every calibrated layer to
# its dense read (tests/sparse/test_sparse_cost.py tests the rule)
SMALL = dict(cluster_size=16, rebuild_interval=64, block_size=256, sink=4, recent=8, min_context=0,
             calib_steps=0, outliers=0, dense_when_cheaper=False)


def small_cfg(base: dict | None = None, **kw) -> SCSAConfig:
    """``SCSAConfig`` from ``SMALL`` (or ``base``) with ``kw`` overriding."""
    cfg = dict(SMALL if base is None else base)
    cfg.update(kw)
    return SCSAConfig(**cfg)


def attn_case(n: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0, queries: int | None = None,
              query_seed: int | None = None, topics: int = 2, **cache_kw):
    """``(q, k, v, scale)`` over a synthetic clustered cache of ``n`` tokens.

    q is ``[1, H, 1, D]`` (``queries=None``) or ``[queries, 1, H, 1, D]``; k, v ``[1, Hkv, n, D]``.
    """
    cache = synthetic_cache(n, kv_heads, head_dim, seed=seed, **cache_kw)
    qs = cache.queries(1 if queries is None else queries, heads, topics=topics,
                       seed=seed if query_seed is None else query_seed)
    return (qs[0] if queries is None else qs), cache.k, cache.v, head_dim ** -0.5


def decode_run(start: int, steps: int, heads: int, kv_heads: int, head_dim: int, seed: int,
               query_seed: int) -> list:
    """A decode run over a synthetic cache growing by one token per call:
    ``[(q [1, H, 1, D], k [1, Hkv, start + i + 1, D], v)]`` for ``i < steps``."""
    cache = synthetic_cache(start + steps, kv_heads, head_dim, seed=seed)
    qs = cache.queries(steps, heads, seed=query_seed)
    return [(qs[i], cache.k[:, :, :start + i + 1], cache.v[:, :, :start + i + 1]) for i in range(steps)]


INDEX_FIELDS = ("counts", "log_counts", "summ", "resid", "vmean", "diagvar", "eigval", "slots", "pad_bias",
                "out_slots")


def assert_same_index(a, b):
    """Two ClusterIndexes hold the same clusters, summaries, packed rows and tree, bit for bit."""
    assert (a.seal_end, a.num_clusters, a.frozen_blocks) == (b.seal_end, b.num_clusters, b.frozen_blocks)
    M = a.num_clusters
    for name in INDEX_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        dim = 0 if name in ("counts", "log_counts", "pad_bias") else 1
        assert torch.equal(x.narrow(dim, 0, M), y.narrow(dim, 0, M)), name
    for name in a.store._fields():
        assert torch.equal(getattr(a.store, name)[:, :M], getattr(b.store, name)[:, :M]), name
    if a.tree is not None:
        for name in ("counts", "summ", "resid", "vmean", "children"):
            assert torch.equal(getattr(a.tree, name), getattr(b.tree, name)), name
