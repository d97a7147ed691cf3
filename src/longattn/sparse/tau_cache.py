"""Calibrated taus kept per model in the cache, so a later run decodes sparse from its first step.

A tau is a fraction of a query's attention mass, chosen per KV head from the errors of the first
``calib_steps`` decode calls; those calls attend exactly and replay the stop rule at every tau
of the grid, which costs several dense steps each. The choice is kept in
``$LONGATTN_CACHE/taus/<key>.json`` (the tau-file format of taus.py) and given to the next run's
layers before their first step (``policy.with_taus``); beside it, ``<key>.cost.json`` keeps each layer's
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
from .policy import cache_taus, sparse_layers, stream_layers, with_taus

# SCSAConfig fields that change how a run is wired, not which taus calibration picks
_WIRING = ("index_in_prefill",)


def tau_cache_path(weights_key: str, recipe: str, policy: AttentionPolicy) -> Path:
    """Where the taus of ``policy``'s sparse layers on this model and weight recipe live."""
    cfg = dataclasses.asdict(policy.sparse_config)
    for f in _WIRING:
        cfg.pop(f, None)
    layers = sparse_layers(policy)
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
        return {i: [data[f"{i}:{h}"] for h in range(cfg.num_kv_heads)] for i in sparse_layers(policy)}
    except (LongattnError, KeyError):
        return None


def load_cached_taus(path: Path, policy: AttentionPolicy, cfg) -> AttentionPolicy | None:
    """``policy`` with the taus kept at ``path`` on its sparse layers; None when there are none."""
    taus = cached_taus(path, policy, cfg)
    return None if taus is None else with_taus(policy, taus)


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


def store_taus(path: Path, policy: AttentionPolicy, cache) -> bool:
    """Keep the taus that ``policy``'s sparse layers calibrated in ``cache`` at ``path`` once
    every one has calibrated; returns whether it did (a run too short to finish calibrating
    keeps nothing)."""
    layers, held = sparse_layers(policy), stream_layers(cache)
    if not layers or any(i not in held or not held[i].calibrated for i in layers):
        return False
    entries = {}
    for layer, values in cache_taus(cache).items():
        entries.update(tau_io.layer_entries(layer, values))
    costs = {str(i): held[i].cost_ratio for i in layers}
    # the costs first: a run killed between the two writes leaves no taus, so the next one
    # calibrates again rather than reading taus without their costs
    with atomic_write_path(cost_path(path)) as tmp:
        tmp.write_text(json.dumps(costs, indent=1, sort_keys=True))
    with atomic_write_path(path) as tmp:
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    return True
