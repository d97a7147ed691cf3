"""Wire SCSA into the model as the "sparse" attention kind.

A sparse layer runs exact masked attention for prefill chunks and SCSA for single-token
decode steps over its growing cache (below ``SCSAConfig.min_context`` SCSA itself runs
dense). On a hybrid checkpoint (Gemma 3) the default sparse layers are the global ones;
windowed layers keep their trained windows (or an imposed window + sinks).
"""

from __future__ import annotations

import time
from typing import Optional

from ..errors import LongattnError
from ..policy import AttentionPolicy, LayerPolicy, WindowOp, register_op
from . import taus as tau_io
from .config import SCSAConfig
from .index import ClusterIndex
from .layer import SCSALayer


class SparseOp:
    """Exact attention for prefill, SCSA for decode (one SCSALayer per model layer)."""

    learned_sinks = True  # gpt-oss's sink logits reach the dense op and SCSA's normaliser

    def __init__(self, lp: LayerPolicy, policy: AttentionPolicy, layer: int):
        self.lp = lp
        self.cfg = policy.sparse_config or SCSAConfig()
        self.layer_index = layer
        self.scsa: Optional[SCSALayer] = None
        # Prefill, and decode below min_context, take the very same op as a dense layer
        # (bit-identical); SCSA only ever sees long decode steps.
        self.dense = WindowOp(LayerPolicy("window", None, 0), None, policy.masks, policy.fused_decode)

    def __call__(self, q, q_pos, view, scale, softcap=None, sink_logits=None):
        """``q [B, H, Tq, D]`` over ``view`` (cache.base.KVView) -> ``[B, H, Tq, D]``."""
        B, H, Tq, D = q.shape
        k, v, k_pos = view.k, view.v, view.positions
        if Tq > 1 or softcap is not None or not view.cached or k.shape[2] < self.cfg.min_context:
            out = self.dense(q, q_pos, view, scale, softcap, sink_logits)
            if Tq > 1 and view.cached and softcap is None and self.cfg.index_in_prefill \
                    and k.shape[2] >= self.cfg.min_context and not bool((k_pos < 0).any()):
                self._grow_index(H, k, v)
            return out
        if self.scsa is None:
            self.scsa = SCSALayer(self.cfg, H, k.shape[1], D, layer_index=self.layer_index)
        # SCSA reads the append-only cache slot i = i-th token; padding slots would break that.
        if bool((k_pos < 0).any()):
            raise LongattnError("the sparse policy needs unpadded streams (one stream, or equal lengths)")
        if self.scsa.runs_exact:  # no tau meets the tolerance here: the dense layer's own op
            self.scsa.count_exact_call(B, k.shape[2])
            return self.dense(q, q_pos, view, scale, softcap, sink_logits)
        return self.scsa.attend(q, k, v, scale, sink_logits)


    def _grow_index(self, num_heads: int, k, v) -> None:
        """Seal the full blocks of the prompt so far (``k, v [B, Hkv, N, D]``) into each row's
        index, so the first decode step builds only the last, partial block. A layer that
        attends exactly after calibration keeps no index (SCSALayer.attend), so it is skipped."""
        cfg = self.cfg
        B, Hkv, N, D = k.shape
        full = (N - cfg.sink - cfg.recent) // cfg.block_size
        if full < 1:
            return
        if self.scsa is None:
            self.scsa = SCSALayer(cfg, num_heads, Hkv, D, layer_index=self.layer_index)
        layer = self.scsa
        if layer.runs_exact:
            return
        if len(layer.indexes) != B:
            layer.indexes = [ClusterIndex(cfg, Hkv, D) for _ in range(B)]
        sealed = cfg.sink + full * cfg.block_size
        n = sealed + cfg.recent  # the cache length at which exactly these blocks are sealed
        t0 = time.perf_counter()
        for b, index in enumerate(layer.indexes):
            if index.seal_end < sealed:  # not a decode call's rebuild: counters["rebuilds"] stays
                index.update(k[b, :, :n], v[b, :, :n])
        layer.seconds["index_prefill"] += time.perf_counter() - t0


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


def sparse_ops(policy: AttentionPolicy) -> list:
    """The SparseOp of every sparse layer (counters, taus)."""
    return [op for op in policy.ops if isinstance(op, SparseOp)]


def policy_taus(policy: AttentionPolicy) -> dict:
    """``{layer: [tau per KV head]}`` of every sparse layer that has run a decode step
    (``None`` for a head that attends exactly)."""
    return {op.layer_index: op.scsa.tau_values() for op in sparse_ops(policy) if op.scsa is not None}


def retune(policy: AttentionPolicy, tolerance: float) -> dict:
    """Re-pick every calibrated layer's taus for another ``tolerance`` from the errors its
    calibration already recorded (same samples, no rerun); returns ``policy_taus``."""
    if not tolerance > 0:
        raise LongattnError(f"tolerance must be > 0, got {tolerance}")
    for op in sparse_ops(policy):
        if op.scsa is not None and op.scsa.calibrator.samples:
            op.scsa.set_taus(op.scsa.choose_taus(tolerance))
    return policy_taus(policy)


def preset_taus(policy: AttentionPolicy, cfg, taus: dict) -> None:
    """Give every sparse layer of ``policy`` frozen ``taus`` (``{layer: [tau per KV head]}``, as
    ``policy_taus`` returns) before its first step, so a new stream skips calibration."""
    for op in sparse_ops(policy):
        if op.layer_index not in taus:
            raise LongattnError(f"no taus for sparse layer {op.layer_index}")
        op.scsa = SCSALayer(op.cfg, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, layer_index=op.layer_index)
        op.scsa.set_taus(taus[op.layer_index])


def save_taus(policy: AttentionPolicy, path) -> None:
    """Write every sparse layer's taus that has run a decode step to the tau file ``path``
    (replacing it; ``SCSALayer.load_taus`` reads it back layer by layer)."""
    taus = {}
    for op in sparse_ops(policy):
        if op.scsa is not None:
            taus.update(tau_io.layer_entries(op.layer_index, op.scsa.tau_values()))
    tau_io.write_taus(path, taus)


def sparse_seconds(policy: AttentionPolicy) -> Optional[dict]:
    """Seconds the sparse layers spent sealing blocks during prefill (``index_prefill``) and at
    decode steps (``index_decode``), and in calibrating calls (``calibration``), summed over
    layers; None without sparse layers."""
    ops = sparse_ops(policy)
    if not ops:
        return None
    out = {"index_prefill": 0.0, "index_decode": 0.0, "calibration": 0.0}
    for op in ops:
        if op.scsa is not None:
            for k in out:
                out[k] += op.scsa.seconds[k]
    return out
