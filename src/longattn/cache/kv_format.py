"""How a paged KV pool stores a key or value row of ``D`` float32 values.

Three formats, named as the command line names them (``--kv``):

- ``f32``: the row as computed (the reference).
- ``bf16``: each value rounded to bfloat16 (round to nearest even); half the bytes. Widening is
  exact, so reading it costs no arithmetic of its own.
- ``int8`` (q8): per token, per KV head, per block of 32 values, one float32 scale
  ``amax / 127`` and the codes ``round(x / scale)`` in [-127, 127]; the row is ``D`` int8 codes
  followed by the ``ceil(D / 32)`` scales' bytes, ``D + 4 * ceil(D / 32)`` bytes in all (72 for
  ``D = 64``: 0.28x float32, 0.56x bfloat16). The blocks of 32 are llama.cpp's q8_0 blocks
  (which keep an f16 scale); per token, not per channel, because a decode step appends one
  token's row and never rewrites an older one, so a stored row never changes.
  Widened as ``code * scale`` in float32, the product every reader computes.
  Keys are stored rotated (``key_rotation``): a few channels of some models' keys (Qwen2.5's)
  are hundreds of times the rest, and a block's one scale would round the small channels away.

The native kernels (``paged_store`` and ``decode_attention``, ops/csrc) store and read the same
rows; ``encode`` and ``widen`` here are their references, bit for bit.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch
import torch.nn.functional as F

Q8_BLOCK = 32

# the pool's storage formats by name: the dtype of the stored rows
KV_FORMATS = {"f32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


def row_width(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of ``dtype`` one stored row of ``head_dim`` values takes."""
    if dtype == torch.int8:
        return head_dim + 4 * -(-head_dim // Q8_BLOCK)
    return head_dim


def row_bytes(dtype: torch.dtype, head_dim: int) -> int:
    """Bytes one stored row of ``head_dim`` values takes."""
    return row_width(dtype, head_dim) * dtype.itemsize


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``x [..., D]`` (float32) as stored in a pool of ``dtype`` -> ``[..., row_width]``."""
    if dtype != torch.int8:
        return x.to(dtype)
    D = x.shape[-1]
    nb = -(-D // Q8_BLOCK)
    blocks = F.pad(x.float(), (0, nb * Q8_BLOCK - D)).reshape(*x.shape[:-1], nb, Q8_BLOCK)
    scale = blocks.abs().amax(-1) / 127                                    # [..., nb]
    # where a block is all zeros its scale is 0 and its codes 0 (x / 0 is never used)
    codes = torch.where(scale[..., None] > 0, torch.round(blocks / scale[..., None]), 0.0)
    codes = codes.clamp(-127, 127).to(torch.int8).reshape(*x.shape[:-1], nb * Q8_BLOCK)[..., :D]
    return torch.cat([codes, scale.contiguous().view(torch.int8)], -1)


def widen(rows: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored rows ``[..., row_width]`` -> ``[..., head_dim]`` of ``dtype`` (q8 rows widen in
    float32 first)."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    scale = rows[..., head_dim:].contiguous().view(torch.float32)          # [..., nb]
    return (rows[..., :head_dim].float() * scale.repeat_interleave(Q8_BLOCK, -1)[..., :head_dim]).to(dtype)


@lru_cache(maxsize=None)
def _rotation(head_dim: int) -> torch.Tensor:
    if head_dim & (head_dim - 1) == 0:  # a power of two: the normalised Sylvester-Hadamard matrix
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return (h / head_dim ** 0.5).float()
    g = torch.Generator().manual_seed(head_dim)  # else a fixed random orthogonal matrix
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def rerotate_rows(rows: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Stored key rows ``[B, Hkv, N, W]`` moved by RoPE from position p to p + ``delta [B, N]``.

    A float32 (or float64) row is re-rotated as it is (``models.rope.rerotate``). Any other format widens the
    row, turns it back out of the storage rotation (``key_rotation``: RoPE turns channel pairs,
    which the storage rotation has mixed), re-rotates, turns and stores it again; rows whose
    delta is 0 are kept as they are (storing again would round an int8 row a second time)."""
    from ..models.rope import rerotate
    if rows.dtype in (torch.float32, torch.float64):
        return rerotate(rows, delta, inv_freq)  # a zero delta leaves a row bit-identical
    rot = key_rotation(rows.dtype, head_dim)
    x = widen(rows, head_dim)
    if rot is not None:
        x = x @ rot.T
    x = rerotate(x, delta, inv_freq)
    if rot is not None:
        x = x @ rot
    return torch.where((delta != 0)[:, None, :, None], encode(x, rows.dtype), rows)


def key_rotation(dtype: torch.dtype, head_dim: int) -> Optional[torch.Tensor]:
    """``[D, D]`` orthogonal matrix R by which a pool of ``dtype`` stores keys and the attention
    reading it takes queries (``q R . k R = q . k``: every score is unchanged), or None.

    Only int8 rotates: an orthogonal rotation spreads an outlier channel over every channel of
    the row (QuaRot, Ashkboos et al. 2024, rotates for the same reason), so a block's scale fits
    all of its values; float formats store keys as computed."""
    return _rotation(head_dim) if dtype == torch.int8 else None
