"""Incremental cluster index over one batch row's append-only cache (all KV heads of a layer).

Regions of the cache (slots are absolute positions):

    [0, sink)            always exact
    [sink, seal_end)     sealed: clustered, summarised and packed, in blocks of ``block_size``
                         (with ``outliers`` > 0, each cluster's farthest members are taken out
                         when its block is built and are always exact: ``extra_slots``)
    [seal_end, N)        unsealed suffix (``recent`` plus what is not rebuilt yet): always exact

``seal_end = sink + floor((N - sink - recent) / rebuild_interval) * rebuild_interval``, so the
sealed region grows in steps of ``rebuild_interval``. Block j covers
``[sink + j*block_size, sink + (j+1)*block_size)``; a full block is frozen for good, and at each
rebuild only the growing last block is re-split and re-packed. Cluster ids of block j start at
``j * ceil(block_size / cluster_size)``, so a frozen block's clusters never move and the index
after any sequence of appends equals the index built from scratch over the same keys.
"""

from __future__ import annotations

import torch

from ..cache.kv_format import widen

from .clustering import cluster_block, outlier_width
from .config import SCSAConfig
from .experimental.tree import ClusterTree, build_tree
from .packing import make_store


class ClusterIndex:
    """Summaries, packed rows and (optionally) the interval tree of one cache row."""

    def __init__(self, cfg: SCSAConfig, num_kv_heads: int, head_dim: int) -> None:
        self.cfg = cfg
        self.hkv, self.d = num_kv_heads, head_dim
        self.clusters_per_block = -(-cfg.block_size // cfg.cluster_size)
        # changes whenever the index does (a reset, a block built): what is derived from it
        # (the kernel's arguments) is kept while it stays the same
        self.version = 0
        self.reset()

    # --- state ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every cluster (the next update replans from scratch)."""
        cfg, hkv, d, cs, r = self.cfg, self.hkv, self.d, self.cfg.cluster_size, self.cfg.rank
        self.version += 1
        self.seal_end = cfg.sink
        self.frozen_blocks = 0
        self.num_clusters = 0
        self.capacity = 0
        self.counts = torch.zeros(0, dtype=torch.int64)        # [C]
        self.log_counts = torch.zeros(0)                       # [C]
        self.summ = torch.zeros(hkv, 0, 1 + r, d)              # [Hkv, C, 1+r, D]
        self.resid = torch.zeros(hkv, 0, d)                    # [Hkv, C, D]
        self.vmean = torch.zeros(hkv, 0, d)                    # [Hkv, C, D]
        self.diagvar = torch.zeros(hkv, 0, d)                  # [Hkv, C, D]
        self.radius = torch.zeros(hkv, 0)                      # [Hkv, C]
        self.eigval = torch.zeros(hkv, 0, r)                   # [Hkv, C, r]
        self.slots = torch.zeros(hkv, 0, cs, dtype=torch.int64)  # [Hkv, C, cs], -1 = padding
        self.pad_bias = torch.zeros(0, cs)                     # [C, cs]: 0 member, -inf padding
        o = outlier_width(cfg.outliers, cs)
        self.out_slots = torch.zeros(hkv, 0, o, dtype=torch.int64)  # [Hkv, C, o], -1 = none
        self.store = make_store(cfg.packing, hkv, cs, d)
        self.tree: ClusterTree | None = None
        self._fingerprint: torch.Tensor | None = None  # [Hkv, D]: keys of the last sealed slot
        self.extra_k = torch.zeros(hkv, 0, d)  # [Hkv, X, D]: the outliers' rows (_copy_outliers)
        self.extra_v = torch.zeros(hkv, 0, d)
        self._views()

    def _views(self) -> None:
        """Cached views of the live clusters for the hot path."""
        M = self.num_clusters
        self.live_summ = self.summ[:, :M]
        self.live_resid = self.resid[:, :M]
        self.live_vmean = self.vmean[:, :M]
        self.live_radius = self.radius[:, :M]
        self.live_log_counts = self.log_counts[:M]
        self.has_padding = bool(M) and bool((self.counts[:M] < self.cfg.cluster_size).any())
        # every cluster has as many outliers in every head, so each head's list is equally long
        out = self.out_slots[:, :M].reshape(self.hkv, -1)
        keep = out[0] >= 0 if out.shape[1] else torch.zeros(0, dtype=torch.bool)
        self.extra_slots = out[:, keep].sort(-1).values.contiguous()  # [Hkv, X] ascending

    def _ensure(self, clusters: int) -> None:
        if clusters <= self.capacity:
            return
        cap = max(clusters, 2 * self.capacity, 16)
        for name, dim in (("counts", 0), ("log_counts", 0), ("summ", 1), ("resid", 1), ("vmean", 1),
                          ("diagvar", 1), ("radius", 1), ("eigval", 1), ("slots", 1), ("pad_bias", 0),
                          ("out_slots", 1)):
            t = getattr(self, name)
            shape = list(t.shape)
            shape[dim] = cap
            fill = -1 if name in ("slots", "out_slots") else 0
            out = torch.full(shape, fill, dtype=t.dtype)
            out.narrow(dim, 0, t.shape[dim]).copy_(t)
            setattr(self, name, out)
        self.store.ensure(cap)
        self.capacity = cap

    # --- maintenance ---------------------------------------------------------------------
    def target_seal_end(self, n: int) -> int:
        """Where the sealed region ends for a cache of ``n`` slots."""
        cfg = self.cfg
        usable = n - cfg.sink - cfg.recent
        if usable < cfg.rebuild_interval:
            return cfg.sink
        return cfg.sink + (usable // cfg.rebuild_interval) * cfg.rebuild_interval

    def _same_cache(self, k: torch.Tensor) -> bool:
        # the last sealed row's keys: another sequence (or rewritten history) differs there; one
        # comparison per call, since this runs on every decode step of every sparse layer
        if self._fingerprint is None:
            return True
        rows = k.select(-2, self.seal_end - 1)  # [Hkv, D], or [1, Hkv, D] from one row's 4-D cache
        return torch.equal(rows if rows.dim() == 2 else rows.select(0, 0), self._fingerprint)

    def is_current(self, k: torch.Tensor) -> bool:
        """True when ``update`` would change nothing for the cache ``k`` (``[Hkv, N, D]``, or one
        row's ``[1, Hkv, N, D]``): not shorter than the sealed region, the same sealed keys, and
        no rebuild due. The decode loop's shortcut (SCSALayer._hot_call) asks this alone."""
        n = k.shape[-2]
        return n >= self.seal_end and self._same_cache(k) and self.target_seal_end(n) <= self.seal_end

    def update(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """Bring the index up to date with the cache; returns how many blocks were (re)built.

        Args:
            k, v: ``[Hkv, N, D]``, the whole cache of this row (append-only between calls), or its
                stored rows of another format (cache/kv_format.py: widened block by block).
        A cache shorter than the sealed region, or whose sealed keys changed, is replanned.
        """
        if self.is_current(k):
            return 0
        cfg = self.cfg
        n = k.shape[1]
        if n < self.seal_end or not self._same_cache(k):
            self.reset()
        target = self.target_seal_end(n)
        if target <= self.seal_end:
            return 0
        bs, cpb = cfg.block_size, self.clusters_per_block
        # outliers of the frozen blocks: their slots lead extra_slots (ascending) and never change
        kept = int((self.out_slots[0, :self.frozen_blocks * cpb] >= 0).sum())
        last_block = (target - 1 - cfg.sink) // bs
        self._ensure((last_block + 1) * cpb)
        built = 0
        for j in range(self.frozen_blocks, last_block + 1):
            lo = cfg.sink + j * bs
            hi = min(lo + bs, target)
            self._build_block(j * cpb, lo, widen(k[:, lo:hi], self.d), widen(v[:, lo:hi], self.d))
            built += 1
            if hi - lo == bs:
                self.frozen_blocks = j + 1
            self.num_clusters = j * cpb + -(-(hi - lo) // cfg.cluster_size)
        self.seal_end = target
        self._fingerprint = k[:, target - 1].clone()
        if cfg.hierarchical:
            M = self.num_clusters
            self.tree = build_tree(self.counts[:M], self.summ[:, :M], self.resid[:, :M],
                                   self.vmean[:, :M], self.diagvar[:, :M], self.radius[:, :M],
                                   cfg.tree_fanout, cfg.tree_order)
        self._views()
        self._copy_outliers(k, v, kept)
        self.version += 1
        return built

    def _copy_outliers(self, k: torch.Tensor, v: torch.Tensor, kept: int = 0) -> None:
        """``extra_k``/``extra_v`` ``[Hkv, X, D]``: the cache's rows at ``extra_slots``, one
        contiguous copy per KV head. The native call reads the outliers from here because, read
        from the cache by slot, they are scattered rows, each a page walk away. Same values as
        the cache holds (the sealed region never changes), so every
        path's output is the same bits. At each rebuild the first ``kept`` rows (the frozen
        blocks' outliers, which lead the ascending slots) stay and the rest are gathered anew.
        Costs the outliers' rows once more (6% of the sealed rows at ``outliers`` = 8 of 128)."""
        idx = self.extra_slots[:, kept:].unsqueeze(-1).expand(-1, -1, k.shape[-1])
        self.extra_k = torch.cat([self.extra_k[:, :kept], widen(k.gather(1, idx), self.d)], 1)
        self.extra_v = torch.cat([self.extra_v[:, :kept], widen(v.gather(1, idx), self.d)], 1)

    def _build_block(self, c0: int, lo: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Cluster rows ``[lo, lo + n)`` into clusters ``c0 ..``; k, v float32 ``[Hkv, n, D]``."""
        cfg = self.cfg
        perm, s, k_rows, v_rows, out_perm = cluster_block(k, v, cfg.cluster_size, cfg.rank,
                                                          cfg.power_iterations, cfg.outliers)
        C = perm.shape[1]
        sl = slice(c0, c0 + C)
        self.counts[sl] = s.counts
        self.log_counts[sl] = s.counts.float().log()
        self.summ[:, sl, 0] = s.centroid
        self.summ[:, sl, 1:] = s.eigvec * s.eigval.sqrt().unsqueeze(-1)
        self.resid[:, sl] = s.resid
        self.vmean[:, sl] = s.vmean
        self.diagvar[:, sl] = s.diagvar
        self.radius[:, sl] = s.radius
        self.eigval[:, sl] = s.eigval
        self.slots[:, sl] = torch.where(perm >= 0, perm + lo, perm)
        self.out_slots[:, sl] = torch.where(out_perm >= 0, out_perm + lo, out_perm)
        self.pad_bias[sl] = torch.where(torch.arange(cfg.cluster_size) < s.counts.unsqueeze(1),
                                        0.0, float("-inf"))
        # q8_0 keys are kept relative to the centroid; the native call adds q.c from summ[:, :, 0],
        # so store and summaries must hold the very same centre
        self.store.write(c0, k_rows, v_rows, s.centroid)

    # --- reads ---------------------------------------------------------------------------
    def exact_slots(self, n: int) -> tuple[int, int]:
        """``(sink, seal_end)``: slots ``[0, sink)`` and ``[seal_end, n)`` are read exactly
        (and, per KV head, the clusters' outliers ``extra_slots`` in between)."""
        return min(self.cfg.sink, n), self.seal_end

    def exact_count(self, n: int) -> int:
        """Rows read exactly per KV head for a cache of ``n`` slots (sink, outliers, suffix):
        the length of each of ``exact_slot_lists(n)``'s rows, without building them."""
        s0, s1 = self.exact_slots(n)
        return s0 + self.extra_slots.shape[1] + n - s1

    @property
    def packed_rows(self) -> int:
        """Packed member rows per KV head (every head's clusters hold the same counts): what the
        probe scores per KV head and call (SCSAConfig.probe_dims)."""
        return int(self.counts[:self.num_clusters].sum())

    def exact_slot_lists(self, n: int) -> torch.Tensor:
        """int64 ``[Hkv, E]``: every slot read exactly, per KV head, ascending (the sink, the
        outliers, the unsealed suffix)."""
        s0, s1 = self.exact_slots(n)
        hkv = self.hkv
        return torch.cat([torch.arange(s0).expand(hkv, s0), self.extra_slots,
                          torch.arange(s1, n).expand(hkv, n - s1)], 1)
