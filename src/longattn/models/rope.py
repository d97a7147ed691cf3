"""Rotary position embeddings by absolute position (half-split / NeoX layout)."""

from __future__ import annotations

import torch


def inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies, computed as transformers does."""
    f = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling and scaling.get("type") == "linear":
        f = f / float(scaling["factor"])
    return f


def rope_cos_sin(pos: torch.Tensor, inv_f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions ``pos [B, T]`` -> each ``[B, 1, T, head_dim]`` float32."""
    freqs = pos.to(torch.float32)[..., None] * inv_f  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D]
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
    """
    cos, sin = rope_cos_sin(delta, inv_f)
    return apply_rope(k, cos.to(k.dtype), sin.to(k.dtype))
