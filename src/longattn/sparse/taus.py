"""A layer's frozen thresholds: checking what a caller sets, and the tau file.

One tau per KV head, or ``None`` where the head attends exactly (no tau met the tolerance, or
the cost rule sent the layer to its dense read). A tau file is JSON mapping ``"layer:head"`` to a
tau or to ``null``; layers merge into one file, so a model's taus travel together.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

from ..errors import LongattnError


def tau_tensors(taus, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked thresholds from one value per KV head, or one for all (a number, ``None``, a list,
    or a tensor).

    Returns:
        ``(taus, exact)``: float32 ``[Hkv]`` contiguous (0 where exact; the native call takes it
        as it is) and bool ``[Hkv]``, True where the head attends exactly.
    """
    if torch.is_tensor(taus):
        taus = taus.flatten().tolist()
    elif not isinstance(taus, (list, tuple)):
        taus = [taus]
    if len(taus) == 1:
        taus = list(taus) * num_kv_heads
    exact = [t is None for t in taus]
    t = torch.tensor([0.0 if x is None else x for x in taus], dtype=torch.float32)
    if t.numel() != num_kv_heads or not bool(((t >= 0) & (t <= 1)).all()):
        raise LongattnError(f"set_taus: need {num_kv_heads} values in [0, 1] (or None: exact), "
                            f"got {taus}")
    return t, torch.tensor(exact, dtype=torch.bool)


def tau_values(taus: torch.Tensor, exact: torch.Tensor) -> list:
    """``taus [Hkv]`` as a list, ``None`` where ``exact [Hkv]`` is set."""
    return [None if e else t for t, e in zip(taus.tolist(), exact.tolist())]


def save_taus(path, layer_index: int, values: list) -> None:
    """Merge one layer's ``values`` (a tau or ``None`` per KV head) into the tau file at ``path``
    (created when missing; see ``write_taus``)."""
    path = os.fspath(path)
    data = {}
    if os.path.exists(path):
        data = read_taus(path)
    data.update(layer_entries(layer_index, values))
    write_taus(path, data)


def layer_entries(layer_index: int, values: list) -> dict:
    """One layer's entries of a tau file, ``{"layer:head": tau or None}``."""
    return {f"{layer_index}:{h}": t for h, t in enumerate(values)}  # None (JSON null): exact


def write_taus(path, data: dict) -> None:
    """Write the tau file ``data`` (``{"layer:head": tau or None}``) to ``path`` atomically: a
    failed write leaves the old file as it was and no temporary file behind."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise LongattnError(f"cannot write taus to {path}: {e.strerror}") from None


def load_taus(path, layer_index: int, num_kv_heads: int) -> list:
    """One layer's values (a tau or ``None`` per KV head) from the tau file at ``path``; every
    head must be there."""
    path = os.fspath(path)
    data = read_taus(path)
    keys = [f"{layer_index}:{h}" for h in range(num_kv_heads)]
    missing = [key for key in keys if key not in data]
    if missing:
        raise LongattnError(f"{path} has no taus for layer {layer_index} heads "
                            f"{', '.join(key.split(':')[1] for key in missing)}; recalibrate or "
                            f"check the layer index")
    return [data[key] for key in keys]


def read_taus(path: str) -> dict:
    """The whole tau file, ``{"layer:head": tau or None}``, checked."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise LongattnError(f"tau file {path} does not exist; calibrate first and save_taus") from None
    except (OSError, ValueError) as e:
        raise LongattnError(f"tau file {path} is not readable JSON ({e}); "
                            f"delete it and recalibrate") from None
    if not isinstance(data, dict) or not all(x is None or isinstance(x, (int, float)) for x in data.values()):
        raise LongattnError(f"tau file {path} must map \"layer:head\" to numbers (or null: exact); "
                            f"delete it and recalibrate")
    return data
