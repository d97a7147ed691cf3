"""``--policy auto``: SCSA on the layers where it pays for itself in this run, dense elsewhere.

SCSA speeds decode steps only, and costs an index over the whole cache (sealed block by block,
during the prefill and the decode) plus, on a model's first sparse run, a calibration of
several exact steps that replay the stop rule at every tau (tens of seconds at 16K). So a layer
goes sparse only when

* its taus are already calibrated for this model and setting (``tau_cache``): a run never
  pays a calibration it cannot earn back; the first ``--policy sparse`` run calibrates them;
* the run reaches ``SCSAConfig.min_context`` cached tokens (below it SCSA reads densely anyway);
* calibration gave the layer a tau on every head (a head with none attends exactly) and a
  predicted cost ratio ``r`` < 1 (sparse call / dense read, cost.py, kept with the taus);
* the predicted decode saving over the run's new tokens exceeds the index's cost:

      sum over decode steps past min_context of (1 - r) * dense_cost(Hkv, N_i)
          >  PER_INDEXED * Hkv * (prompt + new tokens)

All terms are in cost.py's unit, dense row reads. ``r`` was measured at the calibration's
context; at longer contexts SCSA opens a smaller share, so the rule errs towards dense there.
The prefill's other costs under a sparse policy are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..policy import AttentionPolicy, LayerPolicy
from .cost import dense_cost
from .policy import sparse_layers

# Sealing one cached token into one KV head's index, in dense row reads: 1.313 s (prefill) +
# 0.892 s (decode) of index time for 17,408 tokens x 24 layers x 2 KV heads of Qwen2.5-0.5B
# (benchmarks/results/scsa_end_to_end.json) is 2.64 us a head-token; a dense row read is
# 0.0227 us on the same machine (benchmarks/results/scsa_cost.json, dense_us_per_row).
PER_INDEXED = 115.0


@dataclass(frozen=True)
class AutoChoice:
    """What ``--policy auto`` decided and why (reported by ``generate``)."""

    sparse_layers: list = field(default_factory=list)  # layers that run SCSA
    reason: str = ""
    saving: float = 0.0  # predicted decode saving of the chosen layers, dense row reads
    index: float = 0.0   # predicted index cost of the chosen layers, dense row reads

    def report(self) -> dict:
        return {"sparse_layers": list(self.sparse_layers), "reason": self.reason,
                "predicted_saving_row_reads": round(self.saving), "predicted_index_row_reads": round(self.index)}


def decode_saving(ratio: float, num_kv_heads: int, prompt_tokens: int, new_tokens: int, min_context: int) -> float:
    """Predicted dense row reads a layer at cost ``ratio`` saves over ``new_tokens`` decode steps
    after ``prompt_tokens`` (steps with fewer than ``min_context`` cached tokens save nothing)."""
    first = max(prompt_tokens + 1, min_context)  # cached tokens at the first step that runs SCSA
    last = prompt_tokens + new_tokens
    steps = last - first + 1
    if steps <= 0 or ratio >= 1.0:
        return 0.0
    return (1.0 - ratio) * steps * dense_cost(num_kv_heads, (first + last) / 2)


def index_cost(num_kv_heads: int, tokens: int) -> float:
    """Predicted dense row reads of sealing ``tokens`` cached tokens into one layer's index."""
    return PER_INDEXED * num_kv_heads * tokens


def choose(cfg, candidates: list, prompt_tokens: int, new_tokens: int, min_context: int,
           taus: Optional[dict], costs: Optional[dict]) -> AutoChoice:
    """The layers of ``candidates`` that go sparse.

    Args:
        cfg: the model's ModelConfig (``num_kv_heads``).
        candidates: layer indexes SCSA could run on (the sparse policy's layers).
        prompt_tokens, new_tokens: the run's prompt length and the tokens it may generate.
        min_context: ``SCSAConfig.min_context``.
        taus: ``{layer: [tau or None per KV head]}`` calibrated earlier, or None.
        costs: ``{layer: predicted sparse / dense cost ratio or None}`` from that calibration.
    """
    if taus is None:
        return AutoChoice(reason="no calibrated taus for this model and setting yet (a first "
                                 "`--policy sparse` run calibrates and keeps them)")
    end = prompt_tokens + new_tokens
    if end < min_context:
        return AutoChoice(reason=f"the run ends at {end} cached tokens, below min_context ({min_context})")
    chosen, saving, index, why = [], 0.0, 0.0, {}
    for layer in candidates:
        ratio = (costs or {}).get(layer)
        if any(t is None for t in taus.get(layer, [None])):
            why.setdefault("a head attends exactly (its calibration found no tau)", []).append(layer)
            continue
        if ratio is None:
            why.setdefault("no cost prediction kept with the taus", []).append(layer)
            continue
        s = decode_saving(ratio, cfg.num_kv_heads, prompt_tokens, new_tokens, min_context)
        i = index_cost(cfg.num_kv_heads, end)
        if s <= i:
            why.setdefault("the decode saving does not cover the index", []).append(layer)
            continue
        chosen.append(layer)
        saving, index = saving + s, index + i
    if chosen:
        reason = f"SCSA on {len(chosen)} of {len(candidates)} layers: predicted decode saving exceeds the index"
    else:
        reason = "no SCSA: " + "; ".join(f"{text} on layers {_span(layers)}" for text, layers in why.items())
    return AutoChoice(chosen, reason, saving, index)


def _span(layers: list) -> str:
    return ", ".join(map(str, layers)) if len(layers) <= 4 else f"{layers[0]}..{layers[-1]}, {len(layers)} in all"


def restrict(policy: AttentionPolicy, layers: list) -> AttentionPolicy:
    """``policy`` with SCSA kept on ``layers`` only: its other sparse layers attend densely
    (what a sparse layer does below min_context, so the function is the same)."""
    keep = set(layers)
    out = [lp if lp.kind != "sparse" or i in keep else LayerPolicy("window", None, 0)
           for i, lp in enumerate(policy.layers)]
    return AttentionPolicy(out, banded_min_tokens=policy.banded_min_tokens,
                           sparse_config=policy.sparse_config if keep else None,
                           fused_decode=policy.fused_decode)


def candidate_layers(policy: AttentionPolicy) -> list:
    """The layers ``policy`` runs SCSA on."""
    return sparse_layers(policy)
