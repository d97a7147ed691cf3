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

The layer's part (``calibration_call``, ``replay``, ``choose_taus``) lives here too: it drives
the operator's own selection and output (``SCSALayer._sparse``, ``_output``, ``_probe``,
``_cluster_log_mass``) over one ``Prepared`` per row, so a replayed tau reads exactly what a
live call at that tau would.
"""

from __future__ import annotations

import math

import torch

from .config import SCSAConfig
from .cost import dense_cost, sparse_cost
from .index import ClusterIndex
from .experimental.refine import refine_opened
from .kernel import Selection, needed
from .prepared import Prepared


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


def calibration_call(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One call of ``layer`` (an ``SCSALayer`` whose rows have indexes) while it calibrates: the
    exact output ``[B, H, 1, D]``; every row's replayed errors (and reads) go to its
    ``calibrator``, and the layer freezes its taus once the calibrator is done."""
    out = layer._dense(q, k, v, scale)
    B = q.shape[0]
    hkv = layer.num_kv_heads
    layer.counters["exact_rows"] += B * hkv * k.shape[2]
    tables, reads = [], []
    n = k.shape[2]
    for b, index in enumerate(layer.indexes):
        if index.num_clusters == 0:
            continue
        o_exact = out[b, :, 0].float().view(hkv, layer.group, layer.head_dim)
        prep = layer._prepare(index, q[b, :, 0], k[b], v[b], scale)
        errors, opened = replay(layer, index, prep, o_exact, scale)
        tables.append(errors)
        reads.append((n, index.num_clusters, hkv * index.exact_count(n), opened,
                      probed_rows(layer.cfg, hkv, index)))
    layer.calibrator.record(tables, reads)
    if layer.calibrator.done:
        layer.set_taus(layer.choose_taus())
    return out


def replay(layer, index: ClusterIndex, prep: Prepared, o_exact: torch.Tensor, scale: float):
    """The stop rule and the sparse output of ``layer`` (an ``SCSALayer``) at every tau of its
    calibration grid for one row.

    Args:
        index: the row's cluster index; prep: the row's ``Prepared`` quantities;
        o_exact: float32 ``[Hkv, g, D]``, the call's exact output.
    Returns:
        ``(errors float64 [T, Hkv], opened rows int64 [T, Hkv])``: the sparse output's error
        (``cfg.calib_metric``) and the member rows each tau opens.
    """
    cfg, hkv = layer.cfg, layer.num_kv_heads
    grid = layer.calibrator.grid.float()
    counts = index.counts[:index.num_clusters]
    errs, rows = [], []
    if cfg.hierarchical:
        for tau in grid:
            o_tau, sel = layer._sparse(index, prep, scale, tau.expand(hkv))
            errs.append(group_error(o_tau, o_exact, cfg.calib_metric))  # [Hkv]
            rows.append((sel.opened.long() * counts).sum(-1))
        return torch.stack(errs), torch.stack(rows)
    # one sort for the whole grid; equal selections share one output
    taus = grid.unsqueeze(1).expand(-1, hkv)
    opened = needed(prep.est, prep.log_exact, taus)
    if cfg.probe_dims:  # the same clusters at every tau
        opened = opened | layer._probe(index, prep)
    if cfg.refine:  # calibration reads everything anyway: every cluster's mass once
        log_mass = layer._cluster_log_mass(index, prep, torch.ones_like(opened[0]), scale)
        for _ in range(cfg.refine):
            opened = refine_opened(opened, prep.est, prep.log_exact, log_mass, taus)
    last, err = None, None
    for mask in opened:  # [Hkv, M] per tau
        if last is None or not torch.equal(mask, last):
            sel = Selection(mask, None, ~mask, 0)
            o_tau = layer._output(index, prep, sel, prep.tail, index.live_vmean, scale)
            err = group_error(o_tau, o_exact, cfg.calib_metric)  # [Hkv]
            last = mask
        errs.append(err)
    return torch.stack(errs), (opened.long() * counts).sum(-1)


def probed_rows(cfg: SCSAConfig, num_kv_heads: int, index: ClusterIndex) -> int:
    """Rows the probe scores per call, summed over the KV heads: every packed member row when
    ``probe_dims`` is on, else 0 (what the cost rule prices, cost.PER_PROBED)."""
    return num_kv_heads * index.packed_rows if cfg.probe_dims else 0


def choose_taus(calibrator: Calibrator, cfg: SCSAConfig, num_kv_heads: int,
                tolerance: float | None = None) -> tuple[list, float | None]:
    """The calibrated choice per KV head at ``tolerance`` (default the configured one), and the
    predicted sparse / dense cost ratio at the chosen taus (None without recorded reads).

    A choice is a tau, or ``None`` where none meets the tolerance and ``exact_when_unmet`` is
    on; with ``dense_when_cheaper``, ``None`` for every head when the ratio exceeds 1.
    """
    taus = calibrator.choose(cfg.tau_default, tolerance).tolist()
    ratio = calibrator.cost_ratio(tolerance)
    if cfg.dense_when_cheaper and ratio is not None and ratio > 1.0:
        return [None] * num_kv_heads, ratio
    if not cfg.exact_when_unmet:
        return taus, ratio
    return [None if u else t for t, u in zip(taus, calibrator.unmet(tolerance).tolist())], ratio
