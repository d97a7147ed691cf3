"""Self-calibration of the stop threshold tau, one value per KV head group.

For the first ``calib_steps`` decode calls that have an index the layer runs exactly and, for
every tau of the grid, replays the stop rule and the sparse output. Each sample records, per KV
head, one error for the query heads that share it (they read one union selection, so they share
one tau): with ``calib_metric="head"`` the worst relative error ``||o_tau - o_exact|| /
||o_exact||`` over those heads, with ``"group"`` the relative error of their outputs taken
together, ``||O_tau - O||_F / ||O||_F``. The group error never exceeds the worst head's (each
head's error is at most r_max times its norm, so the sums of squares are too); it weighs every
head's error by what it adds to the layer's output rather than relative to that one head's norm,
which on real models is small for heads that mostly rest on a sink token.
Then each head freezes the largest tau whose median error over the samples meets the tolerance
(the smallest grid value when none does; ``tau_default`` when the head never saw a sample);
``quantile`` (SCSAConfig.calib_quantile) replaces the median by a higher order statistic, the
``ceil(quantile * N)``-th smallest of N samples (0.5 is the median), for heads that must meet the
tolerance on most steps rather than half of them. The
samples are kept, so ``choose(tolerance=...)`` re-picks for another tolerance without rerunning.
``unmet`` names the heads for which no tau meets it, not even tau = 0 where only the packing's
rounding is left: such a head cannot be served by the sparse read at all
(SCSAConfig.exact_when_unmet). ``record`` may also keep what each tau would read, so that
``cost_ratio`` can price the chosen taus against the dense read (cost.py,
SCSAConfig.dense_when_cheaper).
"""

from __future__ import annotations

import math

import torch

from .cost import dense_cost, sparse_cost


def relative_error(o: torch.Tensor, o_exact: torch.Tensor) -> torch.Tensor:
    """``||o - o_exact|| / ||o_exact||`` over the last axis (``[..., D] -> [...]``)."""
    den = o_exact.double().norm(dim=-1).clamp_min(1e-30)
    return (o.double() - o_exact.double()).norm(dim=-1) / den


def group_error(o: torch.Tensor, o_exact: torch.Tensor, metric: str) -> torch.Tensor:
    """Error per KV head of the outputs ``[Hkv, g, D]``: ``[Hkv]`` (see the module docstring)."""
    if metric == "group":
        den = o_exact.double().flatten(-2).norm(dim=-1).clamp_min(1e-30)
        return (o.double() - o_exact.double()).flatten(-2).norm(dim=-1) / den
    return relative_error(o, o_exact).amax(-1)


class Calibrator:
    """Collects replayed errors ``[T, Hkv]`` per sample and picks each head's tau."""

    def __init__(self, grid: tuple, steps: int, tolerance: float, num_kv_heads: int,
                 quantile: float = 0.5) -> None:
        self.grid = torch.tensor(grid, dtype=torch.float64)
        self.steps = steps
        self.tolerance = tolerance
        self.quantile = quantile
        self.hkv = num_kv_heads
        self.samples: list[torch.Tensor] = []  # each [T, Hkv]
        # per sample, what the sparse call would read at each tau: (n, clusters, exact rows,
        # opened rows [T, Hkv], probed rows) (see cost.py); kept only where the caller records it
        self.reads: list[tuple] = []
        self.calls = 0

    @property
    def done(self) -> bool:
        return self.calls >= self.steps

    def record(self, errors: list[torch.Tensor], reads: list[tuple] | None = None) -> None:
        """One calibration call: a ``[T, Hkv]`` error table per batch row, and optionally per row
        ``(n, clusters, exact_rows, opened_rows [T, Hkv], probed_rows)`` for the cost rule
        (probed rows: 0 without the probe)."""
        self.samples.extend(e.double() for e in errors)
        if reads:
            self.reads.extend(reads)
        self.calls += 1

    def levels(self) -> torch.Tensor:
        """Replayed error per (tau, head) at the calibration quantile, ``[T, Hkv]``: the
        ``ceil(quantile * N)``-th smallest of the N samples, the (lower) median at 0.5 (NaN
        without samples)."""
        if not self.samples:
            return torch.full((len(self.grid), self.hkv), float("nan"), dtype=torch.float64)
        n = len(self.samples)
        k = min(n, max(1, math.ceil(self.quantile * n)))
        return torch.stack(self.samples).kthvalue(k, 0).values

    def unmet(self, tolerance: float | None = None) -> torch.Tensor:
        """bool ``[Hkv]``: heads whose error (at the quantile) misses the tolerance at every
        grid tau (False for heads without samples)."""
        if not self.samples:
            return torch.zeros(self.hkv, dtype=torch.bool)
        return ~(self.levels() <= (self.tolerance if tolerance is None else tolerance)).any(0)

    def choice(self, tolerance: float | None = None) -> torch.Tensor:
        """Grid position of each KV head's tau, int64 ``[Hkv]``: the largest tau whose error (at the
        quantile) meets ``tolerance`` (default the configured one), else 0 (needs samples)."""
        ok = self.levels() <= (self.tolerance if tolerance is None else tolerance)  # [T, Hkv]
        pos = torch.arange(len(self.grid)).unsqueeze(1).expand_as(ok)
        return torch.where(ok, pos, torch.zeros_like(pos)).amax(0)

    def choose(self, tau_default: float, tolerance: float | None = None) -> torch.Tensor:
        """Frozen tau per KV head, float32 ``[Hkv]`` (at ``tolerance``, default the configured one)."""
        if not self.samples:
            return torch.full((self.hkv,), tau_default)
        return self.grid[self.choice(tolerance)].float()

    def cost_ratio(self, tolerance: float | None = None) -> float | None:
        """Median over the recorded calls of the sparse call's predicted cost over the dense
        read's (cost.py) at the taus ``choose`` picks; None without recorded reads."""
        if not self.reads or not self.samples:
            return None
        best = self.choice(tolerance)
        heads = torch.arange(self.hkv)
        ratios = [sparse_cost(self.hkv, clusters, float(opened[best, heads].sum()), exact, probed)
                  / dense_cost(self.hkv, n) for n, clusters, exact, opened, probed in self.reads]
        return float(torch.tensor(ratios).median())
