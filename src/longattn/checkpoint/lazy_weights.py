"""A checkpoint's weights as a mapping that reads each tensor when it is looked up.

``models.build_model`` loads, fuses and quantizes a model block by block, so from such a
mapping it holds one block's float32 weights at a time instead of the whole model's (a GGUF
dequantized whole, or a bf16 checkpoint widened whole, would take 2-4x the file's size).
The readers (gguf_file.GGUFWeights, hf_dir.HFWeights) say where each tensor is stored and how
to read one; this module holds what they share: the name index, Phi-3's fused matrices read
as their parts, and the shapes from the headers.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..config import ModelConfig


def fused_parts(cfg: ModelConfig, name: str, rows: int) -> list | None:
    """Phi-3 stores q/k/v as one ``qkv_proj`` (``[q; k; v]`` rows) and gate/up as one
    ``gate_up_proj`` (``[gate; up]``): ``[(part name, its rows)]`` of the stored tensor ``name``
    of ``rows`` rows, or None for any other tensor."""
    if cfg.family != "phi3":
        return None
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if name.endswith("self_attn.qkv_proj.weight"):
        pre, parts, sizes = name[: -len("qkv_proj.weight")], ("q_proj", "k_proj", "v_proj"), (q, kv, kv)
    elif name.endswith("mlp.gate_up_proj.weight"):
        pre, parts, sizes = name[: -len("gate_up_proj.weight")], ("gate_proj", "up_proj"), ((rows + 1) // 2, rows // 2)
    else:
        return None
    out, start = [], 0
    for part, n in zip(parts, sizes):
        out.append((f"{pre}{part}.weight", slice(start, start + n)))
        start += n
    return out


class LazyWeights(Mapping):
    """Name -> float32 tensor, read by ``_read(stored)`` on each lookup and not kept.

    Subclasses register each stored tensor with ``_add(name, stored, shape)`` (``stored``: what
    ``_read`` needs to read it, e.g. a file and a key) and implement ``_read``, which returns it
    as float32, checked and in longattn's layout.
    """

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self._parts: dict = {}  # name -> (stored, its shape, rows of a fused tensor or None)
        self._last = (None, None)  # the last fused tensor read (its parts are read in a row)

    def _add(self, name: str, stored, shape: tuple) -> None:
        parts = fused_parts(self.cfg, name, shape[0])
        for part, rows in parts if parts is not None else [(name, None)]:
            self._parts[part] = (stored, shape, rows)

    def _read(self, stored) -> torch.Tensor:
        raise NotImplementedError

    def __getitem__(self, name: str) -> torch.Tensor:
        stored, _, rows = self._parts[name]
        if rows is None:
            self._last = (None, None)  # a fused tensor's parts are read in a row: let it go
            return self._read(stored)
        if self._last[0] is not stored:
            self._last = (stored, self._read(stored))
        return self._last[1][rows].contiguous()

    def shape(self, name: str) -> tuple:
        """``name``'s shape, from the header (nothing read)."""
        _, shape, rows = self._parts[name]
        return shape if rows is None else (rows.stop - rows.start, *shape[1:])

    def __iter__(self):
        return iter(self._parts)

    def __len__(self) -> int:
        return len(self._parts)
