"""SCSA inside the static decode step (static_sparse.py): the same decisions as the eager
sparse Session (counters, calibrated taus), logits as close as the two engines' dense paths
are to each other, one compiled graph that never recompiles, batched streams equal to each
alone, and warm-up / reset leave no trace.

Tolerance, derived: the static and eager engines compute the same model by different
summation orders (own key merged apart, fused kernel), so the sparse logits of the two may
differ by at most twice what their dense logits differ by, plus a few ulp of the logit scale.
That holds where the sparse output is a continuous function of q, k and v: with the f32
packing. q8_0 scoring rounds the query (12-bit blocks) and the keys, so an ulp of difference
between the engines' inputs can flip one rounding step, a jump no dense difference predicts;
for q8_0 the tests check the decisions (counters, taus, opened rows), which use the float
estimates and so must match exactly."""

import pytest
import torch

from conftest import tiny_dir
from longattn.checkpoint import load_checkpoint
from longattn.errors import LongattnError
from longattn.models import build_model
from longattn.policy import AttentionPolicy
from longattn.engine.session import Session
from longattn.sparse import SCSAConfig
from longattn.sparse.policy import build_sparse_policy, stream_layers
from longattn.engine.static_step import StaticDecoder
from model_paths import ids_for
from tolerance import derived_bound, max_err, ulps

# tiny clusters and blocks so a ~100-token cache seals, rebuilds and freezes while decoding
# (dense_when_cheaper off: on a ~100-token cache the cost rule would route every layer dense)
CFG = dict(cluster_size=8, rebuild_interval=16, block_size=64, sink=2, recent=4, min_context=0,
           calib_steps=4, tolerance=0.05, dense_when_cheaper=False)
PROMPT, STEPS = 90, 24


def model(family="llama"):
    ck = load_checkpoint(tiny_dir(family), with_tokenizer=False)
    return build_model(ck.config, ck.state_dict)


def sparse_pol(m, **kw):
    return build_sparse_policy(m.config, SCSAConfig(**{**CFG, **kw}))


def eager_logits(m, pol, ids, n):
    s = Session(m, pol)
    out = [s.prefill(ids[:, :n])[:, 0]]
    out += [s.step(ids[:, t]) for t in range(n, ids.shape[1])]
    return torch.stack(out, 1), s


def static_logits(dec, ids, n):
    out = [dec.prefill(ids[:, :n])[:, 0]]
    out += [dec.step(ids[:, t]) for t in range(n, ids.shape[1])]
    return torch.stack(out, 1)


def counters(layers):
    return {k: sum(sc.counters[k] for sc in layers) for k in ("opened_rows", "exact_rows", "outlier_rows",
                                                                  "clusters_scored", "calls", "rebuilds")}


def tol_from_dense(m, ids):
    dense = AttentionPolicy.from_config(m.config)
    e, _ = eager_logits(m, dense, ids, PROMPT)
    st = static_logits(StaticDecoder(m, dense, max_len=ids.shape[1] + 1, compile=False), ids, PROMPT)
    return derived_bound(max_err(e, st), floor=ulps(4, e.abs().max().item()))


@pytest.mark.parametrize("packing", ["q8_0", "f32"])
@pytest.mark.parametrize("family, outliers", [("llama", 0), ("gemma3", 0), ("llama", 2)])
def test_static_sparse_makes_the_eager_decisions(family, outliers, packing):
    m = model(family)
    ids = ids_for(1, PROMPT + STEPS, seed=3)
    e, s = eager_logits(m, sparse_pol(m, outliers=outliers, packing=packing), ids, PROMPT)
    dec = StaticDecoder(m, sparse_pol(m, outliers=outliers, packing=packing), max_len=ids.shape[1] + 1,
                        compile=False)
    st = static_logits(dec, ids, PROMPT)
    eager_ops = stream_layers(s.cache)
    assert eager_ops, "no sparse layer ran"
    for layer, sc in eager_ops.items():
        (static_sc,) = dec.sparse.of_layer(layer)
        assert counters([static_sc]) == counters([sc])
        assert torch.equal(static_sc.taus, sc.taus) and static_sc.calibrated
    assert counters(dec.sparse.layers.values())["opened_rows"] > 0
    taken = [ix.extra_slots.shape[1] for sc in eager_ops.values() for ix in sc.indexes]
    assert (min(taken) > 0) if outliers else (max(taken) == 0)
    if packing == "f32":  # continuous in the inputs (see the module docstring)
        assert max_err(st, e) <= tol_from_dense(m, ids)


def test_compiled_static_sparse_is_one_graph():
    torch._dynamo.reset()
    m = model()
    ids = ids_for(1, PROMPT + STEPS, seed=5)
    # f32 packing: the logits are then continuous in the inputs (see the module docstring)
    eager_dec = StaticDecoder(m, sparse_pol(m, packing="f32"), max_len=ids.shape[1] + 1, compile=False)
    want = static_logits(eager_dec, ids, PROMPT)
    dec = StaticDecoder(m, sparse_pol(m, packing="f32"), max_len=ids.shape[1] + 1, compile=True)
    dec.warmup()
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = static_logits(dec, ids, PROMPT)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert max_err(got, want) <= tol_from_dense(m, ids)
    assert counters(dec.sparse.layers.values())["calls"] == counters(eager_dec.sparse.layers.values())["calls"]


def batched_and_alone(m, pol_fn, prompts, cont, warmup=False):
    """Logits of the two streams decoded together ``[2, T, V]`` and each alone, and the decoder."""
    n = cont.shape[1]
    dec = StaticDecoder(m, pol_fn(), batch=2, max_len=PROMPT + 16, compile=False)
    if warmup:
        dec.warmup()  # inactive streams: must touch no index
        assert dec.sparse is None or not dec.sparse.layers
    out = torch.stack([dec.prefill(prompts)[:, 0]] + [dec.step(cont[:, t]) for t in range(n)], 1)
    alone = []
    for b in range(2):
        one = StaticDecoder(m, pol_fn(), batch=1, max_len=PROMPT + 16, compile=False)
        alone.append(torch.stack([one.prefill([prompts[b]])[:, 0]] +
                                 [one.step(cont[b:b + 1, t]) for t in range(n)], 1)[0])
        if one.sparse is not None:  # the same SCSA decisions as stream b of the batch
            for layer in range(m.config.num_layers):
                assert counters(one.sparse.of_layer(layer)) == counters([dec.sparse.layer(layer, b)])
    return out, torch.stack(alone), dec


def test_batched_streams_equal_each_alone_and_reset_forgets():
    """Two streams of different lengths: each decodes as it would alone (same decisions; logits
    within twice what the dense policy's batched and lone runs differ by, plus 4 ulp)."""
    m = model()
    prompts = [ids_for(1, PROMPT, seed=1)[0].tolist(), ids_for(1, PROMPT - 20, seed=2)[0].tolist()]
    cont = ids_for(2, 12, seed=4)
    dense_b, dense_a, _ = batched_and_alone(m, lambda: AttentionPolicy.from_config(m.config), prompts, cont)
    out, alone, dec = batched_and_alone(m, lambda: sparse_pol(m), prompts, cont, warmup=True)
    tol = derived_bound(max_err(dense_b, dense_a), floor=ulps(4, alone.abs().max().item()))
    assert max_err(out, alone) <= tol
    # reset: a new sequence starts from empty indexes and decodes as the first one did;
    # the calibrated taus stay (no second calibration)
    taus = {k: sc.taus.clone() for k, sc in dec.sparse.layers.items()}
    calls = counters(dec.sparse.layers.values())["calls"]
    dec.reset()
    again = torch.stack([dec.prefill(prompts)[:, 0]] + [dec.step(cont[:, t]) for t in range(12)], 1)
    assert all(torch.equal(sc.taus, taus[k]) and sc.calibrated for k, sc in dec.sparse.layers.items())
    assert counters(dec.sparse.layers.values())["calls"] == 2 * calls
    assert torch.equal(again[:, 0], out[:, 0])  # the prefill runs the same dense path


def test_sparse_with_softcap_is_refused():
    ck = load_checkpoint(tiny_dir("llama"), with_tokenizer=False)
    cfg = ck.config
    pol = build_sparse_policy(cfg, SCSAConfig(**CFG))  # built by hand before the softcap is set
    cfg.attn_softcap = 30.0
    m = build_model(cfg, ck.state_dict)
    with pytest.raises(LongattnError, match="soft-capping"):
        StaticDecoder(m, pol, compile=False)
    with pytest.raises(LongattnError, match="soft-capping"):
        sparse_pol(m)
