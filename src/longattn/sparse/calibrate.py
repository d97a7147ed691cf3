"""Self-calibration of the stop threshold tau, one value per KV head group.

For the first ``calib_steps`` decode calls that have an index the layer runs exactly and, for
every tau of the grid, replays the stop rule and the sparse output. Each sample records, per KV
head, the worst relative error ``||o_tau - o_exact|| / ||o_exact||`` over the query heads that
share it (they read one union selection, so they share one tau). Then each head freezes the
largest tau whose median error over the samples meets the tolerance (the smallest grid value
when none does; ``tau_default`` when the head never saw a sample).
"""

from __future__ import annotations

import torch


def relative_error(o: torch.Tensor, o_exact: torch.Tensor) -> torch.Tensor:
    """``||o - o_exact|| / ||o_exact||`` over the last axis (``[..., D] -> [...]``)."""
    den = o_exact.double().norm(dim=-1).clamp_min(1e-30)
    return (o.double() - o_exact.double()).norm(dim=-1) / den


class Calibrator:
    """Collects replayed errors ``[T, Hkv]`` per sample and picks each head's tau."""

    def __init__(self, grid: tuple, steps: int, tolerance: float, num_kv_heads: int) -> None:
        self.grid = torch.tensor(grid, dtype=torch.float64)
        self.steps = steps
        self.tolerance = tolerance
        self.hkv = num_kv_heads
        self.samples: list[torch.Tensor] = []  # each [T, Hkv]
        self.calls = 0

    @property
    def done(self) -> bool:
        return self.calls >= self.steps

    def record(self, errors: list[torch.Tensor]) -> None:
        """One calibration call: a ``[T, Hkv]`` error table per batch row."""
        self.samples.extend(e.double() for e in errors)
        self.calls += 1

    def medians(self) -> torch.Tensor:
        """Median replayed error per (tau, head): ``[T, Hkv]`` (NaN without samples)."""
        if not self.samples:
            return torch.full((len(self.grid), self.hkv), float("nan"), dtype=torch.float64)
        return torch.stack(self.samples).median(0).values

    def choose(self, tau_default: float) -> torch.Tensor:
        """Frozen tau per KV head, float32 ``[Hkv]``."""
        if not self.samples:
            return torch.full((self.hkv,), tau_default)
        ok = self.medians() <= self.tolerance  # [T, Hkv]
        pos = torch.arange(len(self.grid)).unsqueeze(1).expand_as(ok)
        best = torch.where(ok, pos, torch.zeros_like(pos)).amax(0)  # index of the largest passing tau
        return self.grid[best].float()
