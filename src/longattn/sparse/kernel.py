"""The fast decode path of one batch row: priorities, the stop rule, and the merged softmax.

Notation (per KV head h and each of its g query heads): beta = scale; for a cluster (or tree
node) with count m, centroid c, low-rank rows ``w_j = sqrt(lam_j) u_j`` and residual diagonal
``rho``:

    a = beta * q.c                     (first cumulant; the tail logit is a + log m)
    L = a + log m + min(beta**2 / 2 * (sum_j (q.w_j)**2 + sum_d rho_d q_d**2), beta |q| r)

L is the second-cumulant estimate of ``log sum_{k in cluster} exp(beta q.k)``, capped by the
Cauchy-Schwarz bound (no member lies farther than the radius r from the centroid). A Gaussian
fitted to a cluster that mixes a few strongly aligned keys with many others can overestimate its
mass by tens of nats; the cap is itself an upper bound of the true log-mass, so capping never
turns an overestimate into an underestimate. All clusters of all heads are scored by two batched
matmuls against the concatenated summaries ``[c | w_1 .. w_r]`` and ``rho`` (three products in
all: q.c, q.w, q**2.rho).

Stop rule (decided before any member row is read): with clusters sorted by L descending, open the
shortest prefix such that ``sum(unopened est. mass) < tau * (exact mass + sum(all est. mass))``,
where the exact mass is that of the always-exact rows (sink + unsealed suffix). tau = 0 opens
everything. The g query heads sharing a KV head read the union of their prefixes (one gather
serves them all). The research variants of the rule live in ``experimental/``: the re-decided
rule (``SCSAConfig.refine``, ``experimental/refine.py``) and the hierarchical walk over an
interval tree (``SCSAConfig.hierarchical``, ``experimental/tree_walk.py``).

Output: one softmax over [exact rows | opened clusters' packed rows | unopened clusters' tails],
the tail of an unopened cluster (or tree node) being weight ``m exp(a)`` at its value mean, with
one max subtracted from every part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


def cluster_scores(qg: torch.Tensor, summ: torch.Tensor, resid: torch.Tensor,
                   log_counts: torch.Tensor, radius: torch.Tensor, beta: float,
                   qnorm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tail logits and log-mass estimates of T summaries.

    Args:
        qg: float32 ``[Hkv, g, D]``; summ ``[Hkv, T, 1 + r, D]`` (centroid first, then
            ``sqrt(lam) u`` rows); resid ``[Hkv, T, D]``; log_counts ``[T]`` or ``[Hkv, T]``;
            radius ``[Hkv, T]``; qnorm ``[Hkv, g]`` (|q|, computed when not given).
    Returns:
        ``(tail_logit, est)``: ``a + log m`` and ``L``, both ``[Hkv, g, T]``; ``L`` is capped
        by ``a + log m + beta |q| r``, which bounds the true log-mass (Cauchy-Schwarz).
    """
    hkv, T, r1, D = summ.shape
    z = torch.bmm(qg, summ.reshape(hkv, T * r1, D).transpose(1, 2)).view(hkv, -1, T, r1)
    quad = torch.bmm(qg.square(), resid.transpose(1, 2))  # [Hkv, g, T]
    if r1 > 1:
        quad = quad + z[..., 1:].square().sum(-1)
    lc = log_counts.unsqueeze(-2) if log_counts.dim() == 2 else log_counts
    tail = z[..., 0] * beta + lc
    if qnorm is None:
        qnorm = qg.norm(dim=-1)
    cap = (beta * qnorm).unsqueeze(-1) * radius.unsqueeze(1)  # [Hkv, g, T]
    return tail, tail + torch.minimum((0.5 * beta * beta) * quad, cap)


def stop_counts(est_sorted: torch.Tensor, log_exact: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """Clusters to open per row under the stop rule.

    Args:
        est_sorted: ``[..., T]`` log-mass estimates sorted descending (-inf allowed).
        log_exact: ``[...]`` log of the exact rows' mass (-inf when there are none).
        tau: broadcastable to ``[...]``.
    Returns:
        int64 ``[...]``: the smallest k with ``suffix_mass(k) < tau * total`` (T when none).
    """
    mx = torch.maximum(est_sorted[..., 0], log_exact).unsqueeze(-1)  # [..., 1]
    e = torch.exp(est_sorted - mx)
    # suffix[k] = mass of entries k..T-1; a reversed cumsum keeps small tails precise.
    suffix = e.flip(-1).cumsum(-1).flip(-1)
    total = torch.exp(log_exact.unsqueeze(-1) - mx) + suffix[..., :1]
    return (suffix >= tau.unsqueeze(-1) * total).sum(-1)


def needed(est: torch.Tensor, log_exact: torch.Tensor, tau: torch.Tensor,
           limit: int | None = None) -> torch.Tensor:
    """Union over the g query heads of the stop-rule prefixes.

    Args:
        est: ``[Hkv, g, T]`` log-mass estimates of the candidates (-inf = not a candidate).
        log_exact: ``[Hkv, g]`` log of the mass already captured (exact rows, opened leaves).
        tau: ``[Hkv]``, or ``[S, Hkv]`` for S thresholds at once (one sort serves them all).
        limit: caps each head's prefix.
    Returns:
        bool ``[Hkv, T]`` (or ``[S, Hkv, T]``).
    """
    T = est.shape[-1]
    est_sorted, order = torch.sort(est, dim=-1, descending=True, stable=True)
    k = stop_counts(est_sorted, log_exact, tau.unsqueeze(-1))  # [(S,) Hkv, g]
    if limit is not None:
        k = k.clamp_max(limit)
    take = torch.arange(T) < k.unsqueeze(-1)  # [(S,) Hkv, g, T] in sorted order
    return torch.zeros_like(take).scatter_(-1, order.expand_as(take), take).any(-2)


def probe_mask(qg: torch.Tensor, dims: int) -> torch.Tensor:
    """Each query head's ``dims`` largest-magnitude dimensions (ties: the lower dimension; all of
    them when ``dims >= D``), as a float 0/1 mask ``[Hkv, g, D]`` of ``qg`` ``[Hkv, g, D]``."""
    order = qg.abs().sort(dim=-1, descending=True, stable=True).indices[..., :dims]
    return torch.zeros_like(qg).scatter_(-1, order, 1.0)


def probe_opened(scores: torch.Tensor, cluster_size: int, keys: int) -> torch.Tensor:
    """Clusters holding each query head's ``keys`` best member rows: ``scores`` ``[Hkv, g, M * cs]``
    (cluster-major, padding -inf) -> bool ``[Hkv, M]``, the union over the g query heads. Ties
    go to the lower row (a stable sort), so every path makes the same choice."""
    hkv, _, R = scores.shape
    top = scores.sort(dim=-1, descending=True, stable=True).indices[..., :min(keys, R)]  # [Hkv, g, k]
    opened = torch.zeros(hkv, R // cluster_size, dtype=torch.bool)
    return opened.scatter_(1, (top // cluster_size).flatten(1), True)


def mask_to_ids(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Opened clusters per head in ascending order, padded to the largest count.

    Returns ``(idx [Hkv, K], valid [Hkv, K], counts)``; padded entries point at a real but
    unopened cluster and must be masked with ``valid``.
    """
    counts = mask.sum(1).tolist()
    k = max(counts)
    idx = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :k]
    valid = torch.arange(k) < torch.tensor(counts).unsqueeze(1)
    return idx, valid, counts


@dataclass
class Selection:
    """What one call opened and what it summarised (for the output and the accounting)."""

    opened: torch.Tensor      # [Hkv, M] bool, opened leaf clusters
    tail_ids: torch.Tensor    # [Hkv, T] ids of the tail candidates (leaves, or tree nodes)
    tail_mask: torch.Tensor   # [Hkv, T] bool, True = contributes through its tail
    scored: int               # summaries scored (all heads)


def select_flat(est: torch.Tensor, log_exact: torch.Tensor, tau: torch.Tensor) -> Selection:
    """Flat best-first selection over all M clusters (``est``: ``[Hkv, g, M]``)."""
    hkv, _, M = est.shape
    opened = needed(est, log_exact, tau)
    ids = torch.arange(M).expand(hkv, M)
    return Selection(opened, ids, ~opened, hkv * M)


def merged_output(s_exact: torch.Tensor, v_exact: torch.Tensor, s_open: torch.Tensor | None,
                  v_open: torch.Tensor | None, tail: torch.Tensor, v_tail: torch.Tensor) -> torch.Tensor:
    """``(exact num + opened num + tail num) / (their masses)`` with one max subtracted.

    Args:
        s_exact ``[Hkv, g, E]``, v_exact ``[Hkv, E, D]``; s_open ``[Hkv, g, R]`` (-inf = masked),
        v_open ``[Hkv, R, D]``; tail ``[Hkv, g, T]`` logits (-inf = not in the tail),
        v_tail ``[Hkv, T, D]``.
    Returns:
        float32 ``[Hkv, g, D]``.
    """
    parts = [(s_exact, v_exact), (tail, v_tail)]
    if s_open is not None:
        parts.append((s_open, v_open))
    parts = [(s, v) for s, v in parts if s.shape[-1] > 0]
    mx = parts[0][0].amax(-1, keepdim=True)
    for s, _ in parts[1:]:
        mx = torch.maximum(mx, s.amax(-1, keepdim=True))
    num, den = None, None
    for s, v in parts:
        p = torch.exp(s - mx)
        n = torch.bmm(p, v)
        d = p.sum(-1, keepdim=True)
        num = n if num is None else num + n
        den = d if den is None else den + d
    return num / den
