"""SCSAConfig: the hyperparameters of the sparse decode operator, validated once.

Every field is a knob a user may turn; ``__post_init__`` rejects impossible settings with one
clear line (LongattnError) so a bad setting never reaches the decode loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import LongattnError
from ..ops import native

PACKINGS = ("q8_0", "f16", "f32")
MAX_RANK = 8

# Thresholds replayed during self-calibration (0 = dense, always present as the fallback):
# 0.0025 * 2**(i/2) up to 0.64, a factor sqrt(2) apart, because a coarser grid drops a head to the
# next smaller step and gives away sparsity it could afford.
DEFAULT_TAU_GRID = (0.0,) + tuple(round(0.0025 * 2 ** (i / 2), 6) for i in range(17))
# How a calibration sample's error is measured per KV head (its g query heads share one tau):
#   "head":  the worst query head's ||o_tau - o|| / ||o||;
#   "group": ||O_tau - O||_F / ||O||_F over the g heads' outputs together (<= "head" always).
CALIB_METRICS = ("head", "group")
# How the hierarchical tree groups leaf clusters (see experimental/tree.py similarity_order):
#   "similar": leaves with similar centroids share a subtree (default);
#   "cache":   consecutive clusters of the cache (for comparison).
TREE_ORDERS = ("similar", "cache")


@dataclass(frozen=True, slots=True)
class SCSAConfig:
    """Self-Calibrating Sparse Attention settings (one object per model, shared by layers).

    Fields:
        cluster_size: most keys per leaf cluster.
        rank: eigenpairs kept per cluster covariance (0..8); the rest is a residual diagonal.
        power_iterations: power-iteration steps per eigenpair.
        packing: member-row storage: "q8_0" (int8, one scale per 32-value block; the native
            kernel's packing). "f16" and "f32" are experimental (PyTorch path only): "f32" is
            full precision, a diagnostic packing that makes tau = 0 equal dense to
            floating-point rounding.
        rebuild_interval: the sealed region grows in steps of this many tokens.
        block_size: a region of this many sealed rows is clustered once and frozen for good
            (a multiple of rebuild_interval, so blocks freeze exactly at a rebuild).
        sink: first positions always attended exactly.
        recent: newest positions always attended exactly (plus the not-yet-rebuilt part).
        outliers: keys per cluster, the farthest from its centroid, taken out of the cluster
            when its block is built and attended exactly on every call (at most half of a
            cluster's members: ``min(outliers, m // 2)``). The cluster's summaries, tail and
            packed rows then describe only the rest: a far member is where the closed-form
            tail and the ranking err most. 0 keeps every member in its cluster. Default 8
            (6.25% of a 128-key cluster).
        calib_steps: decode calls (with an index) run exactly while calibrating tau.
        tolerance: target relative output error per head during calibration (met by the
            median of its calibration errors, or the order statistic calib_quantile names).
        calib_quantile: which order statistic of a head's calibration errors must meet the
            tolerance: the ``ceil(q * N)``-th smallest of N (0.5, the default, is the median;
            0.9 asks the tolerance of nine steps in ten, and opens more).
        tau_default: threshold before calibration ends and for heads never calibrated.
        tau_grid: thresholds replayed during calibration (ascending, in [0, 1]).
        calib_metric: "head" (worst query head's relative output error, the default) or
            "group" (relative error of the KV group's outputs taken together; see CALIB_METRICS).
        native: run flat q8_0 calls after calibration through the C++ kernel
            (``longattn_cpu::scsa_decode``) where it is built; False keeps the PyTorch ops
            (the reference the kernel is tested against, and an A/B arm for benchmarks).
        isa: which form of the native kernel runs (``ops.native.isa_code``: None = automatic,
            "avx2", "avx512"); for tests and benchmarks.
        min_context: below this many cached tokens the layer runs dense, exactly.
        probe_dims: a key-level safety net for flat selection (0, the default, is off). Each
            call scores every sealed member key approximately, ``q.c + q_S.(k - c)_S`` over the
            ``probe_dims`` dimensions S where the query head's ``|q_i|`` is largest (c the key's
            cluster centroid, exact; the offsets as packed), and the clusters holding each
            query head's ``probe_keys`` best keys open whatever the stop rule says. The rule
            ranks clusters by a Gaussian summary, which cannot see one key far out along the
            query, and retrieval-like answer steps (variable tracking) hang on such keys.
            Calibration replays it; the native call runs it (one more scoring pass over every
            packed key row per call).
        probe_keys: keys per query head whose clusters the probe opens (>= 1).
        dense_when_cheaper: at the end of calibration, a layer whose sparse calls (at the taus
            it chose, over the calibration calls' opened and exact rows, median) are predicted
            to cost more than its dense read attends densely, exactly, instead: every KV head's
            choice is then ``None`` (cost.py holds the model and its fitted constants).
        exact_when_unmet: a layer with a KV head for which no tau of the grid meets the
            tolerance (not even tau = 0: the packing's rounding alone is too coarse for that
            head) attends exactly after calibration, instead of running at the smallest tau
            and silently missing its tolerance. One such head makes the whole layer exact (one
            native call serves every head of a layer).

    Experimental (research variants of selection, off by default; their code lives in
    ``sparse/experimental/``, the native kernel takes none of them):
        hierarchical: select by a best-first walk of an interval tree over the clusters.
        tree_fanout: children per internal tree node (hierarchical mode).
        tree_order: "similar" (group leaf clusters with similar centroids, the default) or
            "cache" (group consecutive clusters); see TREE_ORDERS.
        refine: re-decisions after the read (flat selection, PyTorch path). Each one replaces
            the opened clusters' estimated masses in the stop rule's total by their exact masses
            (over the packed rows) and opens, best-first, what the rule then still needs. The
            first decision is taken on estimates alone, and the clusters it opens first are the
            ones most overestimated (a mixed cluster's capped estimate can sit tens of nats
            above its true mass), which shrinks every other cluster's share of the estimated
            total; a re-decision only ever opens more. 0 (default) keeps the single decision
            taken before any read. Calibration replays the same rule.
        serial: use the slow per-cluster reference path (the reference the fast paths are
            tested against; diagnostics).

    Wiring (sparse/policy.py), not the operator:
        index_in_prefill: seal every full block of the prompt into the index while the prefill
            runs (once the cache holds ``min_context`` tokens), so decode starts with only the
            last, partial block to build. Frozen blocks never change, so the index, the
            counters and the outputs are the ones a build at the first decode step gives.
    """

    cluster_size: int = 128
    rank: int = 2
    power_iterations: int = 4
    packing: str = "q8_0"
    rebuild_interval: int = 512
    block_size: int = 4096
    sink: int = 4
    recent: int = 32
    outliers: int = 8
    calib_steps: int = 32
    tolerance: float = 0.025
    calib_quantile: float = 0.5
    tau_default: float = 0.05
    tau_grid: tuple = DEFAULT_TAU_GRID
    calib_metric: str = "head"
    native: bool = True
    isa: Optional[str] = None
    exact_when_unmet: bool = True
    min_context: int = 8192
    dense_when_cheaper: bool = True
    probe_dims: int = 0
    probe_keys: int = 1
    index_in_prefill: bool = True
    # --- experimental (see the docstring's last block) ---
    hierarchical: bool = False
    tree_fanout: int = 4
    tree_order: str = "similar"
    refine: int = 0
    serial: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise LongattnError naming the first impossible setting (run on construction, so by
        ``dataclasses.replace`` too; the config is frozen, so a built one is always valid)."""
        def bad(msg: str) -> None:
            raise LongattnError(f"SCSAConfig: {msg}")

        if self.isa not in native.ISAS:
            bad(f"isa must be None, 'auto', 'avx2' or 'avx512', got {self.isa!r}")
        if self.cluster_size < 1:
            bad(f"cluster_size must be >= 1, got {self.cluster_size}")
        if not 0 <= self.rank <= MAX_RANK:
            bad(f"rank must be in 0..{MAX_RANK}, got {self.rank}")
        if self.power_iterations < 1:
            bad(f"power_iterations must be >= 1, got {self.power_iterations}")
        if self.packing not in PACKINGS:
            bad(f"packing must be one of {', '.join(PACKINGS)}, got {self.packing!r}")
        if self.rebuild_interval < 1:
            bad(f"rebuild_interval must be >= 1, got {self.rebuild_interval}")
        if self.block_size < self.cluster_size:
            bad(f"block_size ({self.block_size}) must be >= cluster_size ({self.cluster_size})")
        if self.block_size % self.rebuild_interval:
            bad(f"block_size ({self.block_size}) must be a multiple of rebuild_interval "
                f"({self.rebuild_interval}) so blocks freeze at a rebuild")
        if self.sink < 0 or self.recent < 0:
            bad(f"sink and recent must be >= 0, got sink={self.sink} recent={self.recent}")
        if self.outliers < 0:
            bad(f"outliers must be >= 0 (keys per cluster read exactly; 0 = none), got {self.outliers}")
        if self.calib_steps < 0:
            bad(f"calib_steps must be >= 0, got {self.calib_steps}")
        if not self.tolerance > 0:
            bad(f"tolerance must be > 0, got {self.tolerance}")
        if not 0.0 < self.calib_quantile <= 1.0:
            bad(f"calib_quantile must be in (0, 1], got {self.calib_quantile}")
        if not 0.0 <= self.tau_default <= 1.0:
            bad(f"tau_default must be in [0, 1], got {self.tau_default}")
        grid = tuple(float(t) for t in self.tau_grid)
        if not grid or any(not 0.0 <= t <= 1.0 for t in grid) or list(grid) != sorted(set(grid)):
            bad(f"tau_grid must be non-empty, strictly ascending, within [0, 1]; got {self.tau_grid}")
        object.__setattr__(self, "tau_grid", grid)  # normalised once, at construction
        if self.calib_metric not in CALIB_METRICS:
            bad(f"calib_metric must be one of {', '.join(CALIB_METRICS)}, got {self.calib_metric!r}")
        if self.tree_fanout < 2:
            bad(f"tree_fanout must be >= 2, got {self.tree_fanout}")
        if self.tree_order not in TREE_ORDERS:
            bad(f"tree_order must be one of {', '.join(TREE_ORDERS)}, got {self.tree_order!r}")
        if self.refine < 0:
            bad(f"refine must be >= 0 (re-decisions after the read; 0 = none), got {self.refine}")
        if self.refine and self.hierarchical:
            bad("refine applies to flat selection; set hierarchical=False or refine=0")
        if self.probe_dims < 0 or self.probe_keys < 1:
            bad(f"probe_dims must be >= 0 (0 = no probe) and probe_keys >= 1, got probe_dims="
                f"{self.probe_dims} probe_keys={self.probe_keys}")
        if self.probe_dims and self.hierarchical:
            bad("the probe applies to flat selection; set hierarchical=False or probe_dims=0")
        if self.min_context < 0:
            bad(f"min_context must be >= 0, got {self.min_context}")
