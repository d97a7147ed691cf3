"""tau = 0 opens every cluster: SCSA then equals dense attention up to the packing's rounding.

Tolerances are derived, never guessed:
  * fp32 budget: twice the error of plain fp32 attention (``reference_attention`` in float32)
    against the float64 reference, floored at a few ulps of the largest value;
  * f32 packing reads full-precision rows, so it must meet the fp32 budget;
  * f16 / q8_0 packing: the operator must equal *dense attention over the packed operands*
    (the serial float64 path computes exactly that) within the fp32 budget, and its distance to
    true dense is bounded by the rounding: if every score moves by at most Delta and every value
    element by at most dv, softmax weights move by a factor within exp(+-2 Delta), so
    ``|o' - o|_inf <= (exp(2 Delta) - 1) max|v| + dv``.
    f16: per element ``|fl16(x) - x| <= 2**-11 |x| + 2**-25``; q8_0: ``q8_dot_bound`` per score
    and ``scale / 2`` per value element.
  * f16 packing of keys/values that are exactly representable in f16 is lossless, so it must
    meet the fp32 budget against true dense.
"""

import pytest
import torch
import torch.nn.functional as F

from longattn.ops.reference import reference_attention
from longattn.sparse import SCSALayer
from longattn.sparse.packing import dequantize_q8, q8_block, q8_dot_bound, quantize_q8
from sparse_fixtures import attn_case, small_cfg as _small_cfg
from tolerance import derived_tolerance, ulps

H, HKV, D, N = 4, 2, 64, 1111


def small_cfg(**kw):
    return _small_cfg(**{"tau_default": 0.0, **kw})


def ref64(q, k, v, scale):
    mask = torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool)
    return reference_attention(q.double(), k.double(), v.double(), mask, scale)


def fp32_budget(q, k, v, scale):
    mask = torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool)
    plain = reference_attention(q.float(), k.float(), v.float(), mask, scale)
    return derived_tolerance(plain, ref64(q, k, v, scale), floor=ulps(4, v.abs().max().item()))


def data(n=N, seed=0):
    return attn_case(n, H, HKV, D, seed=seed)


def sealed(layer, x):
    """Rows of ``x [1, Hkv, N, D]`` that the index packed."""
    index = layer.indexes[0]
    return x[:, :, layer.cfg.sink:index.seal_end]


@pytest.mark.parametrize("cluster_size, outliers", [(16, 0), (24, 0), (16, 3)])
@pytest.mark.parametrize("hierarchical", [False, True])
def test_tau0_f32_packing_equals_dense(cluster_size, outliers, hierarchical):
    q, k, v, scale = data()
    layer = SCSALayer(small_cfg(packing="f32", cluster_size=cluster_size, hierarchical=hierarchical,
                                outliers=outliers), H, HKV, D)
    out = layer.attend(q, k, v, scale)
    assert out.dtype == torch.float32 and out.shape == (1, H, 1, D)
    assert layer.indexes[0].num_clusters > 0
    assert layer.counters["opened_rows"] + layer.counters["exact_rows"] == HKV * N
    err = (out.double() - ref64(q, k, v, scale)).abs().max().item()
    assert err <= fp32_budget(q, k, v, scale)


def test_tau0_f16_exact_data_equals_dense():
    q, k, v, scale = data(seed=1)
    k, v = k.half().float(), v.half().float()  # representable in f16: packing is lossless
    layer = SCSALayer(small_cfg(packing="f16"), H, HKV, D)
    out = layer.attend(q, k, v, scale)
    err = (out.double() - ref64(q, k, v, scale)).abs().max().item()
    assert err <= fp32_budget(q, k, v, scale)


@pytest.mark.parametrize("packing", ["f16", "q8_0"])
def test_tau0_equals_dense_over_packed_operands(packing):
    """Fast path == the float64 serial path (dense over the packed rows) within the fp32 budget."""
    q, k, v, scale = data(seed=2)
    fast = SCSALayer(small_cfg(packing=packing), H, HKV, D).attend(q, k, v, scale)
    slow = SCSALayer(small_cfg(packing=packing, serial=True), H, HKV, D).attend(q, k, v, scale)
    assert (fast.double() - slow.double()).abs().max().item() <= fp32_budget(q, k, v, scale)


def key_centres(layer, S):
    """The centre each sealed slot's packed key is stored relative to: ``[1, Hkv, S, D]``."""
    index, store = layer.indexes[0], layer.indexes[0].store
    out = torch.zeros(1, HKV, S, D)
    M, sink = index.num_clusters, layer.cfg.sink
    for h in range(HKV):
        for c in range(M):
            slots = index.slots[h, c][index.slots[h, c] >= 0]
            out[0, h, slots - sink] = store.key_center(h, c).float()
    return out


@pytest.mark.parametrize("packing, offset", [("f16", 0.0), ("q8_0", 0.0), ("q8_0", 40.0)])
def test_tau0_error_to_dense_is_bounded_by_the_packing(packing, offset):
    """offset: a large part shared by every key in a few dimensions (as key biases give real
    models): q8_0 keys are stored relative to their cluster's centroid, so the bound is that of
    the residuals, far below that of the keys (an uncentred store exceeds it)."""
    q, k, v, scale = data(seed=3)
    k = k + offset * (torch.arange(D) % 16 == 3).float()
    layer = SCSALayer(small_cfg(packing=packing), H, HKV, D)
    out = layer.attend(q, k, v, scale)
    ks, vs = sealed(layer, k), sealed(layer, v)  # [1, Hkv, S, D]
    qg = q[0, :, 0].view(HKV, H // HKV, 1, D)  # [Hkv, g, 1, D]
    if packing == "f16":
        u = 2.0 ** -11
        dk = (ks[0].unsqueeze(1).abs() * u + 2.0 ** -25)  # [Hkv, 1, S, D] per-element key error
        delta = scale * (qg.abs() * dk).sum(-1).max().item()
        dv = (vs.abs() * u + 2.0 ** -25).max().item()
    else:
        qb = q8_block(D)
        resid = ks - key_centres(layer, ks.shape[2])
        delta = scale * q8_dot_bound(qg, resid[0].unsqueeze(1), qb).max().item() * (1 + 1e-5)
        if offset:  # the centring is what makes the bound small
            assert delta < 0.2 * scale * q8_dot_bound(qg, ks[0].unsqueeze(1), qb).max().item()
        vi, vsc = quantize_q8(vs, qb)
        dv = (dequantize_q8(vi, vsc).double() - vs.double()).abs().max().item()
    bound = (torch.tensor(2 * delta).exp().item() - 1) * v.abs().max().item() + dv
    err = (out.double() - ref64(q, k, v, scale)).abs().max().item()
    assert err <= bound + fp32_budget(q, k, v, scale)
    assert err > 0  # the packing does round


def test_below_min_context_runs_dense_exactly():
    q, k, v, scale = data(n=300)
    layer = SCSALayer(small_cfg(min_context=301), H, HKV, D)
    out = layer.attend(q, k, v, scale)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True))
    assert layer.indexes == [] and layer.counters["exact_rows"] == HKV * 300


def test_cache_too_short_to_seal_runs_dense_exactly():
    q, k, v, scale = data(n=60)  # 60 - sink - recent < rebuild_interval: nothing to cluster
    layer = SCSALayer(small_cfg(), H, HKV, D)
    out = layer.attend(q, k, v, scale)
    assert layer.indexes[0].num_clusters == 0
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True))


def test_output_dtype_follows_q():
    q, k, v, scale = data()
    layer = SCSALayer(small_cfg(tau_default=0.05), H, HKV, D)
    out = layer.attend(q.double(), k, v, scale)
    assert out.dtype == torch.float64
    out = layer.attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale)
    assert out.dtype == torch.bfloat16
