"""Rotary position embeddings by absolute position (half-split / NeoX layout), with the
scaling schemes checkpoints use to stretch their context.

A layer's rope is its base ``theta`` plus an optional scaling dict (``ModelConfig``'s
``layer_rope_scaling[i]``) in transformers' ``rope_parameters`` form: ``{"rope_type": ...,
<keys of that type>}``. Each type computes inverse frequencies and a cos/sin multiplier
(``attention_factor``) exactly as transformers' ``modeling_rope_utils`` does:

- ``linear``: frequencies divided by ``factor``.
- ``dynamic`` (NTK): the base grows with the sequence length seen, so the frequencies
  depend on the highest position of the call (``seq_len = max(pos) + 1``).
- ``llama3``: low frequencies divided by ``factor``, high ones kept, a smooth ramp between.
- ``yarn``: a per-frequency blend of interpolated and original frequencies, cos/sin scaled
  by ``attention_factor`` (from ``mscale`` when not given).
- ``longrope``: per-frequency ``short_factor`` or ``long_factor`` (long once the call's
  ``seq_len`` exceeds ``original_max_position_embeddings``), cos/sin scaled.
- ``freq_factors``: frequencies divided by a per-frequency list (a GGUF's
  ``rope_freqs.weight`` tensor, which llama.cpp's converter writes for Llama 3 scaling).

Any other type, or a key a type does not use, is refused (``check_rope_scaling``).
"""

from __future__ import annotations

import math

import torch

from ..errors import LongattnError

# rope_type -> (required keys, optional keys); "rope_type"/"rope_theta" are always allowed.
ROPE_TYPES = {
    "linear": ({"factor"}, set()),
    "dynamic": ({"factor"}, set()),
    "llama3": ({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}, set()),
    "yarn": ({"factor", "original_max_position_embeddings"},
             {"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    "longrope": ({"short_factor", "long_factor", "original_max_position_embeddings"},
                 {"factor", "attention_factor"}),
    "freq_factors": ({"factors"}, set()),
}
# Types whose frequencies depend on the highest position a call sees.
SEQ_DEPENDENT = ("dynamic", "longrope")


def check_rope_scaling(s: dict | None, head_dim: int) -> dict | None:
    """Normalize a scaling dict to ``{"rope_type": t, ...}`` (None for plain rope).

    Raises LongattnError naming the first type, key or value longattn does not implement.
    """
    if not s:
        return None
    s = dict(s)
    t = s.pop("rope_type", None) or s.pop("type", None) or "default"
    s.pop("type", None)
    s.pop("rope_theta", None)  # the layer's base is carried separately
    prf = s.pop("partial_rotary_factor", 1.0)
    if prf not in (None, 1, 1.0):
        raise LongattnError(f"rope partial_rotary_factor {prf} is not implemented (rope on part of "
                            "each head); longattn rotates whole heads only")
    if t == "default":
        if s:
            raise LongattnError(f"rope keys {sorted(s)} are not used by plain rope; longattn refuses "
                                "keys it would ignore")
        return None
    if t not in ROPE_TYPES:
        raise LongattnError(f"rope_type '{t}' is not implemented; longattn implements: default, "
                            f"{', '.join(k for k in ROPE_TYPES if k != 'freq_factors')}")
    required, optional = ROPE_TYPES[t]
    if t == "longrope" and s.get("factor") is None:
        s.pop("factor", None)
    missing = required - {k for k, v in s.items() if v is not None}
    if missing:
        raise LongattnError(f"rope_type '{t}' needs {', '.join(sorted(missing))}")
    extra = set(s) - required - optional
    if extra:
        raise LongattnError(f"rope_type '{t}' does not use {', '.join(sorted(extra))}; longattn "
                            "refuses keys it would ignore")
    for k in ("short_factor", "long_factor", "factors"):
        if k in s and len(s[k]) != head_dim // 2:
            raise LongattnError(f"rope {k} has {len(s[k])} entries; head_dim {head_dim} needs {head_dim // 2}")
    return {"rope_type": t, **s}


def longrope_switch(scaling: dict | None) -> int | None:
    """The sequence length past which a longrope scaling takes its long factors (its
    ``original_max_position_embeddings``); None for any other scaling."""
    if scaling and scaling["rope_type"] == "longrope":
        return int(scaling["original_max_position_embeddings"])
    return None


def _base_inv_freq(head_dim: int, theta) -> torch.Tensor:
    """``[head_dim // 2]`` plain rope inverse frequencies (``theta`` a float or 0-d tensor)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None, max_context: int = 0,
                     seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim // 2] float32, attention_factor)`` as transformers computes them.

    ``max_context`` is the checkpoint's ``max_position_embeddings``; ``seq_len`` the highest
    position of the call plus one (used by the SEQ_DEPENDENT types; None = at load).
    """
    if not scaling:
        return _base_inv_freq(head_dim, theta), 1.0
    t, dim = scaling["rope_type"], head_dim
    if t == "linear":
        return _base_inv_freq(dim, theta) / float(scaling["factor"]), 1.0
    if t == "freq_factors":
        return _base_inv_freq(dim, theta) / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu"), 1.0
    if t == "dynamic":
        factor = float(scaling["factor"])
        n = torch.tensor(max(seq_len or max_context, max_context), dtype=torch.int64, device="cpu")
        base = theta * ((factor * n / max_context) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(dim, base), 1.0
    if t == "llama3":
        return _llama3(dim, theta, scaling), 1.0
    if t == "yarn":
        return _yarn(dim, theta, scaling)
    if t == "longrope":
        orig = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or max_context / orig
        af = scaling.get("attention_factor")
        if af is None:
            af = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        ext = scaling["long_factor"] if seq_len and seq_len > orig else scaling["short_factor"]
        shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        return 1.0 / (torch.tensor(ext, dtype=torch.float32, device="cpu") * theta ** shape), float(af)
    raise LongattnError(f"rope_type '{t}' is not implemented")


def _llama3(dim: int, theta: float, s: dict) -> torch.Tensor:
    f = _base_inv_freq(dim, theta)
    factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / f
    scaled = torch.where(wavelen > old / lo, f / factor, f)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, theta: float, s: dict) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    orig = float(s["original_max_position_embeddings"])

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    af = s.get("attention_factor")
    if af is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        af = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extra_w = 1 - ramp  # weight of the original (extrapolated) frequency
    f = (1.0 / (factor * pos_freqs)) * (1 - extra_w) + (1.0 / pos_freqs) * extra_w
    return f, float(af)


def inv_freq(head_dim: int, theta: float, scaling: dict | None = None, max_context: int = 0) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies at load (before any length is seen)."""
    return rope_frequencies(head_dim, theta, scaling, max_context)[0]


def rope_cos_sin(pos: torch.Tensor, inv_f: torch.Tensor, factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions ``pos [B, T]`` -> each ``[B, 1, T, head_dim]`` float32,
    multiplied by ``factor`` (a scaling type's attention_factor) when it is not 1."""
    freqs = pos.to(torch.float32)[..., None] * inv_f  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D]
    if factor != 1.0:
        return emb.cos() * factor, emb.sin() * factor
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, T, D]`` by the angles whose cos/sin are ``[B, 1, T, D]``."""
    return x * cos + rotate_half(x) * sin


def rerotate(k: torch.Tensor, delta: torch.Tensor, inv_f: torch.Tensor) -> torch.Tensor:
    """Move keys ``k [B, H, T, D]`` from position p to p + delta (``delta [B, T]``, may be < 0).

    RoPE is a rotation by angle p * f per frequency pair, so re-rotating by delta * f is
    exact in real arithmetic; in float32 each round trip adds a few ulps (bounded in tests).
    A scaling type's attention_factor was applied once when the key was made; a pure
    rotation keeps it.
    """
    cos, sin = rope_cos_sin(delta, inv_f)
    return apply_rope(k, cos.to(k.dtype), sin.to(k.dtype))
