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
serves them all). With ``SCSAConfig.refine`` the rule is taken again after the read, with the
opened clusters' exact masses in place of their estimates (``refine_opened``).

Hierarchical mode (``select_tree``): a best-first walk over the interval tree of ``tree.py``,
run in NumPy (tiny arrays, where per-op overhead dominates); see its docstring.

Output: one softmax over [exact rows | opened clusters' packed rows | unopened clusters' tails],
the tail of an unopened cluster (or tree node) being weight ``m exp(a)`` at its value mean, with
one max subtracted from every part.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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


def refine_opened(opened: torch.Tensor, est: torch.Tensor, log_exact: torch.Tensor,
                  log_mass: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """One re-decision of the flat stop rule after the opened clusters have been read.

    The opened clusters' estimated masses leave the rule's total and their exact masses join the
    captured mass; the rule then runs again over the clusters not yet opened. Opened clusters are
    the ones with the highest estimates, which overestimate most (a capped estimate can sit tens
    of nats above the true mass of a cluster mixing a few aligned keys with many others), so the
    first decision undercounts every other cluster's share; a re-decision only ever adds clusters.

    Args:
        opened: bool ``[(S,) Hkv, M]``; est: ``[Hkv, g, M]`` log-mass estimates; log_exact:
            ``[Hkv, g]`` log-mass of the always-exact rows; log_mass: ``[Hkv, g, M]`` exact
            log-mass of each cluster's packed rows (read only where ``opened``); tau: ``[Hkv]``
            or ``[S, Hkv]``, as ``opened``'s leading axes.
    Returns:
        bool, ``opened``'s shape: ``opened`` plus what the rule still needs.
    """
    o = opened.unsqueeze(-2)  # [(S,) Hkv, 1, M]
    captured = torch.logaddexp(log_exact, torch.logsumexp(log_mass.masked_fill(~o, NEG_INF), -1))
    return opened | needed(est.masked_fill(o, NEG_INF), captured, tau)


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


def node_scores(qg, tree, ids, beta):
    """Scores of tree nodes ``ids`` (``[Hkv, F]``): ``(tail_logit, est)`` each ``[Hkv, g, F]``."""
    hkv, F = ids.shape
    nn = tree.num_nodes
    flat = (ids + torch.arange(hkv).unsqueeze(1) * nn).reshape(-1)
    summ = tree.summ.reshape(hkv * nn, *tree.summ.shape[2:]).index_select(0, flat)
    resid = tree.resid.reshape(hkv * nn, -1).index_select(0, flat)
    return cluster_scores(qg, summ.view(hkv, F, *summ.shape[1:]), resid.view(hkv, F, -1),
                          tree.log_counts[ids], tree.radius.gather(1, ids), beta)


def _compact(valid: torch.Tensor, *ts: torch.Tensor):
    """Move valid entries first along the last axis of each tensor and trim to the most valid."""
    keep = int(valid.sum(1).max())
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)[:, :keep]  # [Hkv, F']
    out = [valid.gather(1, order)]
    for t in ts:
        idx = order if t.dim() == 2 else order.unsqueeze(1).expand(-1, t.shape[1], -1)
        out.append(t.gather(-1, idx))
    return out


def walk_limit(round_index: int) -> int:
    """Most nodes one query head may open or expand in a round of the tree walk.

    Starting at 1 makes the walk best-first (it dives along the highest estimates instead of
    expanding every node the stop rule would need at the coarse levels); the limit doubles each
    round so long walks still finish in O(log(nodes)) rounds.
    """
    return 1 << round_index


def _np_logsumexp(x: np.ndarray, axis: int = -1) -> np.ndarray:
    mx = x.max(axis=axis, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    with np.errstate(divide="ignore"):
        return (np.log(np.exp(x - mx).sum(axis=axis, keepdims=True)) + mx).squeeze(axis)


class _HeadWalk:
    """The tree walk of one KV head in NumPy (tiny arrays: per-op overhead matters more than
    vectorisation, and NumPy's is far lower than torch's)."""

    def __init__(self, tree, h: int, q: np.ndarray, beta: float) -> None:
        self.summ, self.resid = tree.np_summ[h], tree.np_resid[h]  # [Nn, 1+r, D], [Nn, D]
        self.radius, self.log_counts = tree.np_radius[h], tree.np_log_counts  # [Nn], [Nn]
        self.q, self.q2, self.beta = q, q * q, beta  # [g, D]
        self.cap = beta * np.sqrt(self.q2.sum(-1, keepdims=True))  # [g, 1]

    def score(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(tail, est)`` of nodes ``ids``, each ``[g, len(ids)]`` (same formula as cluster_scores)."""
        s = self.summ[ids]  # [K, 1+r, D]
        K, r1, D = s.shape
        z = (self.q @ s.reshape(K * r1, D).T).reshape(-1, K, r1)  # [g, K, 1+r]
        quad = self.q2 @ self.resid[ids].T  # [g, K]
        if r1 > 1:
            quad = quad + np.square(z[..., 1:]).sum(-1)
        tail = z[..., 0] * self.beta + self.log_counts[ids]
        bound = self.cap * self.radius[ids]
        return tail, tail + np.minimum((0.5 * self.beta * self.beta) * quad, bound)


def select_tree(qg: torch.Tensor, tree, log_exact: torch.Tensor, tau: torch.Tensor,
                beta: float) -> tuple[Selection, torch.Tensor]:
    """Best-first walk of the interval tree, one frontier per KV head.

    The frontier starts at the root. Each round, every query head whose stop rule does not hold
    yet (uncaptured = estimated mass of frontier nodes not opened, total = exact rows + opened
    leaves + frontier) picks its highest-estimate frontier nodes, at most the stop-rule prefix
    and at most ``walk_limit(round)``; the g heads' picks are merged, picked leaves are opened,
    picked internal nodes are replaced by their children (which are scored). The walk ends when
    no head picks anything; unexpanded nodes and unopened leaves contribute their aggregated
    tails. tau = 0 expands the whole tree (every leaf opened, as flat at tau = 0).
    Returns the selection and the final frontier's tail logits ``[Hkv, g, F]``.
    """
    hkv, g, _ = qg.shape
    M = tree.num_leaves
    if bool((tau == 0).all()):  # the walk would expand every node: skip straight to its end
        ids = torch.arange(M).expand(hkv, M)
        none = torch.zeros(hkv, M, dtype=torch.bool)
        return Selection(~none, ids, none, hkv * tree.num_nodes), qg.new_full((hkv, g, M), NEG_INF)
    q_np, le_np, tau_np = qg.numpy(), log_exact.numpy(), tau.numpy()
    results, scored = [], 0
    for h in range(hkv):
        walk = _HeadWalk(tree, h, q_np[h], beta)
        ids = np.array([tree.root])
        is_open = np.zeros(1, dtype=bool)
        tail, est = walk.score(ids)
        scored += 1
        rnd = 0
        while True:
            with np.errstate(divide="ignore", invalid="ignore"):
                captured = np.logaddexp(le_np[h], _np_logsumexp(np.where(is_open, est, -np.inf)))  # [g]
                cand_est = np.where(is_open, -np.inf, est)  # [g, F]
                order = np.argsort(-cand_est, axis=1, kind="stable")
                srt = np.take_along_axis(cand_est, order, axis=1)
                mx = np.maximum(srt[:, :1], captured[:, None])
                e = np.exp(srt - mx)
                suffix = np.cumsum(e[:, ::-1], axis=1)[:, ::-1]
                total = np.exp(captured[:, None] - mx) + suffix[:, :1]
            k = np.minimum((suffix >= tau_np[h] * total).sum(1), walk_limit(rnd))  # [g]
            take = np.arange(ids.size) < k[:, None]  # [g, F] in sorted order
            pick = np.zeros(ids.size, dtype=bool)
            pick[order[take]] = True
            pick &= ~is_open
            if not pick.any():
                break
            rnd += 1
            leaf = tree.np_is_leaf[ids]
            is_open |= pick & leaf
            expand = pick & ~leaf
            if not expand.any():
                continue
            kids = tree.np_children[ids[expand]].ravel()
            kids = kids[kids >= 0]
            k_tail, k_est = walk.score(kids)
            scored += kids.size
            keep = ~expand
            ids = np.concatenate([ids[keep], kids])
            is_open = np.concatenate([is_open[keep], np.zeros(kids.size, dtype=bool)])
            tail = np.concatenate([tail[:, keep], k_tail], 1)
            est = np.concatenate([est[:, keep], k_est], 1)
        results.append((ids, is_open, tail))
    width = max(ids.size for ids, _, _ in results)
    ids_t = torch.zeros(hkv, width, dtype=torch.int64)
    valid = torch.zeros(hkv, width, dtype=torch.bool)
    is_open_t = torch.zeros(hkv, width, dtype=torch.bool)
    tail_t = qg.new_full((hkv, g, width), NEG_INF)
    for h, (ids, is_open, tail) in enumerate(results):
        n = ids.size
        ids_t[h, :n] = torch.from_numpy(ids)
        valid[h, :n] = True
        is_open_t[h, :n] = torch.from_numpy(is_open)
        tail_t[h, :, :n] = torch.from_numpy(tail)
    opened = torch.zeros(hkv, M + 1, dtype=torch.bool)
    opened.scatter_(1, torch.where(is_open_t, ids_t, torch.full_like(ids_t, M)), True)
    return Selection(opened[:, :M], ids_t, valid & ~is_open_t, scored), tail_t


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
