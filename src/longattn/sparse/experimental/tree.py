"""A balanced interval tree over the leaf clusters of one index (hierarchical selection).

Node ids: the M leaves are ``0 .. M-1`` in cluster order; level 1 follows, then level 2, ...;
the last node is the root. A level-l node (l >= 2) covers ``fanout`` consecutive level-(l-1)
nodes; a level-1 node covers ``fanout`` leaves consecutive in the tree's leaf order (by default
``similarity_order``: leaves with similar centroids share a subtree, so an internal node's
Gaussian summary describes one region of key space instead of a slice of the cache's timeline
that mixes every key component).
Internal nodes carry exactly aggregated statistics of the keys below them:
count ``m = sum m_i``, centroid ``c = sum m_i c_i / m``, value mean likewise, and the diagonal
variance by the law of total variance ``var = sum m_i (var_i + (c_i - c)**2) / m``.
and a radius ``max_i (r_i + |c_i - c|)`` that no key below the node exceeds.
Every node is scored with the same formula as a leaf; internal nodes simply have no low-rank
part (their eigen rows are zero and their residual diagonal is the full diagonal variance).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import TREE_ORDERS

POWER_STEPS = 6


@dataclass
class ClusterTree:
    counts: torch.Tensor      # [Nn] int64
    log_counts: torch.Tensor  # [Nn] float32
    summ: torch.Tensor        # [Hkv, Nn, 1 + r, D]: centroid, then sqrt(lam) * u rows
    resid: torch.Tensor       # [Hkv, Nn, D]
    vmean: torch.Tensor       # [Hkv, Nn, D]
    radius: torch.Tensor      # [Hkv, Nn] no key below the node is farther from its centroid
    children: torch.Tensor    # [Nn, fanout] int64 node ids, -1 = none
    is_leaf: torch.Tensor     # [Nn] bool
    root: int
    num_leaves: int

    @property
    def num_nodes(self) -> int:
        return int(self.counts.shape[0])

    def __post_init__(self) -> None:
        # NumPy views (shared memory) for the walk, which works on tiny arrays.
        self.np_summ = self.summ.numpy()
        self.np_resid = self.resid.numpy()
        self.np_radius = self.radius.numpy()
        self.np_log_counts = self.log_counts.numpy()
        self.np_children = self.children.numpy()
        self.np_is_leaf = self.is_leaf.numpy()


def similarity_order(centroids: torch.Tensor, fanout: int) -> np.ndarray:
    """A leaf order in which every tree node's consecutive leaves have similar centroids.

    Top-down, like a k-d tree whose cells are the tree's nodes: a node covering leaf positions
    ``[lo, hi)`` (``fanout**l`` slots at level l) sorts its leaves by their projection on the
    principal direction of their centroids (all KV heads' centroids concatenated, so one order
    serves every head) and hands each child the next ``fanout**(l-1)`` of them. Grouping the result
    bottom-up in runs of ``fanout`` (as ``build_tree`` does) reproduces exactly these cells.
    Deterministic: the same leaves always give the same order.

    Args:
        centroids: ``[Hkv, M, D]``.
    Returns:
        int64 ``[M]``: leaf ids in tree order.
    """
    hkv, M, D = centroids.shape
    x = centroids.double().permute(1, 0, 2).reshape(M, hkv * D).numpy()
    perm = np.arange(M)
    width = 1
    while width < M:
        width *= fanout
    stack = [(0, M, width)]
    while stack:
        lo, hi, width = stack.pop()
        w = width // fanout
        if hi - lo <= 1 or w < 1:
            continue
        seg = perm[lo:hi]
        xs = x[seg] - x[seg].mean(0)
        v = xs[int(np.argmax((xs * xs).sum(1)))]
        for _ in range(POWER_STEPS):
            v = xs.T @ (xs @ v)
            nv = np.linalg.norm(v)
            if not nv > 0:
                break
            v = v / nv
        proj = xs @ v
        perm[lo:hi] = seg[np.argsort(proj, kind="stable")]
        for c0 in range(lo, hi, w):
            stack.append((c0, min(c0 + w, hi), w))
    return perm


def build_tree(counts: torch.Tensor, summ: torch.Tensor, resid: torch.Tensor, vmean: torch.Tensor,
               diagvar: torch.Tensor, radius: torch.Tensor, fanout: int, order: str = "similar") -> ClusterTree:
    """Aggregate leaves into a tree.

    Args:
        counts: int64 ``[M]``; summ ``[Hkv, M, 1 + r, D]`` (centroid first); resid, vmean,
            diagvar ``[Hkv, M, D]`` (diagvar = the full covariance diagonal of each leaf);
            radius ``[Hkv, M]``. A parent's radius is ``max_i (r_i + |c_i - c|)`` over its children.
        order: how leaves are grouped into level-1 nodes: ``"similar"`` (``similarity_order``)
            or ``"cache"`` (cluster order, i.e. by position in the cache).
    """
    hkv, M, r1, D = summ.shape
    if order == "similar":
        perm = torch.from_numpy(similarity_order(summ[:, :, 0], fanout))
    elif order == "cache":
        perm = torch.arange(M)
    else:
        raise ValueError(f"tree order must be one of {TREE_ORDERS}, got {order!r}")
    lvl_counts = [counts.to(torch.float64)[perm]]
    lvl_cen = [summ[:, perm, 0].double()]
    lvl_vm = [vmean[:, perm].double()]
    lvl_var = [diagvar[:, perm].double()]
    lvl_rad = [radius[:, perm].double()]
    sizes = [M]
    while sizes[-1] > 1:
        n_prev = sizes[-1]
        n = -(-n_prev // fanout)
        pad = n * fanout - n_prev
        w = torch.nn.functional.pad(lvl_counts[-1], (0, pad)).view(n, fanout)  # [n, f]

        def group(x):  # [Hkv, n_prev, D] -> [Hkv, n, f, D]
            return torch.nn.functional.pad(x, (0, 0, 0, pad)).view(hkv, n, fanout, D)

        m = w.sum(1)  # [n]
        wf = w.view(1, n, fanout, 1)
        cen_c = group(lvl_cen[-1])
        cen = (cen_c * wf).sum(2) / m.view(1, n, 1)
        vm = (group(lvl_vm[-1]) * wf).sum(2) / m.view(1, n, 1)
        var = ((group(lvl_var[-1]) + (cen_c - cen.unsqueeze(2)).square()) * wf).sum(2) / m.view(1, n, 1)
        gap = (cen_c - cen.unsqueeze(2)).norm(dim=-1)  # [Hkv, n, f]
        rad_c = torch.nn.functional.pad(lvl_rad[-1], (0, pad)).view(hkv, n, fanout)
        rad = torch.where(w.view(1, n, fanout) > 0, rad_c + gap, torch.zeros_like(gap)).amax(-1)
        lvl_rad.append(rad)
        lvl_counts.append(m)
        lvl_cen.append(cen)
        lvl_vm.append(vm)
        lvl_var.append(var)
        sizes.append(n)

    offsets = [0]
    for s in sizes[:-1]:
        offsets.append(offsets[-1] + s)
    nn = offsets[-1] + sizes[-1]
    children = torch.full((nn, fanout), -1, dtype=torch.int64)
    for lvl in range(1, len(sizes)):
        n, n_prev = sizes[lvl], sizes[lvl - 1]
        local = torch.arange(n * fanout).view(n, fanout)  # child index within level below
        below = perm[local.clamp_max(n_prev - 1)] if lvl == 1 else local + offsets[lvl - 1]
        ids = torch.where(local < n_prev, below, torch.full_like(local, -1))
        children[offsets[lvl]:offsets[lvl] + n] = ids

    internal_summ = []
    for lvl in range(1, len(sizes)):
        s = summ.new_zeros(hkv, sizes[lvl], r1, D)
        s[:, :, 0] = lvl_cen[lvl].float()
        internal_summ.append(s)
    all_counts = torch.cat([counts.to(torch.float64)] + lvl_counts[1:]).round().to(torch.int64)
    is_leaf = torch.zeros(nn, dtype=torch.bool)
    is_leaf[:M] = True
    return ClusterTree(
        counts=all_counts,
        log_counts=all_counts.float().log(),
        summ=torch.cat([summ] + internal_summ, 1),
        resid=torch.cat([resid] + [v.float() for v in lvl_var[1:]], 1),
        vmean=torch.cat([vmean] + [v.float() for v in lvl_vm[1:]], 1),
        radius=torch.cat([radius] + [r.float() for r in lvl_rad[1:]], 1),
        children=children,
        is_leaf=is_leaf,
        root=nn - 1,
        num_leaves=M,
    )
