"""SCSALayer: training-free sparse decode attention over one layer's append-only KV cache.

It replaces only ``softmax(q K^T * scale) V`` at decode time; the model and the cache stay as they
are. Nothing is dropped: every cached key contributes exactly (sink rows, the unsealed suffix,
opened clusters) or through its cluster's closed-form tail ``m exp(beta q.c_K)`` at the value
mean. Per call the work is two small matmuls for priorities, one sort, one gather of the opened
clusters' packed rows and exact attention over them (see ``kernel.py``).

Heads: query head ``i`` reads KV head ``i // (H // Hkv)`` (the ``repeat_interleave`` grouping).
The ``H // Hkv`` query heads of a group read the union of their selections, so ``taus`` holds one
threshold per KV head.

This module holds the operator: a row's PyTorch path (``Prepared`` quantities, selection, the
merged output), its native call (``NativeArgs``) and the decode loop's shortcut. ``SCSALayer``
composes it with calibration (``calibrate.py``: the calibrating call, the tau-grid replay, the
choice) and tau IO (``taus.py``), which its public methods call.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..cache.kv_format import row_width, widen
from ..errors import LongattnError
from ..ops import native
from ..ops.attention import STORED_DTYPES, PagedRows
from ..ops.dense import flash_attention_lse, with_learned_sinks
from . import calibrate
from . import taus as tau_io
from .config import SCSAConfig
from .experimental.refine import refine_opened
from .experimental.tree_walk import leaves_under, select_tree
from .index import ClusterIndex
from .kernel import NEG_INF, Selection, mask_to_ids, merged_output, probe_mask, probe_opened, select_flat
from .paged import StreamRows, exact_rows
from .prepared import Prepared, prepare
from .serial import serial_row

MAX_HEAD_DIM = 512
PAD_WASTE = 1.3  # read padded batches only while they cost at most this much more than needed
# outlier_rows: the part of exact_rows that are clusters' outliers (SCSAConfig.outliers)
COUNTER_NAMES = ("rebuilds", "opened_rows", "exact_rows", "outlier_rows", "clusters_scored", "calls")


def _native_call(*args):
    """``longattn_cpu::scsa_decode`` (ops/csrc/scsa_decode.cpp) on ``(q, k, v, s0, s1,
    *NativeArgs)``: the one place both native paths call it (``SCSALayer._native_row`` and the
    decode loop's ``_hot_call``)."""
    return torch.ops.longattn_cpu.scsa_decode.default(*args)


class NativeArgs(NamedTuple):
    """What ``longattn_cpu::scsa_decode`` takes after the row ``(q, k, v, s0, s1)``, in the
    kernel's order (unpacking gives its positional arguments): the index's tensors, the
    thresholds and the settings. They stay as they are until the index rebuilds or the taus
    change, so the decode loop's shortcut keeps one (``SCSALayer._hot``). ``X`` outliers,
    ``C >= M`` allocated clusters of ``cs`` rows, ``r`` eigenpairs."""

    extra_slots: torch.Tensor  # int64 [Hkv, X]: the outliers' cache slots, ascending
    summ: torch.Tensor         # [Hkv, C, 1 + r, D]: centroid, then sqrt(lam) u rows
    resid: torch.Tensor        # [Hkv, C, D]: residual diagonal
    log_counts: torch.Tensor   # [C]: log of each cluster's member count
    radius: torch.Tensor       # [Hkv, C]: farthest member from the centroid
    vmean: torch.Tensor        # [Hkv, C, D]: value means (the tails' values)
    counts: torch.Tensor       # int64 [C]: member counts
    num_clusters: int          # M, the live clusters
    kt: torch.Tensor           # int8 [Hkv, C, T, D/2, 8, 2]: q8_0 key tiles (Q8Store)
    ks: torch.Tensor           # float32 [Hkv, C, cs, nb]: their block scales
    vi: torch.Tensor           # int8 [Hkv, C, cs, D]: q8_0 value rows
    vs: torch.Tensor           # float32 [Hkv, C, cs, nb]: their block scales
    taus: torch.Tensor         # float32 [Hkv], contiguous
    scale: float               # beta
    probe_dims: int            # SCSAConfig.probe_dims (0: no probe)
    probe_keys: int            # SCSAConfig.probe_keys
    extra_k: torch.Tensor      # float32 [Hkv, X, D]: the outliers' keys
    extra_v: torch.Tensor      # float32 [Hkv, X, D]: their values
    sink_logits: torch.Tensor | None  # float32 [H]: learned sink logits (gpt-oss), or None
    isa: int                   # ops.native.isa_code(SCSAConfig.isa)

    @classmethod
    def of(cls, index: ClusterIndex, taus: torch.Tensor, scale: float, cfg: SCSAConfig,
           sink_logits: torch.Tensor | None = None) -> NativeArgs:
        """The arguments for ``index`` at thresholds ``taus`` (float32 contiguous ``[Hkv]``)."""
        st = index.store
        sinks = None if sink_logits is None else sink_logits.detach().float().contiguous()
        return cls(index.extra_slots, index.summ, index.resid, index.log_counts, index.radius, index.vmean,
                   index.counts, index.num_clusters, st.kt, st.ks, st.vi, st.vs, taus, float(scale),
                   cfg.probe_dims, cfg.probe_keys, index.extra_k, index.extra_v, sinks, native.isa_code(cfg.isa))


class _Hot(NamedTuple):
    """The decode loop's shortcut state (see ``SCSALayer._hot_call``)."""

    index: ClusterIndex
    args: NativeArgs
    scale: float
    q_shape: torch.Size
    sinks: torch.Tensor | None  # the learned sink logits the args were made with (identity)


class SCSALayer:
    """Sparse decode attention for one layer (keeps its own incremental index per batch row).

    Args:
        cfg: the operator's settings.
        num_heads, num_kv_heads, head_dim: the layer's attention shape
            (``num_heads % num_kv_heads == 0``, ``head_dim % 8 == 0``, ``head_dim <= 512``).
        layer_index: names this layer in saved tau files (``"layer:head"`` keys).
        taus: frozen thresholds to start from (as ``set_taus`` takes; a policy's
            ``LayerPolicy.taus``), skipping calibration; None calibrates in the first calls.
    """

    def __init__(self, cfg: SCSAConfig, num_heads: int, num_kv_heads: int, head_dim: int,
                 layer_index: int = 0, taus=None) -> None:
        if not isinstance(cfg, SCSAConfig):
            raise LongattnError(f"SCSALayer needs an SCSAConfig, got {type(cfg).__name__}")
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise LongattnError(f"SCSALayer: num_heads ({num_heads}) must be a positive multiple of "
                                f"num_kv_heads ({num_kv_heads})")
        if head_dim < 8 or head_dim % 8 or head_dim > MAX_HEAD_DIM:
            raise LongattnError(f"SCSALayer: head_dim must be a multiple of 8 in 8..{MAX_HEAD_DIM}, "
                                f"got {head_dim}")
        self.cfg = cfg
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.layer_index = layer_index
        self.counters = {name: 0 for name in COUNTER_NAMES}
        # wall seconds spent sealing blocks (during prefill, sparse/policy.py; at decode steps)
        # and in calibrating calls (each call's exact attention and tau-grid replay)
        self.seconds = {"index_prefill": 0.0, "index_decode": 0.0, "calibration": 0.0}
        self.taus = torch.full((num_kv_heads,), float(cfg.tau_default))
        # heads that must attend exactly (no tau meets the tolerance; see exact_when_unmet)
        self.exact_heads = torch.zeros(num_kv_heads, dtype=torch.bool)
        self._runs_exact = False  # calibrated and exact_heads.any(), as a Python bool (hot path)
        self.calibrated = cfg.calib_steps == 0
        self.calibrator = calibrate.Calibrator(cfg.tau_grid, cfg.calib_steps, cfg.tolerance, num_kv_heads,
                                               cfg.calib_quantile)
        # predicted sparse / dense cost at the calibrated taus (choose_taus; None before)
        self.cost_ratio: float | None = None
        self.indexes: list[ClusterIndex] = []
        self._last: list[tuple] = []
        # the decode loop's shortcut (see _hot_call): the single row's index and what the kernel
        # takes besides the row, once a calibrated call of one row took the native kernel;
        # dropped whenever taus or indexes change
        self._hot: _Hot | None = None
        # attend_paged's kernel arguments: (index, (its version, scale), sink logits, NativeArgs),
        # dropped with _hot
        self._paged_args: tuple | None = None
        # the learned sink logits ``[H]`` of the current call (gpt-oss; None for most models):
        # set by ``attend``, read by every path of the call (exact, Python, native, calibration)
        self.sink_logits: torch.Tensor | None = None
        if taus is not None:
            self.set_taus(list(taus))

    # --- public --------------------------------------------------------------------------
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        """Decode attention of one new query per row over the whole cache.

        Args:
            q: ``[B, H, 1, D]``.
            k, v: ``[B, Hkv, N, D]``, the layer's whole append-only cache (all slots valid).
            scale: score multiplier beta (usually ``D ** -0.5``).
            sink_logits: ``[H]`` learned per-head sink logits (gpt-oss) or None: one more exact
                term in each head's normaliser (and in the stop rule's exact mass).
        Returns:
            ``[B, H, 1, D]`` in q's dtype.
        """
        self.sink_logits = sink_logits
        if self._hot is not None and self._hot.sinks is sink_logits:
            out = self._hot_call(self._hot, q, k, v, scale)
            if out is not None:
                return out
            self._hot = None  # the general path may rebuild or replan: set again below if it fits
        self._check(q, k, v)
        B, H, _, D = q.shape
        N = k.shape[2]
        self.counters["calls"] += 1
        self._last = []
        # short caches, and layers no tau serves (the model's ops route those to their own dense
        # op first), attend exactly without maintaining an index they would never read
        if N < self.cfg.min_context or self._runs_exact:
            self.counters["exact_rows"] += B * self.num_kv_heads * N
            return self._dense(q, k, v, scale)
        if len(self.indexes) != B:
            self.indexes = [ClusterIndex(self.cfg, self.num_kv_heads, D) for _ in range(B)]
        t0 = time.perf_counter()
        for b, index in enumerate(self.indexes):
            if index.update(k[b], v[b]):
                self.counters["rebuilds"] += 1
        self.seconds["index_decode"] += time.perf_counter() - t0
        if all(index.num_clusters == 0 for index in self.indexes):
            self.counters["exact_rows"] += B * self.num_kv_heads * N
            return self._dense(q, k, v, scale)
        if not self.calibrated:
            t0 = time.perf_counter()
            out = calibrate.calibration_call(self, q, k, v, scale)
            self.seconds["calibration"] += time.perf_counter() - t0
            return out
        if B == 1:  # the decode loop's case: no per-row list, stack or cast beyond what is needed
            k0, v0 = k[0], v[0]
            out = self._row(0, q[0, :, 0], k0, v0, scale, self.taus).view(1, H, 1, D)
            index = self.indexes[0]
            if q.dtype == torch.float32 and not self.cfg.serial and self._native_applies(index, k0, v0):
                # the row went native (as _row decides) at the layer's taus: the next steps may
                # take the shortcut
                self._hot = _Hot(index, self._native_args(index, self.taus, scale), scale, q.shape, sink_logits)
        else:
            rows = [self._row(b, q[b, :, 0], k[b], v[b], scale, self.taus) for b in range(B)]
            out = torch.stack(rows).view(B, H, 1, D)
        return out if out.dtype == q.dtype else out.to(q.dtype)

    def attend_paged(self, q: torch.Tensor, k: PagedRows, v: PagedRows, scale: float,
                     sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        """``attend`` for one stream of a paged pool read in place (sparse/paged.py): the same
        bits as ``attend(q, k.gather(), v.gather(), ...)``, reading only what the call reads
        exactly once the index is built and the taus are chosen.

        Args:
            q: ``[1, H, 1, D]`` float32. k, v: ``PagedRows`` of one stream, all ``length`` slots
                stored (the serving engine's per-stream call).
        Returns:
            ``[1, H, 1, D]``.
        """
        n = k.length
        if k.table.shape[0] != 1 or q.shape[0] != 1 or n < self.cfg.min_context or self._runs_exact \
                or not self.calibrated or q.dtype != torch.float32:
            return self.attend(q, k.gather(), v.gather(), scale, sink_logits)
        if len(self.indexes) != 1:
            self.indexes = [ClusterIndex(self.cfg, self.num_kv_heads, self.head_dim)]
        index = self.indexes[0]
        kr, vr = StreamRows(k), StreamRows(v)
        t0 = time.perf_counter()
        if index.update(kr, vr):
            self.counters["rebuilds"] += 1
        self.seconds["index_decode"] += time.perf_counter() - t0
        fits = self._native_applies(index, kr.pool, vr.pool) and not self.cfg.serial
        if not fits:  # the PyTorch path reads the whole stream: gathered (the index is current)
            return self.attend(q, k.gather(), v.gather(), scale, sink_logits)
        self.sink_logits = sink_logits
        s0, s1 = index.exact_slots(n)
        X = index.extra_slots.shape[1]
        held = self._paged_args
        if held is None or held[0] is not index or held[1] != (index.version, scale) or held[2] is not sink_logits:
            # the outliers come from the index's copies: slots s0 .. s0 + X name them in order
            slots = torch.arange(s0, s0 + X).expand(self.num_kv_heads, X).contiguous()
            held = self._paged_args = (index, (index.version, scale), sink_logits,
                                       self._native_args(index, self.taus, scale)._replace(extra_slots=slots))
        ke, ve = exact_rows(kr, vr, s0, s1, n, X)
        out, opened, opened_rows = _native_call(q, ke, ve, s0, s0 + X, *held[3])
        self._count_native(index, n, s0, s1, opened, opened_rows)
        return out

    def set_taus(self, taus) -> None:
        """Freeze the thresholds (one per KV head, or one for all) and end calibration.

        ``None`` for a head means "attend exactly" (no tau met the tolerance, see
        ``SCSAConfig.exact_when_unmet``; or the sparse call would cost more than the dense read,
        see ``SCSAConfig.dense_when_cheaper``): the layer then runs dense.
        """
        t, exact = tau_io.tau_tensors(taus, self.num_kv_heads)
        self._hot = self._paged_args = None
        self.taus = t  # float32, contiguous: the native call takes it as it is
        self.exact_heads = exact
        self.calibrated = True
        self._runs_exact = bool(exact.any())

    @property
    def runs_exact(self) -> bool:
        """Calibrated with a head that attends exactly (no tau serves it, or the cost rule sent the
        layer to its dense read): every call attends exactly."""
        return self._runs_exact

    def count_exact_call(self, batch: int, n: int) -> None:
        """Count a call that the caller answered with its own dense op (``runs_exact``), so
        the counters still see every call and every exact row."""
        self.counters["calls"] += 1
        self.counters["exact_rows"] += batch * self.num_kv_heads * n

    def tau_values(self) -> list:
        """Frozen taus per KV head, ``None`` where the head attends exactly."""
        return tau_io.tau_values(self.taus, self.exact_heads)

    def choose_taus(self, tolerance: float | None = None) -> list:
        """The calibrated choice per KV head at ``tolerance`` (default the configured one):
        a tau, or ``None`` where none meets it and ``exact_when_unmet`` is on. With
        ``dense_when_cheaper``, ``None`` for every head when the sparse calls at the chosen taus
        would cost more than the dense read (``cost_ratio`` > 1; see cost.py)."""
        taus, self.cost_ratio = calibrate.choose_taus(self.calibrator, self.cfg, self.num_kv_heads, tolerance)
        return taus

    def save_taus(self, path) -> None:
        """Merge this layer's taus into the JSON file ``{"layer:head": tau}`` (atomic write)."""
        tau_io.save_taus(path, self.layer_index, self.tau_values())

    def load_taus(self, path) -> None:
        """Load this layer's taus from a file written by ``save_taus`` and end calibration."""
        self.set_taus(tau_io.load_taus(path, self.layer_index, self.num_kv_heads))

    def reset(self) -> None:
        """Forget every index (a new sequence); taus and counters are kept."""
        self.indexes = []
        self._last = []
        self._hot = self._paged_args = None

    def debug_accounting(self) -> list[dict]:
        """How every cached key contributed to the last sparse call, per batch row.

        Returns a list (one per row) of dicts with int64 tensors ``[Hkv]``: ``n``,
        ``exact_rows``, ``opened_rows``, ``tail_rows`` (keys folded into unopened
        clusters' or tree nodes' tails), and ``coverage`` ``[Hkv, N]`` (times each slot was
        counted; all ones when nothing is dropped or double counted) and ``role`` ``[Hkv, N]``
        (0 exact, 1 opened, 2 tail). Empty after a dense call.
        """
        return [_accounting(*entry) for entry in self._last]

    # --- internals -----------------------------------------------------------------------
    def _hot_call(self, hot: _Hot, q, k, v, scale):
        """The decode loop's step after a native single-row call: what the general path does
        when its index has nothing to build (the same native row, counters and accounting),
        with the checks cut to what can change between two steps: shapes, dtypes, row strides,
        the scale, the cache's length (no rebuild due, not below the sealed region, not below
        ``min_context``) and its last sealed keys (another sequence). ``None``: anything else,
        which the general path then handles (and checks) in full. ``hot`` holds the index, what
        the kernel takes besides the row (``NativeArgs``), the scale and q's shape, kept while
        the index and the taus stay as they are (see ``_hot``). It exists because this runs once
        per sparse layer and step, where the general path's Python checks are a visible share of
        the call (``scsa_alternate.py --general`` compares the two)."""
        index, args, scale0, q_shape, _ = hot
        W = row_width(k.dtype, self.head_dim)  # a stored row (cache/kv_format.py)
        if q.shape != q_shape or k.shape != v.shape or k.shape[:2] != (1, self.num_kv_heads) \
                or k.shape[3] != W or k.dtype not in STORED_DTYPES or v.dtype != k.dtype \
                or q.dtype != torch.float32 or k.stride()[2:] != (W, 1) or v.stride()[2:] != (W, 1) \
                or scale != scale0:
            return None
        n = k.shape[2]
        if n < self.cfg.min_context or not index.is_current(k):  # a rebuild, or another sequence
            return None
        s0, s1 = index.exact_slots(n)
        out, opened, opened_rows = _native_call(q, k, v, s0, s1, *args)  # 4-D in, [1, H, 1, D] out
        self._count_native(index, n, s0, s1, opened, opened_rows)
        return out

    def _count_native(self, index: ClusterIndex, n: int, s0: int, s1: int, opened, opened_rows) -> None:
        """Count one single-row native call over ``n`` slots (exact ``[0, s0)``, the outliers,
        ``[s1, n)``) as the general path counts it, and keep its selection for accounting."""
        hkv, X, M = self.num_kv_heads, index.extra_slots.shape[1], index.num_clusters
        counters = self.counters
        counters["calls"] += 1
        counters["exact_rows"] += hkv * (s0 + X + n - s1)
        counters["outlier_rows"] += hkv * X
        counters["opened_rows"] += int(opened_rows)
        counters["clusters_scored"] += hkv * M
        self._last = [(index, Selection(opened, None, None, hkv * M), n)]

    def _check(self, q, k, v) -> None:
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise LongattnError("SCSALayer.attend: q, k, v must be 4-D [B, heads, time, head_dim]")
        B, H, Tq, D = q.shape
        if Tq != 1:
            raise LongattnError(f"SCSALayer.attend is decode-only: q must have 1 query per row, got {Tq}")
        if H != self.num_heads or D != self.head_dim:
            raise LongattnError(f"SCSALayer.attend: q is {list(q.shape)}, expected "
                                f"[B, {self.num_heads}, 1, {self.head_dim}]")
        W = row_width(k.dtype, D)  # a stored row: D values, or D int8 codes and their scales
        if k.shape != v.shape or k.shape[0] != B or k.shape[1] != self.num_kv_heads or k.shape[3] != W:
            raise LongattnError(f"SCSALayer.attend: k {list(k.shape)} / v {list(v.shape)} must both be "
                                f"[{B}, {self.num_kv_heads}, N, {W}]")
        if k.shape[2] < 1:
            raise LongattnError("SCSALayer.attend: the cache is empty")

    def _dense(self, q, k, v, scale):
        """Exact attention of the call's queries over the whole cache (learned sinks included)."""
        qf, kf, vf = q.float(), widen(k, self.head_dim), widen(v, self.head_dim)
        if self.sink_logits is not None:
            o, lse = flash_attention_lse(qf, kf, vf, None, False, scale)
            return with_learned_sinks(o, lse, self.sink_logits).to(q.dtype)
        out = F.scaled_dot_product_attention(qf, kf, vf, scale=scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return out.to(q.dtype)

    def _prepare(self, index: ClusterIndex, q_row, k_row, v_row, scale,
                 flat_scores: bool | None = None) -> Prepared:
        """``prepared.prepare`` for one row; flat selection also scores every cluster."""
        if flat_scores is None:
            flat_scores = not self.cfg.hierarchical
        return prepare(index, q_row, k_row, v_row, scale, self.group, flat_scores, self.sink_logits)

    def _select(self, index: ClusterIndex, prep: Prepared, scale: float, taus: torch.Tensor,
                hierarchical: bool | None = None):
        """Priorities + stop rule: ``(selection, tail logits [Hkv, g, T], tail values [Hkv, T, D])``."""
        if hierarchical is None:
            hierarchical = self.cfg.hierarchical
        if hierarchical:
            sel, tail = select_tree(prep.qg, index.tree, prep.log_exact, taus, scale)
            return sel, tail, _gather_rows(index.tree.vmean, sel.tail_ids)
        sel = select_flat(prep.est, prep.log_exact, taus)
        if self.cfg.probe_dims:
            opened = sel.opened | self._probe(index, prep)
            sel = Selection(opened, sel.tail_ids, ~opened, sel.scored)
        if self.cfg.refine:
            sel = self.refine(index, prep, sel, taus, scale, self.cfg.refine)
        return sel, prep.tail, index.live_vmean

    def refine(self, index: ClusterIndex, prep: Prepared, sel: Selection, taus: torch.Tensor, scale: float,
               rounds: int) -> Selection:
        """A flat selection re-decided up to ``rounds`` times with the opened clusters' exact masses
        (``experimental.refine.refine_opened``; stops early once nothing more opens)."""
        opened = sel.opened
        log_mass = self._cluster_log_mass(index, prep, opened, scale)
        for _ in range(rounds):
            more = refine_opened(opened, prep.est, prep.log_exact, log_mass, taus)
            if torch.equal(more, opened):
                break
            fresh = more & ~opened  # only the newly opened clusters are scored
            log_mass = torch.where(fresh.unsqueeze(1), self._cluster_log_mass(index, prep, fresh, scale), log_mass)
            opened = more
        return Selection(opened, sel.tail_ids, ~opened, sel.scored)

    def _probe(self, index: ClusterIndex, prep: Prepared) -> torch.Tensor:
        """The clusters the probe opens (``SCSAConfig.probe_dims``), bool ``[Hkv, M]``, kept in
        ``prep`` so a call and its calibration replay compute it once.

        Every member row of every cluster is scored ``q.c + q_S.(k - c)_S``: the store scores the
        query masked to its ``probe_dims`` largest dimensions ``q_S`` (as it scores opened rows:
        ``q_S.c_store + q_S.(k - c_store)``), and the rest of the centroid term ``(q - q_S).c``
        is added per cluster."""
        if prep.probe is not None:
            return prep.probe
        qg, M, cs = prep.qg, index.num_clusters, self.cfg.cluster_size
        qm = qg * probe_mask(qg, self.cfg.probe_dims)
        ids = torch.arange(M).expand(self.num_kv_heads, M)
        s = index.store.scores(index.store.prepare_query(qm), ids)  # [Hkv, g, M * cs]
        centre = torch.bmm(qg - qm, index.live_summ[:, :, 0].transpose(1, 2))  # [Hkv, g, M]
        s = s.view(*centre.shape, cs) + centre.unsqueeze(-1)
        if index.has_padding:
            s = s + index.pad_bias[:M]
        prep.probe = probe_opened(s.flatten(2), cs, self.cfg.probe_keys)
        return prep.probe

    def _cluster_log_mass(self, index: ClusterIndex, prep: Prepared, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """Exact log-mass of the clusters in ``mask`` (bool ``[Hkv, M]``) over their packed rows,
        as the read scores them: ``[Hkv, g, M]``, -inf outside ``mask``."""
        hkv, M = mask.shape
        out = prep.qg.new_full((hkv, self.group, M + 1), NEG_INF)
        idx, valid, counts = mask_to_ids(mask)
        if idx.shape[1] == 0:
            return out[..., :M]
        s = self._open_scores(index, prep, 0, idx, valid, counts, scale)  # [Hkv, g, K * cs]
        lm = s.view(hkv, self.group, idx.shape[1], -1).logsumexp(-1)
        at = torch.where(valid, idx, torch.full_like(idx, M)).unsqueeze(1).expand_as(lm)
        return out.scatter_(-1, at, lm)[..., :M]

    def _output(self, index: ClusterIndex, prep: Prepared, sel: Selection, tail, v_tail, scale: float):
        """One ascending sweep over the opened clusters' packed rows, merged with the exact rows and
        the tails: ``[Hkv, g, D]``."""
        tail = tail.masked_fill(~sel.tail_mask.unsqueeze(1), NEG_INF)
        idx, valid, counts = mask_to_ids(sel.opened)  # ascending cluster ids per head, padded
        # Heads open different amounts; padding them to one batch wastes reads when they differ a
        # lot, then a loop over KV heads (a few more small ops) reads only what was opened.
        if len(counts) > 1 and len(counts) * max(counts) > PAD_WASTE * max(sum(counts), 1) + 8:
            parts = [self._output_heads(index, prep, h, idx[h:h + 1, :counts[h]], valid[h:h + 1, :counts[h]],
                                        counts[h:h + 1], tail[h:h + 1], v_tail[h:h + 1], scale)
                     for h in range(len(counts))]
            return torch.cat(parts, 0)
        return self._output_heads(index, prep, 0, idx, valid, counts, tail, v_tail, scale)

    def _output_heads(self, index, prep, h0, idx, valid, counts, tail, v_tail, scale):
        """``_output`` for KV heads ``h0 .. h0 + len(idx)``."""
        hh = idx.shape[0]
        s_ex, v_ex = prep.s_ex[h0:h0 + hh], prep.v_ex[h0:h0 + hh]
        s_open = v_open = None
        if idx.shape[1]:
            s_open = self._open_scores(index, prep, h0, idx, valid, counts, scale)
            v_open = index.store.values(idx, h0)
        return merged_output(s_ex, v_ex, s_open, v_open, tail, v_tail)

    def _open_scores(self, index, prep, h0, idx, valid, counts, scale):
        """Scaled scores of KV heads ``h0 .. h0 + len(idx)``'s query heads with the packed rows of
        clusters ``idx`` ``[h, K]`` (padding rows and invalid entries -inf): ``[h, g, K * cs]``.
        The query is prepared (quantized, for q8_0) once per call and kept in ``prep``."""
        if prep.qprep is None:
            prep.qprep = index.store.prepare_query(prep.qg)
        hh = idx.shape[0]
        qprep = prep.qprep
        if hh != self.num_kv_heads:
            qprep = tuple(t[h0:h0 + hh] for t in qprep) if isinstance(qprep, tuple) else qprep[h0:h0 + hh]
        s = index.store.scores(qprep, idx, h0) * scale  # [h, g, K*cs]
        if index.has_padding or min(counts) < idx.shape[1]:
            bias = torch.where(valid.unsqueeze(-1), index.pad_bias[idx], NEG_INF)  # [h, K, cs]
            s = s + bias.view(hh, 1, -1)
        return s

    def _sparse(self, index: ClusterIndex, prep: Prepared, scale: float, taus: torch.Tensor):
        """Output ``[Hkv, g, D]`` and the selection for one row at thresholds ``taus [Hkv]``."""
        if index.num_clusters == 0:
            s_ex, v_ex = prep.s_ex, prep.v_ex
            return merged_output(s_ex, v_ex, None, None, s_ex[..., :0], v_ex[:, :0]), None
        sel, tail, v_tail = self._select(index, prep, scale, taus)
        return self._output(index, prep, sel, tail, v_tail, scale), sel

    def _row(self, b: int, q_row, k_row, v_row, scale, taus):
        index = self.indexes[b]
        n = k_row.shape[1]
        s0, s1 = index.exact_slots(n)
        opened_rows = None  # the native call counts them itself
        if self.cfg.serial:
            out, sel = serial_row(self.cfg, index, q_row, k_row, v_row, scale, taus, self.sink_logits)
        elif self._native_applies(index, k_row, v_row):
            out, sel, opened_rows = self._native_row(index, q_row, k_row, v_row, s0, s1, scale, taus)
        else:
            out, sel = self._sparse(index, self._prepare(index, q_row, k_row, v_row, scale), scale, taus)
        self.counters["exact_rows"] += self.num_kv_heads * index.exact_count(n)
        self.counters["outlier_rows"] += self.num_kv_heads * index.extra_slots.shape[1]
        if sel is not None:
            if opened_rows is None:
                opened_rows = int((sel.opened.long() * index.counts[:index.num_clusters]).sum())
            self.counters["opened_rows"] += opened_rows
            self.counters["clusters_scored"] += sel.scored
        self._last.append((index, sel, n))
        return out.reshape(self.num_heads, self.head_dim)

    def _native_applies(self, index: ClusterIndex, k_row, v_row) -> bool:
        """The C++ kernel covers flat selection over q8_0 rows with float32, bfloat16 or int8
        caches whose rows are contiguous (the model's caches are; other layouts take the PyTorch
        path)."""
        cfg = self.cfg
        if not cfg.native or cfg.hierarchical or cfg.refine or cfg.packing != "q8_0" or index.num_clusters == 0:
            return False
        W = row_width(k_row.dtype, self.head_dim)
        return all(t.dtype in STORED_DTYPES and t.dtype == k_row.dtype and t.stride(-1) == 1 and t.stride(-2) == W
                   for t in (k_row, v_row)) and native.available()

    def _native_args(self, index: ClusterIndex, taus, scale) -> NativeArgs:
        """``NativeArgs`` of ``index`` at ``taus`` (the layer's own taus are already float32 and
        contiguous)."""
        return NativeArgs.of(index, taus if taus is self.taus else taus.float().contiguous(), scale, self.cfg,
                             self.sink_logits)

    def _native_row(self, index: ClusterIndex, q_row, k_row, v_row, s0, s1, scale, taus):
        """One row through ``longattn_cpu::scsa_decode`` (slots ``[0, s0)``, the outliers and
        ``[s1, N)`` exact): output ``[Hkv, g, D]``, the flat selection (the same decisions as
        ``select_flat``, read in one native pass) and the member rows opened (all KV heads)."""
        args = self._native_args(index, taus, scale)
        out, opened, rows = _native_call(q_row.float(), k_row, v_row, s0, s1, *args)
        # flat: tails = ~opened (see _accounting)
        sel = Selection(opened, None, None, self.num_kv_heads * index.num_clusters)
        return out.view(self.num_kv_heads, self.group, self.head_dim), sel, int(rows)

    def replay_errors(self, index: ClusterIndex, prep: Prepared, o_exact: torch.Tensor, scale: float) -> torch.Tensor:
        """The sparse output's error at every tau of the calibration grid for one row, float64
        ``[T, Hkv]`` (``calibrate.replay``)."""
        return self.replay(index, prep, o_exact, scale)[0]

    def replay(self, index: ClusterIndex, prep: Prepared, o_exact: torch.Tensor, scale: float):
        """``calibrate.replay``: errors float64 ``[T, Hkv]`` and opened rows int64 ``[T, Hkv]``."""
        return calibrate.replay(self, index, prep, o_exact, scale)

    def probed_rows(self, index: ClusterIndex) -> int:
        """Rows the probe scores per call, summed over the KV heads (``calibrate.probed_rows``)."""
        return calibrate.probed_rows(self.cfg, self.num_kv_heads, index)


def _gather_rows(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``t [Hkv, Nn, D]`` rows at ``ids [Hkv, F]`` -> ``[Hkv, F, D]``."""
    return t.gather(1, ids.unsqueeze(-1).expand(-1, -1, t.shape[-1]))


def _accounting(index: ClusterIndex, sel: Selection | None, n: int) -> dict:
    """Per-slot contribution counts of one row (debug only; python loops are fine here)."""
    hkv = index.hkv
    coverage = torch.zeros(hkv, n, dtype=torch.int64)
    role = torch.full((hkv, n), -1, dtype=torch.int8)
    exact_slots = index.exact_slot_lists(n)  # [Hkv, E]
    coverage.scatter_add_(1, exact_slots, torch.ones_like(exact_slots))
    role.scatter_(1, exact_slots, 0)
    exact = torch.full((hkv,), exact_slots.shape[1], dtype=torch.int64)
    opened_rows = torch.zeros(hkv, dtype=torch.int64)
    tail_rows = torch.zeros(hkv, dtype=torch.int64)
    if sel is not None:
        if sel.tail_mask is None:  # a flat selection stored by the native path
            M = sel.opened.shape[1]
            sel = Selection(sel.opened, torch.arange(M).expand(hkv, M), ~sel.opened, sel.scored)
        for h in range(hkv):
            for c in sel.opened[h].nonzero().flatten().tolist():
                slots = index.slots[h, c][index.slots[h, c] >= 0]
                coverage[h, slots] += 1
                role[h, slots] = 1
                opened_rows[h] += slots.numel()
            for pos in sel.tail_mask[h].nonzero().flatten().tolist():
                node = int(sel.tail_ids[h, pos])
                leaves = leaves_under(index.tree, node) if index.tree is not None and \
                    index.cfg.hierarchical else [node]
                for c in leaves:
                    slots = index.slots[h, c][index.slots[h, c] >= 0]
                    coverage[h, slots] += 1
                    role[h, slots] = 2
                    tail_rows[h] += slots.numel()
    return {"n": torch.full((hkv,), n, dtype=torch.int64), "exact_rows": exact,
            "opened_rows": opened_rows, "tail_rows": tail_rows, "coverage": coverage, "role": role}
