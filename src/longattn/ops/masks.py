"""Who may read whom, by absolute position (docs/design.md, definitions).

A query at absolute position i may read key j when ``j <= i`` and ``i - j < W``
(W keys including itself), or when ``j < sinks``. ``W`` of ``None`` or ``<= 0`` means
full causal attention. Slots whose key position is negative are empty and never read.
"""

from __future__ import annotations

import torch


def window_lo(window: int | None, i: int) -> int:
    """First key position a query at position ``i`` may read under ``window`` (sinks aside)."""
    if window is None or window <= 0:
        return 0
    return max(0, i - window + 1)


def allowed_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None,
                 sinks: int = 0) -> torch.Tensor:
    """Boolean mask of readable (query, key) pairs.

    Args:
        q_pos: ``[B, Tq]`` absolute query positions (int64). Negative = padding query.
        k_pos: ``[B, Tk]`` absolute key positions per cache slot (int64). Negative = empty slot.
        window: keys per query including itself; ``None``/``<=0`` = full causal.
        sinks: the first ``sinks`` positions stay readable by every later query.
    Returns:
        ``[B, 1, Tq, Tk]`` bool, True where the query may read the key.

    With ``window=None`` and with any ``window >= Tq + Tk`` the mask is the same tensor,
    so attention over it is bit-identical (the first two exactness claims of docs/design.md).
    """
    qp = q_pos[:, :, None]
    kp = k_pos[:, None, :]
    ok = (kp >= 0) & (kp <= qp)
    if window is not None and window > 0:
        in_win = (qp - kp) < window
        if sinks > 0:
            in_win = in_win | (kp < sinks)
        ok = ok & in_win
    return ok[:, None]
