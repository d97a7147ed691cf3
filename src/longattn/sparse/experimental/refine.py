"""The re-decided stop rule (``SCSAConfig.refine``): flat selection taken again after the read,
with the opened clusters' exact masses in place of their estimates.
"""

from __future__ import annotations

import torch

from ..kernel import NEG_INF, needed


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
