"""Deterministic farthest-direction splitting of a block of keys, and per-cluster summaries.

Splitting (per KV head, all heads at once): a segment of more than ``cluster_size`` keys picks a
pivot ``a`` = the key farthest from the segment mean, then ``b`` = the key farthest from ``a``,
orders its keys by projection on ``b - a`` and cuts at a cluster-aligned median (the left part
gets ``ceil(L / 2) * cluster_size`` keys where ``L = ceil(n / cluster_size)``); ``SPLIT_REFINE``
rounds of balanced 2-means then move the poles to the two sides' means and re-cut (on mixtures of
Gaussians this gives purer clusters than the plain farthest-pair cut); then it recurses. So
every cluster is full except at most the last of a block. Segment sizes depend only on the block
length, so all heads (and all segments of one size at one level) are split as one batch of tensor
ops; the same block always yields the same clusters, bit for bit.

Summaries (batched over heads and clusters): count m, key centroid c_K, value mean, the top-``rank``
eigenpairs of the key covariance by power iteration with deflation, the residual diagonal
``diag(Cov) - sum_j lam_j u_j**2`` (clamped at 0), and the radius (largest member distance from
the centroid, which caps the mass estimate: no member scores above ``beta (q.c + |q| r)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Balanced 2-means rounds after the farthest-pair split (0 = the plain farthest-direction split).
SPLIT_REFINE = 3


def _cut(n: int, cluster_size: int) -> int:
    """Keys sent left when a segment of ``n > cluster_size`` keys is split."""
    leaves = -(-n // cluster_size)
    return -(-leaves // 2) * cluster_size


def _farthest_direction_order(x: torch.Tensor, left: int, refine: int) -> torch.Tensor:
    """Order of keys along the farthest-pair direction: ``[G, n, D] -> [G, n]`` (stable).

    ``refine`` rounds of balanced 2-means then move the two poles to the means of the two sides
    of the cut (the first ``left`` keys in the order) and re-order along the new direction.
    Distances use ``|x - y|^2 = |x|^2 - 2 x.y + |y|^2`` so every pass is one dot per key.
    """
    G, n, D = x.shape
    sq = x.square().sum(-1)  # [G, n]

    def dots(y):  # [G, D] -> x . y  [G, n]  (mul + sum beats a batched mat-vec on CPU)
        return (x * y.unsqueeze(1)).sum(-1)

    def row(i):  # [G] -> [G, D]
        return x.gather(1, i.view(G, 1, 1).expand(G, 1, D)).squeeze(1)

    a = row((sq - 2 * dots(x.mean(1))).argmax(-1))  # farthest from the mean
    b = row((sq - 2 * dots(a)).argmax(-1))  # farthest from a
    order = torch.argsort(dots(b - a), dim=-1, stable=True)  # [G, n]
    for _ in range(refine):
        is_left = torch.zeros(G, n).scatter_(1, order[:, :left], 1.0)  # [G, n]
        w = torch.stack([is_left / left, (1 - is_left) / (n - left)], 1)  # [G, 2, n]
        poles = torch.bmm(w, x)  # [G, 2, D]: means of the two sides
        order = torch.argsort(dots(poles[:, 1] - poles[:, 0]), dim=-1, stable=True)
    return order


def split_block(keys: torch.Tensor, cluster_size: int,
                refine: int = SPLIT_REFINE) -> tuple[torch.Tensor, list[int]]:
    """Cluster one block of keys for every KV head.

    Args:
        keys: float32 ``[Hkv, n, D]``.
    Returns:
        ``(perm, sizes)``: ``perm`` int64 ``[Hkv, n]`` lists block rows cluster by cluster;
        ``sizes`` are the cluster sizes in order (identical for all heads).
    """
    hkv, n, D = keys.shape
    perm = torch.arange(n).expand(hkv, n).clone()  # [Hkv, n]
    segments = [(0, n)]
    flat_keys = keys.reshape(hkv * n, D)
    head_base = (torch.arange(hkv) * n).view(hkv, 1, 1)
    while any(m > cluster_size for _, m in segments):
        by_size: dict[int, list[int]] = {}
        for s, m in segments:
            if m > cluster_size:
                by_size.setdefault(m, []).append(s)
        for m, starts in sorted(by_size.items()):
            pos = torch.tensor(starts).unsqueeze(1) + torch.arange(m)  # [S, m]
            rows = perm[:, pos]  # [Hkv, S, m]
            x = flat_keys.index_select(0, (rows + head_base).reshape(-1))
            x = x.view(hkv * len(starts), m, D)  # [Hkv*S, m, D]
            order = _farthest_direction_order(x, _cut(m, cluster_size), refine).view(hkv, len(starts), m)
            perm[:, pos] = rows.gather(-1, order)
        nxt = []
        for s, m in segments:
            if m > cluster_size:
                left = _cut(m, cluster_size)
                nxt += [(s, left), (s + left, m - left)]
            else:
                nxt.append((s, m))
        segments = nxt
    return perm, [m for _, m in segments]


@dataclass
class ClusterSummaries:
    """Summaries of C clusters for every KV head (shapes ``[Hkv, C, ...]``)."""

    counts: torch.Tensor     # [C] int64 (same for all heads)
    centroid: torch.Tensor   # [Hkv, C, D]
    vmean: torch.Tensor      # [Hkv, C, D]
    eigvec: torch.Tensor     # [Hkv, C, r, D] unit vectors (zero when the variance is exhausted)
    eigval: torch.Tensor     # [Hkv, C, r] >= 0
    resid: torch.Tensor      # [Hkv, C, D] diagonal variance left after the rank-r part
    diagvar: torch.Tensor    # [Hkv, C, D] full diagonal of the covariance
    radius: torch.Tensor     # [Hkv, C] largest member distance from the centroid


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm(dim=-1, keepdim=True).clamp_min(1e-30)


def top_eigenpairs(cov: torch.Tensor, rank: int, iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Power iteration with deflation, batched: ``[G, D, D]`` PSD -> (``[G, r, D]``, ``[G, r]``).

    Each pair starts from the covariance column with the largest diagonal entry (deterministic,
    inside the range of the matrix), takes ``iterations`` steps, and is deflated away.
    """
    G, D, _ = cov.shape
    c = cov.clone()
    vecs, vals = [], []
    for _ in range(rank):
        j = c.diagonal(dim1=-2, dim2=-1).argmax(-1)  # [G]
        v = _unit(c.gather(2, j.view(G, 1, 1).expand(G, D, 1)).squeeze(-1))  # [G, D]
        for _ in range(iterations):
            v = _unit(torch.bmm(c, v.unsqueeze(-1)).squeeze(-1))
        lam = (v * torch.bmm(c, v.unsqueeze(-1)).squeeze(-1)).sum(-1).clamp_min(0.0)  # [G]
        c = c - lam.view(G, 1, 1) * v.unsqueeze(2) * v.unsqueeze(1)
        vecs.append(v)
        vals.append(lam)
    if rank == 0:
        return cov.new_zeros(G, 0, D), cov.new_zeros(G, 0)
    return torch.stack(vecs, 1), torch.stack(vals, 1)


def summarize(keys: torch.Tensor, values: torch.Tensor, counts: torch.Tensor, rank: int,
              iterations: int) -> ClusterSummaries:
    """Summaries of clusters given their member rows.

    Args:
        keys, values: float32 ``[Hkv, C, cs, D]``, rows past ``counts[c]`` are zero padding.
        counts: int64 ``[C]`` members per cluster (>= 1).
    """
    hkv, C, cs, D = keys.shape
    valid = (torch.arange(cs) < counts.unsqueeze(1)).to(keys.dtype)  # [C, cs]
    m = counts.to(keys.dtype).view(1, C, 1)  # [1, C, 1]
    centroid = keys.sum(2) / m  # [Hkv, C, D]
    vmean = values.sum(2) / m
    xc = (keys - centroid.unsqueeze(2)) * valid.view(1, C, cs, 1)  # [Hkv, C, cs, D]
    radius = xc.norm(dim=-1).amax(-1)  # [Hkv, C]
    xc = xc.reshape(hkv * C, cs, D)
    cov = torch.bmm(xc.transpose(1, 2), xc) / m.reshape(1, C).expand(hkv, C).reshape(-1, 1, 1)
    vecs, vals = top_eigenpairs(cov, rank, iterations)  # [G, r, D], [G, r]
    diag = cov.diagonal(dim1=-2, dim2=-1)  # [G, D]
    resid = (diag - (vals.unsqueeze(-1) * vecs.square()).sum(1)).clamp_min(0.0)
    return ClusterSummaries(
        counts=counts.clone(),
        centroid=centroid,
        vmean=vmean,
        eigvec=vecs.view(hkv, C, rank, D),
        eigval=vals.view(hkv, C, rank),
        resid=resid.view(hkv, C, D),
        diagvar=diag.reshape(hkv, C, D).clone(),
        radius=radius,
    )


def outlier_counts(counts: torch.Tensor, outliers: int) -> torch.Tensor:
    """Members taken out of each cluster as outliers: ``min(outliers, m // 2)``, so a cluster
    keeps at least half of its members (int64 ``[C]``; the same for every KV head)."""
    return torch.minimum(torch.full_like(counts, outliers), counts // 2)


def outlier_width(outliers: int, cluster_size: int) -> int:
    """Most outliers one cluster can give (``min(outliers, cluster_size // 2)``): the width of
    the per-cluster outlier tables."""
    return min(outliers, cluster_size // 2)


def take_outliers(keys: torch.Tensor, perm: torch.Tensor, counts: torch.Tensor,
                  outliers: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Take each cluster's members farthest from its centroid out of it.

    Args:
        keys: float32 ``[Hkv, C, cs, D]`` member rows (zero padded); perm int64 ``[Hkv, C, cs]``
            their block rows (-1 = padding); counts int64 ``[C]``.
    Returns:
        ``(order, out_perm, kept)``: ``order`` ``[Hkv, C, cs]`` positions within each cluster,
        the kept members first (in their original order), then the outliers, then padding;
        ``out_perm`` ``[Hkv, C, outliers]`` the outliers' block rows (-1 where a cluster has
        fewer); ``kept`` ``[C]`` the members left per cluster.
    """
    hkv, C, cs, D = keys.shape
    n_out = outlier_counts(counts, outliers)  # [C]
    valid = perm >= 0
    centroid = keys.sum(2) / counts.to(keys.dtype).view(1, C, 1)  # [Hkv, C, D]
    dist = (keys - centroid.unsqueeze(2)).norm(dim=-1).masked_fill(~valid, -1.0)  # [Hkv, C, cs]
    far = torch.argsort(dist, dim=-1, descending=True, stable=True)[..., :outliers]  # [Hkv, C, o]
    is_out_rank = torch.arange(outliers) < n_out.view(1, C, 1)  # [1, C, o]
    out_perm = torch.where(is_out_rank, perm.gather(-1, far), -1)
    is_out = torch.zeros(hkv, C, cs, dtype=torch.bool).scatter_(-1, far, is_out_rank.expand(hkv, -1, -1))
    rank = torch.where(valid, is_out.to(torch.int8), 2)  # 0 kept member, 1 outlier, 2 padding
    order = torch.argsort(rank, dim=-1, stable=True)
    return order, out_perm, counts - n_out


def cluster_block(keys: torch.Tensor, values: torch.Tensor, cluster_size: int, rank: int,
                  iterations: int, outliers: int = 0):
    """Split one block and summarise its clusters.

    Args:
        keys, values: float32 ``[Hkv, n, D]`` (one block of consecutive cache slots).
        outliers: members per cluster (farthest from its centroid, at most half of the cluster)
            taken out of it to be attended exactly; see ``take_outliers``.
    Returns:
        ``(perm, summaries, k_rows, v_rows, out_perm)``: ``perm`` int64 ``[Hkv, C, cs]``
        block-relative row of each cluster member (-1 = padding), the member rows
        ``[Hkv, C, cs, D]`` (zero padded) ready for packing, and ``out_perm`` int64
        ``[Hkv, C, outlier_width(outliers, cs)]`` the block rows taken out as outliers
        (-1 = none). Summaries and rows describe the members that stay.
    """
    hkv, n, D = keys.shape
    order, sizes = split_block(keys, cluster_size)
    C = len(sizes)
    counts = torch.tensor(sizes, dtype=torch.int64)
    perm = torch.full((hkv, C * cluster_size), -1, dtype=torch.int64)
    # Member i of cluster c lands at c*cs + i; clusters are consecutive runs of `order`.
    starts = torch.cumsum(counts, 0) - counts  # [C]
    dest = (torch.arange(C) * cluster_size).repeat_interleave(counts) + \
        (torch.arange(n) - starts.repeat_interleave(counts))  # [n]
    perm[:, dest] = order
    perm = perm.view(hkv, C, cluster_size)

    def rows_of(perm):  # [Hkv, C, cs] block rows -> keys, values [Hkv, C, cs, D] (zero padded)
        safe = perm.clamp_min(0).view(hkv, -1, 1).expand(-1, -1, D)
        pad = (perm >= 0).unsqueeze(-1)
        k_rows = torch.where(pad, torch.gather(keys, 1, safe).view(hkv, C, cluster_size, D), 0.0)
        v_rows = torch.where(pad, torch.gather(values, 1, safe).view(hkv, C, cluster_size, D), 0.0)
        return k_rows, v_rows

    k_rows, v_rows = rows_of(perm)
    outliers = outlier_width(outliers, cluster_size)  # a setting above half a cluster is capped
    out_perm = perm.new_full((hkv, C, outliers), -1)
    if outliers:
        within, out_perm, counts = take_outliers(k_rows, perm, counts, outliers)
        perm = perm.gather(-1, within)
        perm = torch.where(torch.arange(cluster_size) < counts.view(1, C, 1), perm, -1)
        k_rows, v_rows = rows_of(perm)
    summ = summarize(k_rows, v_rows, counts, rank, iterations)
    return perm, summ, k_rows, v_rows, out_perm
