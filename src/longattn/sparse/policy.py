"""Wire SCSA into the model as the "sparse" attention kind.

A sparse layer runs exact masked attention for prefill chunks and SCSA for single-token
decode steps over its growing cache (below ``SCSAConfig.min_context`` SCSA itself runs
dense). On a hybrid checkpoint (Gemma 3) the default sparse layers are the global ones;
windowed layers keep their trained windows (or an imposed window + sinks).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional

from ..errors import LongattnError
from ..ops.attention import PagedRows
from ..policy import AttentionPolicy, LayerPolicy, WindowOp, register_op
from . import taus as tau_io
from .config import SCSAConfig
from .index import ClusterIndex
from .layer import SCSALayer
from .paged import StreamRows


# the key under which a sparse layer keeps its SCSALayer in the cache's op state (KVView.state)
STATE_KEY = "scsa"


class SparseOp:
    """Exact attention for prefill, SCSA for decode. Holds settings only: each stream's
    SCSALayer (its index per row, calibrated taus, counters) lives in the cache's state for the
    layer, so a new cache starts a new index and nothing has to guess whether a call belongs to
    another sequence."""

    learned_sinks = True  # gpt-oss's sink logits reach the dense op and SCSA's normaliser

    def __init__(self, lp: LayerPolicy, policy: AttentionPolicy, layer: int):
        self.lp = lp
        self.cfg = policy.sparse_config or SCSAConfig()
        self.layer_index = layer
        # Prefill, and decode below min_context, take the very same op as a dense layer
        # (bit-identical); SCSA only ever sees long decode steps.
        self.dense = WindowOp(None, 0, None, policy.fused_decode)

    def scsa(self, view, num_heads: int, head_dim: int) -> SCSALayer:
        """The SCSALayer this cache keeps for the layer (made on first use, with the policy's
        frozen taus when it has them)."""
        sc = view.state.get(STATE_KEY)
        if sc is None:
            sc = SCSALayer(self.cfg, num_heads, _kv_heads(view.k), head_dim, layer_index=self.layer_index,
                           taus=self.lp.taus)
            view.state[STATE_KEY] = sc
        return sc

    def __call__(self, q, q_pos, view, scale, softcap=None, sink_logits=None):
        """``q [B, H, Tq, D]`` over ``view`` (cache.base.KVView; its k and v may be a paged
        pool's ``PagedRows``) -> ``[B, H, Tq, D]``."""
        B, H, Tq, D = q.shape
        k, v, k_pos = view.k, view.v, view.positions
        n = _slots(k)
        if Tq > 1 or softcap is not None or not view.cached or n < self.cfg.min_context:
            out = self.dense(q, q_pos, view, scale, softcap, sink_logits)
            if Tq > 1 and view.cached and softcap is None and self.cfg.index_in_prefill \
                    and n >= self.cfg.min_context and not bool((k_pos < 0).any()):
                self._grow_index(view, H, D)
            return out
        sc = self.scsa(view, H, D)
        # SCSA reads the append-only cache slot i = i-th token; padding slots would break that.
        if bool((k_pos < 0).any()):
            raise LongattnError("the sparse policy needs unpadded streams (one stream, or equal lengths)")
        if sc.runs_exact:  # no tau meets the tolerance here: the dense layer's own op
            sc.count_exact_call(B, n)
            return self.dense(q, q_pos, view, scale, softcap, sink_logits)
        if isinstance(k, PagedRows):
            if B == 1:
                return sc.attend_paged(q, k, v, scale, sink_logits)
            k, v = k.gather(), v.gather()
        return sc.attend(q, k, v, scale, sink_logits)

    def _grow_index(self, view, num_heads: int, head_dim: int) -> None:
        """Seal the full blocks of the prompt so far (``view.k, view.v [B, Hkv, N, D]``, or a
        paged pool's rows) into each row's index, so the first decode step builds only the last,
        partial block. A layer that attends exactly after calibration keeps no index
        (SCSALayer.attend), so it is skipped."""
        cfg = self.cfg
        k, v = view.k, view.v
        paged = isinstance(k, PagedRows)
        B, Hkv, N = (k.table.shape[0], _kv_heads(k), k.length) if paged else k.shape[:3]
        D = head_dim
        full = (N - cfg.sink - cfg.recent) // cfg.block_size
        if full < 1:
            return
        layer = self.scsa(view, num_heads, head_dim)
        if layer.runs_exact:
            return
        if len(layer.indexes) != B:
            layer.indexes = [ClusterIndex(cfg, Hkv, D) for _ in range(B)]
        sealed = cfg.sink + full * cfg.block_size
        n = sealed + cfg.recent  # the cache length at which exactly these blocks are sealed
        t0 = time.perf_counter()
        for b, index in enumerate(layer.indexes):
            if index.seal_end < sealed:  # not a decode call's rebuild: counters["rebuilds"] stays
                if paged:  # the stream's slots read through its block table, never copied whole
                    index.update(StreamRows(k, b, n), StreamRows(v, b, n))
                else:
                    index.update(k[b, :, :n], v[b, :, :n])
        layer.seconds["index_prefill"] += time.perf_counter() - t0


def _slots(k) -> int:
    """Slots per stream of a view's keys (a tensor ``[B, Hkv, N, W]`` or ``PagedRows``)."""
    return k.length if isinstance(k, PagedRows) else k.shape[2]


def _kv_heads(k) -> int:
    return k.pool.shape[1] if isinstance(k, PagedRows) else k.shape[1]


register_op("sparse", lambda lp, policy, layer: SparseOp(lp, policy, layer))


def build_sparse_policy(cfg, scsa: Optional[SCSAConfig] = None, layers: Optional[list] = None,
                        window: Optional[int] = None, sinks: int = 0) -> AttentionPolicy:
    """SCSA on ``layers`` (default: the checkpoint's global layers, i.e. every layer of a
    full-attention model); other layers keep their trained window, or ``window``/``sinks``."""
    L = cfg.num_layers
    if layers is None:
        layers = [i for i, w in enumerate(cfg.layer_windows) if w is None]
    bad = [i for i in layers if not 0 <= i < L]
    if bad:
        raise LongattnError(f"sparse layers {bad} out of range for a {L}-layer model")
    if layers and cfg.attn_softcap is not None:
        # SparseOp would answer every step with its dense op: "sparse" in name only.
        raise LongattnError("SCSA has no term for attention score soft-capping (Gemma 2); run this checkpoint "
                            "with a checkpoint, dense, window or global policy")
    if not layers:
        # Otherwise "sparse" would silently run the windowed checkpoint with no SCSA anywhere.
        raise LongattnError("the sparse policy runs SCSA on the checkpoint's global layers, and this checkpoint "
                            "windows every layer; use --policy dense or window, or name the sparse layers")
    out = []
    for i in range(L):
        if i in layers:
            out.append(LayerPolicy("sparse", None, 0))
        else:
            w = window if window is not None else cfg.layer_windows[i]
            out.append(LayerPolicy("window", w, sinks if w else 0))
    return AttentionPolicy(out, sparse_config=scsa or SCSAConfig())


# the CLI's --sparse-* options (argparse dest -> SCSAConfig field)
CLI_FIELDS = (("sparse_min_context", "min_context"), ("sparse_tolerance", "tolerance"),
              ("sparse_calib_quantile", "calib_quantile"), ("sparse_outliers", "outliers"),
              ("sparse_probe_dims", "probe_dims"), ("sparse_dense_when_cheaper", "dense_when_cheaper"))


def sparse_policy(cfg, args) -> AttentionPolicy:
    """CLI hook for ``--policy sparse`` (``--window/--sinks`` apply to non-sparse layers)."""
    # an option the user did not give is absent from args, leaving SCSAConfig's default
    kw = {f: getattr(args, a) for a, f in CLI_FIELDS if getattr(args, a, None) is not None}
    return build_sparse_policy(cfg, SCSAConfig(**kw), window=args.window, sinks=args.sinks)


def sparse_layers(policy: AttentionPolicy) -> list:
    """The indices of the layers ``policy`` runs as "sparse"."""
    return [i for i, lp in enumerate(policy.layers) if lp.kind == "sparse"]


def stream_layers(cache) -> dict:
    """``{layer: SCSALayer}`` of every sparse layer that ``cache`` (a KVCache, a served
    ``PagedStream``, or a ``longattn.hf`` cache) holds SCSA state for: indexes, taus, counters,
    seconds."""
    cache = getattr(cache, "kv", cache)  # a longattn.hf cache holds its KVCache as .kv
    if cache is None:
        return {}
    return {i: st[STATE_KEY] for i, st in enumerate(cache.op_state) if STATE_KEY in st}


def cache_taus(cache) -> dict:
    """``{layer: [tau per KV head]}`` of every sparse layer that has run in ``cache`` (``None``
    for a head that attends exactly)."""
    return {i: sc.tau_values() for i, sc in stream_layers(cache).items()}


def retune(cache, tolerance: float) -> dict:
    """Re-pick every calibrated layer's taus for another ``tolerance`` from the errors its
    calibration already recorded (same samples, no rerun); returns ``cache_taus``."""
    if not tolerance > 0:
        raise LongattnError(f"tolerance must be > 0, got {tolerance}")
    for sc in stream_layers(cache).values():
        if sc.calibrator.samples:
            sc.set_taus(sc.choose_taus(tolerance))
    return cache_taus(cache)


def policy_taus(policy: AttentionPolicy) -> dict:
    """``{layer: [tau per KV head]}`` frozen in ``policy`` (``with_taus``); empty when its sparse
    layers calibrate."""
    return {i: list(lp.taus) for i, lp in enumerate(policy.layers) if lp.taus is not None}


def with_taus(policy: AttentionPolicy, taus: dict) -> AttentionPolicy:
    """``policy`` with frozen ``taus`` (``{layer: [tau per KV head]}``, as ``cache_taus``
    returns) on every sparse layer, so new streams skip calibration."""
    layers = list(policy.layers)
    for i in sparse_layers(policy):
        if i not in taus:
            raise LongattnError(f"no taus for sparse layer {i}")
        layers[i] = replace(layers[i], taus=tuple(taus[i]))
    return replace(policy, layers=tuple(layers))


def save_taus(cache, path) -> None:
    """Write the taus of every sparse layer that has run in ``cache`` to the tau file ``path``
    (replacing it; ``SCSALayer.load_taus`` reads it back layer by layer)."""
    taus = {}
    for i, sc in stream_layers(cache).items():
        taus.update(tau_io.layer_entries(i, sc.tau_values()))
    tau_io.write_taus(path, taus)


def sparse_seconds(policy: AttentionPolicy, cache) -> Optional[dict]:
    """Seconds ``cache``'s sparse layers spent sealing blocks during prefill (``index_prefill``)
    and at decode steps (``index_decode``), and in calibrating calls (``calibration``), summed
    over layers; None when ``policy`` has no sparse layer."""
    if not sparse_layers(policy):
        return None
    out = {"index_prefill": 0.0, "index_decode": 0.0, "calibration": 0.0}
    for sc in stream_layers(cache).values():
        for k in out:
            out[k] += sc.seconds[k]
    return out
