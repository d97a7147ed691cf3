"""What one row's sparse call computes once and every tau shares: the grouped query, the exact
rows with their scores and mass, and (flat selection) every cluster's tail logit and estimate.

The live call reads one tau, calibration replays the whole grid over the same ``Prepared``; the
lazily filled fields (the store's prepared query, the probe's clusters) are computed by the first
reader and kept for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.kv_format import widen

from .index import ClusterIndex
from .kernel import NEG_INF, cluster_scores


@dataclass(slots=True)
class Prepared:
    """Per-row quantities of one call (``E`` exact rows: sink, outliers, suffix in that order;
    ``M`` live clusters).

    Fields:
        qg: float32 ``[Hkv, g, D]``, the query grouped by the KV head its heads read.
        s_ex: float32 ``[Hkv, g, E]``, scaled scores with the exact rows (with learned sinks,
            the last column is each query head's sink logit).
        v_ex: float32 ``[Hkv, E, D]``, the exact rows' values (a zero row for the sinks).
        log_exact: float32 ``[Hkv, g]``, log of the exact rows' mass (-inf when there are none).
        n: the cache's length ``N``.
        tail: float32 ``[Hkv, g, M]``, every cluster's tail logit ``a + log m`` (flat
            selection with clusters; ``None`` otherwise).
        est: float32 ``[Hkv, g, M]``, every cluster's log-mass estimate (as ``tail``).
        qprep: the store's prepared query (``PackedStore.prepare_query``), filled by the first
            read of packed rows.
        probe: bool ``[Hkv, M]``, the clusters the probe opens (``SCSAConfig.probe_dims``),
            filled by the first selection that runs it.
    """

    qg: torch.Tensor
    s_ex: torch.Tensor
    v_ex: torch.Tensor
    log_exact: torch.Tensor
    n: int
    tail: torch.Tensor | None = None
    est: torch.Tensor | None = None
    qprep: object = None
    probe: torch.Tensor | None = None


def prepare(index: ClusterIndex, q_row: torch.Tensor, k_row: torch.Tensor, v_row: torch.Tensor,
            scale: float, group: int, flat_scores: bool,
            sink_logits: torch.Tensor | None = None) -> Prepared:
    """One row's shared quantities.

    Args:
        index: the row's cluster index (its exact slots and live summaries).
        q_row: ``[H, D]``; k_row, v_row: ``[Hkv, N, D]`` (or stored rows ``[Hkv, N, W]`` of
            another format: cache/kv_format.py); scale: beta.
        group: query heads per KV head (``H // Hkv``).
        flat_scores: also score every cluster (``tail``, ``est``), as flat selection needs.
        sink_logits: ``[H]`` learned sink logits (gpt-oss) or None: one more exact term per
            query head whose value row is zero, so they join the output's normaliser and the
            stop rule's exact mass.
    """
    hkv, n, W = k_row.shape
    D = q_row.shape[-1]
    qg = q_row.float().reshape(hkv, group, D)  # [Hkv, g, D]
    s0, s1 = index.exact_slots(n)
    at = index.extra_slots.unsqueeze(-1).expand(-1, -1, W)  # the outliers [Hkv, X, W]
    # sink, outliers, suffix: the order of every path's exact rows (stored rows widened)
    k_ex = widen(torch.cat([k_row[:, :s0], k_row.gather(1, at), k_row[:, s1:]], 1), D)  # [Hkv, E, D]
    v_ex = widen(torch.cat([v_row[:, :s0], v_row.gather(1, at), v_row[:, s1:]], 1), D)
    s_ex = torch.bmm(qg, k_ex.transpose(1, 2)) * scale  # [Hkv, g, E]
    if sink_logits is not None:
        s_ex = torch.cat([s_ex, sink_logits.float().view(hkv, group, 1)], -1)
        v_ex = torch.cat([v_ex, v_ex.new_zeros(hkv, 1, D)], 1)
    log_exact = torch.logsumexp(s_ex, -1) if s_ex.shape[-1] else s_ex.new_full(s_ex.shape[:2], NEG_INF)
    prep = Prepared(qg=qg, s_ex=s_ex, v_ex=v_ex, log_exact=log_exact, n=n)
    if index.num_clusters and flat_scores:
        prep.tail, prep.est = cluster_scores(qg, index.live_summ, index.live_resid,
                                             index.live_log_counts, index.live_radius, scale)
    return prep
