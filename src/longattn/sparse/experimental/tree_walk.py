"""Hierarchical selection (``SCSAConfig.hierarchical``): a best-first walk over the interval
tree of ``tree.py``, one frontier per KV head, run in NumPy (tiny arrays, where per-op overhead
dominates); see ``select_tree``.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernel import NEG_INF, Selection


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


def leaves_under(tree, node: int) -> list[int]:
    """The leaf clusters below tree node ``node`` (the node itself when it is a leaf)."""
    stack, out = [node], []
    while stack:
        x = stack.pop()
        if bool(tree.is_leaf[x]):
            out.append(x)
        else:
            stack.extend(c for c in tree.children[x].tolist() if c >= 0)
    return out
