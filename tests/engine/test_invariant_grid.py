"""The shared invariants over every registered attention op kind and every cache kind.

The grid's axes come from the registries at collection time (``policy.OP_REGISTRY`` once the
sparse kind has registered itself; ``cache.hybrid.CACHE_KINDS``, the factory's kinds), so a
newly registered op or cache kind gets these checks without a line here:

- unset == dense: an op kind with its hyperparameters unset (``LayerPolicy(kind)``) computes
  exactly what the dense policy computes, ``torch.equal``, on the full forward, chunked
  prefill and step decode, over each cache kind;
- paths agree: with its hyperparameters set, chunked prefill and step decode are within the
  derived tolerance (tests/tolerance.py) of the full forward's error against a float64 run;
- batched == alone: several streams prefilled and decoded together are each within the
  derived tolerance of that stream's own full forward;
- trimmed == kept: step decode that drops, after every step, the slots no later query reads
  (``cache.trim_to_window``) stays within the derived tolerance too.

A cache kind that cannot hold a policy (a bounded cache under a layer without a window) is
checked to refuse it with one LongattnError line instead. ``KIND_SETTINGS`` gives a kind the settings that make
its op do real work on a tiny model; a kind without an entry runs with ``LayerPolicy(kind)``.
"""

from __future__ import annotations

import pytest
import torch

import longattn.sparse.policy  # noqa: F401  (registers the "sparse" op kind)
from conftest import tiny_model
from longattn.cache import LAYER_CACHES, make_cache, trim_to_window
from longattn.cache.hybrid import CACHE_KINDS
from longattn.engine.session import Session
from longattn.errors import LongattnError
from longattn.policy import OP_REGISTRY, AttentionPolicy, LayerPolicy
from longattn.sparse import SCSAConfig
from model_paths import PATHS, assert_streams_agree, ids_for, run_path
from tolerance import LOGIT_FLOOR, assert_within_derived

OP_KINDS = sorted(OP_REGISTRY)
FAMILY = "llama"  # 3 layers, every one global: the op under test runs on layers 1 and 2

# Per op kind: ``layer`` (LayerPolicy arguments beyond the kind) and ``policy`` (AttentionPolicy
# keywords) that make the op change attention; ``lens``: the prompt lengths of the batched run.
KIND_SETTINGS = {
    "window": dict(layer=dict(window=4, sinks=2)),
    # tau 0 with float32 keys: SCSA reads every key, so it agrees with dense within the derived
    # tolerance; min_context 0 and tiny clusters so a ~30-token cache already runs it. Its
    # streams must be unpadded (equal lengths).
    "sparse": dict(policy=dict(sparse_config=SCSAConfig(
        cluster_size=4, rebuild_interval=8, block_size=16, sink=2, recent=4, min_context=0, calib_steps=0,
        outliers=0, dense_when_cheaper=False, packing="f32", tau_default=0.0)), lens=[13, 13, 13]),
}


def unset_policy(cfg, kind):
    """Every layer ``LayerPolicy(kind)``: the kind's hyperparameters all unset."""
    return AttentionPolicy([LayerPolicy(kind)] * cfg.num_layers)


def active_policy(cfg, kind):
    """Layer 0 a window of 5 with one sink (so a hybrid cache holds a ring), the other layers
    ``kind`` with the settings that make it do real work."""
    s = KIND_SETTINGS.get(kind, {})
    layers = [LayerPolicy("window", 5, 1)] + [LayerPolicy(kind, **s.get("layer", {}))] * (cfg.num_layers - 1)
    return AttentionPolicy(layers, **s.get("policy", {}))


def cache_factory(model, policy, cache_kind):
    """``batch -> KVCache`` of ``cache_kind`` for ``policy``, in the model's activation dtype."""
    return lambda batch: make_cache(model.config, policy, batch=batch, kind=cache_kind,
                                    dtype=model.activation_dtype, model=model)


def refused(model, policy, cache_kind) -> bool:
    """Whether ``cache_kind`` must refuse ``policy`` -- a bounded cache needs a window on every
    layer, every other kind holds any policy -- and, when it must, that it does (one
    LongattnError line)."""
    must = cache_kind == "bounded" and not all(lp.kind == "window" and lp.window for lp in policy.layers)
    if must:
        with pytest.raises(LongattnError, match="bounded cache needs a window") as e:
            make_cache(model.config, policy, kind=cache_kind)
        assert "\n" not in str(e.value)
    return must


def models_for(kind, cache_kind):
    """(float32, float64) tiny models, or None where ``cache_kind`` must refuse the kind's
    active policy (and is checked to)."""
    m, m64 = tiny_model(FAMILY), tiny_model(FAMILY, dtype=torch.float64)
    return None if refused(m, active_policy(m.config, kind), cache_kind) else (m, m64)


def full_and_ref(m, m64, kind, ids):
    """The plain float32 full forward's logits and the float64 model's, each under a fresh
    active policy of ``kind``."""
    return (run_path(m, active_policy(m.config, kind), ids, "forward"),
            m64(ids, policy=active_policy(m.config, kind)))


def test_every_layer_cache_is_reached_by_a_cache_kind():
    """Each registered layer cache is built by some factory kind, so the grid exercises it."""
    m = tiny_model(FAMILY)
    pol = active_policy(m.config, "window")
    built = {type(layer) for k in CACHE_KINDS for layer in make_cache(m.config, pol, kind=k).layers}
    assert set(LAYER_CACHES.values()) <= built


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
@pytest.mark.parametrize("kind", OP_KINDS)
def test_unset_equals_dense_bit_for_bit(kind, cache_kind, path):
    m = tiny_model(FAMILY)
    pol = unset_policy(m.config, kind)
    if refused(m, pol, cache_kind):
        return
    ids = ids_for(2, seed=1)
    dense = run_path(m, AttentionPolicy.build(m.config, "dense"), ids, path)
    unset = run_path(m, pol, ids, path, cache_factory(m, pol, cache_kind))
    assert torch.equal(unset, dense)


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
@pytest.mark.parametrize("kind", OP_KINDS)
def test_paths_agree(kind, cache_kind):
    """Chunked prefill and step decode (each in its own cache, which holds the ops' state) within
    the derived tolerance of the full forward's error against the float64 model."""
    if (models := models_for(kind, cache_kind)) is None:
        return
    m, m64 = models
    ids = ids_for(2, seed=5)
    full, ref = full_and_ref(m, m64, kind, ids)
    for p in ("chunked", "step"):
        pol = active_policy(m.config, kind)
        out = run_path(m, pol, ids, p, cache_factory(m, pol, cache_kind))
        assert_within_derived(out, full, ref, floor=LOGIT_FLOOR, what=f"{kind} / {cache_kind} / {p}")
    # not vacuous: the settings make step decode compute something other than dense attention
    assert not torch.equal(out, run_path(m, AttentionPolicy.build(m.config, "dense"), ids, "step"))


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
@pytest.mark.parametrize("kind", OP_KINDS)
def test_batched_equals_alone(kind, cache_kind):
    if (models := models_for(kind, cache_kind)) is None:
        return
    m, m64 = models
    pol = active_policy(m.config, kind)
    lens = KIND_SETTINGS.get(kind, {}).get("lens", [5, 17, 11])
    assert_streams_agree(m, m64, pol, lens=lens, steps=6, cache_factory=cache_factory(m, pol, cache_kind))


@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
@pytest.mark.parametrize("kind", OP_KINDS)
def test_trimmed_step_decode_agrees(kind, cache_kind):
    if (models := models_for(kind, cache_kind)) is None:
        return
    m, m64 = models
    ids = ids_for(2, seed=7)
    full, ref = full_and_ref(m, m64, kind, ids)
    pol = active_policy(m.config, kind)
    cache = cache_factory(m, pol, cache_kind)(2)
    s = Session(m, pol, cache)
    out = [s.prefill(ids[:, :1], logits="all")[:, 0]]
    for t in range(1, ids.shape[1]):
        trim_to_window(cache, pol)
        out.append(s.step(ids[:, t]))
    assert_within_derived(torch.stack(out, 1), full, ref, floor=LOGIT_FLOOR, what=f"{kind} / {cache_kind}")
    trim_to_window(cache, pol)
    for layer, lp in zip(cache.layers, pol.layers):  # the windowed layers really are trimmed
        if lp.kind == "window" and lp.window:
            assert layer.tokens() <= lp.window + lp.sinks
