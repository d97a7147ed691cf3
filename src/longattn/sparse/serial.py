"""The slow, obviously-correct SCSA path: one KV head, one query head, one cluster at a time.

Float64, Python loops, the formulas written out as in the paper notes. It reads the same index
(summaries, tree, packed rows) as the fast path and must make the same decisions; tests compare
the two. Selected by ``SCSAConfig(serial=True)``.
"""

from __future__ import annotations

import math

import torch

from ..cache.kv_format import widen

from .experimental.tree_walk import walk_limit
from .kernel import Selection


def _estimate(q: torch.Tensor, summ: torch.Tensor, resid: torch.Tensor, count: int, radius: float,
              beta: float):
    """(tail logit a + log m, capped second-cumulant log-mass) of one summary, float64."""
    a = beta * float(q @ summ[0])
    quad = sum(float(q @ w) ** 2 for w in summ[1:]) + float((q * q) @ resid)
    cap = beta * float(q.norm()) * radius  # no member scores above beta * (q.c + |q| r)
    return a + math.log(count), a + math.log(count) + min(0.5 * beta * beta * quad, cap)


def _prefix(est: dict, log_exact: float, tau: float) -> list:
    """Keys of ``est`` opened by the stop rule: best first until the rest < tau * total."""
    if not est:
        return []
    order = sorted(est, key=lambda key: (-est[key], key))
    finite = [est[key] for key in order if est[key] > -math.inf]
    mx = max(finite + [log_exact])
    mass = [math.exp(est[key] - mx) if est[key] > -math.inf else 0.0 for key in order]
    total = math.exp(log_exact - mx) + math.fsum(mass)
    k = 0
    while k < len(order) and math.fsum(mass[k:]) >= tau * total:
        k += 1
    return order[:k]


def _logsumexp(xs: list) -> float:
    if not xs:
        return -math.inf
    mx = max(xs)
    return mx + math.log(math.fsum(math.exp(x - mx) for x in xs))


def probe_clusters(cfg, index, h: int, qs: torch.Tensor) -> set:
    """The clusters KV head ``h``'s probe opens (``SCSAConfig.probe_dims``) for its query heads
    ``qs`` float32 ``[g, D]``: per query head, every member row scored ``q.c + q_S.(k - c)_S`` one
    at a time, the ``probe_keys`` best rows by (score, cluster, row)."""
    chosen = set()
    D, cs = qs.shape[1], cfg.cluster_size
    for q in qs:
        dims = sorted(range(D), key=lambda i: (-abs(float(q[i])), i))[:cfg.probe_dims]
        qm = torch.zeros_like(q)
        qm[dims] = q[dims]
        q_store = index.store.query_view(qm.view(1, 1, D))[0, 0].double()  # q_S as the store scores it
        qm64, rest = qm.double(), (q - qm).double()
        rows = []
        for c in range(index.num_clusters):
            kc = index.store.cluster_rows(h, c)[0]  # relative to key_center(h, c)
            base = float(qm64 @ index.store.key_center(h, c)) + float(rest @ index.summ[h, c, 0].double())
            rows.extend((-(base + float(q_store @ kc[i])), c * cs + i) for i in range(int(index.counts[c])))
        chosen |= {r // cs for _, r in sorted(rows)[:cfg.probe_keys]}
    return chosen


def serial_row(cfg, index, q_row: torch.Tensor, k_row: torch.Tensor, v_row: torch.Tensor, beta: float,
               taus: torch.Tensor, sink_logits: torch.Tensor | None = None):
    """Sparse output of one batch row: ``q_row [H, D]``, ``k_row/v_row [Hkv, N, D]``; learned
    ``sink_logits [H]`` (or None) join the exact terms with zero value rows.

    Returns ``(out [Hkv, g, D] float64, Selection)``.
    """
    hkv, n, _ = k_row.shape
    D = q_row.shape[-1]
    g = q_row.shape[0] // hkv
    M = index.num_clusters
    exact_lists = index.exact_slot_lists(n).tolist()  # per KV head: sink, outliers, suffix
    out = torch.zeros(hkv, g, D, dtype=torch.float64)
    opened_all = torch.zeros(hkv, M, dtype=torch.bool)
    tails: list[list[int]] = []
    scored = 0

    def member_logits(h: int, c: int, q_full: torch.Tensor, q_packed: torch.Tensor) -> list:
        """Logits of cluster c's packed rows (KV head h) for one query head, as the read scores
        them: the centre term with the full-precision query ``q_full``, the rows with the query
        as the store sees it, ``q_packed`` (both float64 ``[D]``)."""
        kc = index.store.cluster_rows(h, c)[0]  # keys relative to key_center(h, c)
        qc = float(q_full @ index.store.key_center(h, c))
        return [beta * (qc + float(q_packed @ kc[i])) for i in range(int(index.counts[c]))]

    for h in range(hkv):
        qs = q_row[h * g:(h + 1) * g].float()
        q64 = qs.double()  # exact rows and tails see the full-precision query
        q_store = index.store.query_view(qs.unsqueeze(0))[0].double()  # opened rows: as packed
        exact_slots = exact_lists[h]
        kx = widen(k_row[h, exact_slots], D, torch.float64)
        vx = widen(v_row[h, exact_slots], D, torch.float64)
        exact_logits = [[beta * float(q64[j] @ kx[i]) for i in range(len(exact_slots))] for j in range(g)]
        if sink_logits is not None:  # one more exact term per query head, its value row zero
            for j in range(g):
                exact_logits[j].append(float(sink_logits[h * g + j]))
            vx = torch.cat([vx, vx.new_zeros(1, D)])
        log_exact = [_logsumexp(row) for row in exact_logits]
        tau = float(taus[h])
        if M == 0:
            chosen, tail_nodes = set(), []
        elif not cfg.hierarchical:
            summ, resid = index.summ[h, :M].double(), index.resid[h, :M].double()
            counts, vmean = index.counts[:M].tolist(), index.vmean[h, :M].double()
            radius = index.radius[h, :M].tolist()
            est = [{c: _estimate(q64[j], summ[c], resid[c], counts[c], radius[c], beta)[1] for c in range(M)}
                   for j in range(g)]
            scored += M
            chosen = set()
            for j in range(g):
                chosen |= set(_prefix(est[j], log_exact[j], tau))
            if cfg.probe_dims:
                chosen |= probe_clusters(cfg, index, h, qs)
            for _ in range(cfg.refine):  # re-decide with the opened clusters' exact masses
                more = set()
                for j in range(g):
                    captured = _logsumexp([log_exact[j]] + [_logsumexp(member_logits(h, c, q64[j], q_store[j]))
                                                             for c in chosen])
                    more |= set(_prefix({c: est[j][c] for c in range(M) if c not in chosen}, captured, tau))
                if not more:
                    break
                chosen |= more
            tail_nodes = [c for c in range(M) if c not in chosen]
        else:
            tree = index.tree
            summ, resid = tree.summ[h].double(), tree.resid[h].double()
            counts, vmean = tree.counts.tolist(), tree.vmean[h].double()
            radius = tree.radius[h].tolist()

            def est_of(j, x):
                return _estimate(q64[j], summ[x], resid[x], counts[x], radius[x], beta)[1]

            if tau == 0.0:  # the walk expands every node: all leaves opened
                frontier, chosen = list(range(tree.num_leaves)), set(range(tree.num_leaves))
                scored += tree.num_nodes
            else:
                frontier, chosen = [tree.root], set()
                scored += 1
                rnd = 0
                while True:
                    pick = set()
                    for j in range(g):
                        captured = _logsumexp([log_exact[j]] + [est_of(j, x) for x in chosen])
                        cand = {x: est_of(j, x) for x in frontier if x not in chosen}
                        pick |= set(_prefix(cand, captured, tau)[:walk_limit(rnd)])
                    if not pick:
                        break
                    rnd += 1
                    chosen |= {x for x in pick if bool(tree.is_leaf[x])}
                    expand = [x for x in frontier if x in pick and not bool(tree.is_leaf[x])]
                    kids = [c for x in expand for c in tree.children[x].tolist() if c >= 0]
                    scored += len(kids)
                    frontier = [x for x in frontier if x not in expand] + kids
            tail_nodes = [x for x in frontier if x not in chosen]
        for c in chosen:
            opened_all[h, c] = True
        tails.append(tail_nodes)
        for j in range(g):
            logits, rows = list(exact_logits[j]), [vx[i] for i in range(vx.shape[0])]
            for c in sorted(chosen):
                logits.extend(member_logits(h, c, q64[j], q_store[j]))
                vc = index.store.cluster_rows(h, c)[1]
                rows.extend(vc[i] for i in range(int(index.counts[c])))
            for x in tail_nodes:
                logits.append(_estimate(q64[j], summ[x], resid[x], counts[x], radius[x], beta)[0])
                rows.append(vmean[x])
            mx = max(logits)
            w = [math.exp(s - mx) for s in logits]
            out[h, j] = sum(wi * r for wi, r in zip(w, rows)) / math.fsum(w)
    width = max([len(t) for t in tails] + [0])
    tail_ids = torch.zeros(hkv, width, dtype=torch.int64)
    tail_mask = torch.zeros(hkv, width, dtype=torch.bool)
    for h, t in enumerate(tails):
        tail_ids[h, :len(t)] = torch.tensor(t, dtype=torch.int64)
        tail_mask[h, :len(t)] = True
    return out, Selection(opened_all, tail_ids, tail_mask, scored)
