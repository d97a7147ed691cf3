"""Calibrated taus kept per model in the cache, so a later run decodes sparse from its first step.

A tau is a fraction of a query's attention mass, chosen per KV head from the errors of the first
``calib_steps`` decode calls; those calls attend exactly and replay the stop rule at every tau
of the grid, which costs several dense steps each. The choice is kept in
``$LONGATTN_CACHE/taus/<key>.json`` (the tau-file format of taus.py) and given to the next run's
layers before its first step (``preset_taus``); beside it, ``<key>.cost.json`` keeps each layer's
predicted sparse / dense cost ratio at those taus, which ``--policy auto`` weighs (auto.py). The key hashes what the choice depends on: the
model's weights (content key and weight recipe), the sparse layers and every SCSAConfig field
but the wiring ones. Taus carry over between prompts of one model, not between models.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from ..checkpoint.paths import atomic_write_path, cache_root
from ..errors import LongattnError
from ..policy import AttentionPolicy
from . import taus as tau_io
from .policy import policy_taus, preset_taus, sparse_ops

# SCSAConfig fields that change how a run is wired, not which taus calibration picks
_WIRING = ("index_in_prefill",)


def tau_cache_path(weights_key: str, recipe: str, policy: AttentionPolicy) -> Path:
    """Where the taus of ``policy``'s sparse layers on this model and weight recipe live."""
    cfg = dataclasses.asdict(policy.sparse_config)
    for f in _WIRING:
        cfg.pop(f, None)
    layers = [op.layer_index for op in sparse_ops(policy)]
    text = json.dumps({"weights": weights_key, "recipe": recipe, "layers": layers, "scsa": cfg},
                      sort_keys=True, default=str)
    return cache_root() / "taus" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"


def cached_taus(path: Path, policy: AttentionPolicy, cfg) -> dict | None:
    """``{layer: [tau or None per KV head]}`` kept at ``path`` for ``policy``'s sparse layers, or
    None when there are none. A file that cannot be read or lacks a layer counts as none
    (calibration runs, then replaces it)."""
    if not path.exists():
        return None
    try:
        data = tau_io.read_taus(str(path))
        return {op.layer_index: [data[f"{op.layer_index}:{h}"] for h in range(cfg.num_kv_heads)]
                for op in sparse_ops(policy)}
    except (LongattnError, KeyError):
        return None


def load_cached_taus(path: Path, policy: AttentionPolicy, cfg) -> bool:
    """Give ``policy``'s sparse layers the taus kept at ``path``; False when there are none."""
    taus = cached_taus(path, policy, cfg)
    if taus is None:
        return False
    preset_taus(policy, cfg, taus)
    return True


def cost_path(path: Path) -> Path:
    """Where the cost ratios of the taus at ``path`` are kept."""
    return path.with_suffix(".cost.json")


def cached_costs(path: Path) -> dict | None:
    """``{layer: cost ratio or None}`` kept beside the taus at ``path``, or None."""
    try:
        data = json.loads(cost_path(path).read_text())
        return {int(k): (None if v is None else float(v)) for k, v in data.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def store_taus(path: Path, policy: AttentionPolicy) -> bool:
    """Keep the taus of ``policy`` at ``path`` once every sparse layer has calibrated; returns
    whether it did (a run too short to finish calibrating keeps nothing)."""
    ops = sparse_ops(policy)
    if not ops or any(op.scsa is None or not op.scsa.calibrated for op in ops):
        return False
    entries = {}
    for layer, values in policy_taus(policy).items():
        entries.update(tau_io.layer_entries(layer, values))
    costs = {str(op.layer_index): op.scsa.cost_ratio for op in ops}
    # the costs first: a run killed between the two writes leaves no taus, so the next one
    # calibrates again rather than reading taus without their costs
    with atomic_write_path(cost_path(path)) as tmp:
        tmp.write_text(json.dumps(costs, indent=1, sort_keys=True))
    with atomic_write_path(path) as tmp:
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    return True
