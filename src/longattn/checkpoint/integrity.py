"""Checks that a checkpoint file is what its header says, before anything is converted or
cached: one line naming the first tensor that is wrong.

- Structure (GGUF): every tensor's bytes lie inside the file, every block index is below
  the header's block count, and every tensor's shape is the one the header's sizes imply
  (a header that says 3 heads where the tensors hold 9 is refused here, not after a
  conversion has been written).
- Values (GGUF and HF): after dequantization every weight is finite and within what half
  precision holds. Quantized GGUF blocks carry half-precision scales; damaged bytes in a
  scale give infinities, NaNs or magnitudes thousands of times those of trained weights
  (which stay within a few tens), while trained checkpoints never come near that bound.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import LongattnError

MAX_ABS_WEIGHT = 65504.0  # the largest float16


def expected_gguf_shapes(cfg: ModelConfig) -> dict:
    """GGUF tensor name (``blk.{i}`` written ``blk.*``) -> shape in PyTorch [out, in] order
    implied by the header's sizes."""
    h, q, kv, ff = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                    cfg.intermediate_size)
    shapes = {"token_embd.weight": (cfg.vocab_size, h), "output.weight": (cfg.vocab_size, h),
              "output_norm.weight": (h,)}
    blk = {"attn_q.weight": (q, h), "attn_k.weight": (kv, h), "attn_v.weight": (kv, h),
           "attn_output.weight": (h, q), "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
           "attn_q_norm.weight": (cfg.head_dim,), "attn_k_norm.weight": (cfg.head_dim,),
           "attn_norm.weight": (h,), "ffn_norm.weight": (h,), "post_attention_norm.weight": (h,),
           "post_ffw_norm.weight": (h,), "ffn_gate.weight": (ff, h), "ffn_up.weight": (ff, h),
           "ffn_down.weight": (h, ff)}
    if cfg.family == "phi3":  # q/k/v and gate/up stay fused in Phi-3 files
        blk.update({"attn_qkv.weight": (q + 2 * kv, h), "ffn_up.weight": (2 * ff, h)})
    shapes.update({f"blk.*.{k}": v for k, v in blk.items()})
    shapes["rope_freqs.weight"] = (cfg.head_dim // 2,)
    return shapes


def _bad(path: Path, msg: str) -> LongattnError:
    return LongattnError(f"{path.name}: {msg}; the file is corrupt or its header contradicts "
                         "its tensors: re-download or re-convert it")


def check_gguf_structure(reader, cfg: ModelConfig, path: Path) -> None:
    """Raise LongattnError naming the first tensor of ``reader`` (a gguf.GGUFReader of
    ``path``) whose bytes leave the file or whose shape contradicts ``cfg`` (read from the
    same header)."""
    size = path.stat().st_size
    shapes = expected_gguf_shapes(cfg)
    for t in reader.tensors:
        start, n = int(t.data_offset), int(t.n_bytes)
        if start < 0 or start + n > size:
            raise _bad(path, f"tensor '{t.name}' spans bytes {start}..{start + n} of a {size}-byte file")
        key = t.name
        if t.name.startswith("blk."):
            _, i, rest = (t.name.split(".", 2) + ["", ""])[:3]
            if not i.isdigit() or int(i) >= cfg.num_layers:
                raise _bad(path, f"tensor '{t.name}' lies outside the header's {cfg.num_layers} blocks")
            key = f"blk.*.{rest}"
        want = shapes.get(key)
        got = tuple(int(x) for x in reversed(list(t.shape)))
        if want is not None and got != want:
            raise _bad(path, f"tensor '{t.name}' has shape {got}, but the header's sizes "
                             f"({cfg.num_heads} heads, {cfg.num_kv_heads} KV heads, head_dim "
                             f"{cfg.head_dim}, hidden {cfg.hidden_size}) imply {want}")


def check_values(name: str, w: torch.Tensor, path: Path) -> None:
    """Raise LongattnError when tensor ``name`` of ``path`` holds a non-finite value or one
    beyond MAX_ABS_WEIGHT in magnitude (any shape, any float dtype)."""
    if w.numel() == 0:
        return
    lo, hi = torch.aminmax(w)  # NaN propagates; no temporary of the tensor's size
    if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
        n = int((~torch.isfinite(w)).sum())
        if n:
            raise _bad(path, f"tensor '{name}' holds {n} non-finite values (NaN or infinity)")
    peak = max(abs(float(lo)), abs(float(hi)))
    if peak > MAX_ABS_WEIGHT:
        raise _bad(path, f"tensor '{name}' holds a value of magnitude {peak:.3g}, beyond any "
                         f"trained weight (limit {MAX_ABS_WEIGHT:g})")
