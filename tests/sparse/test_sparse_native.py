"""SCSA's C++ sparse call (ops/csrc/scsa_decode.cpp) against the PyTorch path and the float64
serial reference: same clusters opened, same counters, every key counted once, output within a
derived tolerance, for several head layouts, q8 block widths, thresholds and thread counts.

Tolerance, derived: the kernel computes what the PyTorch path computes (same quantized query,
same integer block dots, same tails), in another summation order and with an exp polynomial of
2 ulp relative error on each weight. So against the float64 serial path it may be off by twice
the PyTorch float32 path's own error plus 2 * 2**-23 * max|v| (the output is a convex
combination of value rows and value means, all bounded by max|v|)."""

import pytest
import torch

from longattn.ops import native
from longattn.sparse import SCSALayer
from longattn.sparse import layer as layer_mod
from sparse_fixtures import attn_case, decode_run, small_cfg
from tolerance import assert_within_derived, ulps

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the AVX2 kernels (x86)")

def layers(H, HKV, D, **kw):
    """(native, PyTorch, serial float64) layers with one config."""
    return [SCSALayer(small_cfg(**kw, native=n, serial=s), H, HKV, D) for n, s in
            ((True, False), (False, False), (False, True))]


def run(layer, q, k, v, scale):
    out = layer.attend(q, k, v, scale)
    return out, layer._last[-1][1]


def check_case(H, HKV, D, n, tau, seed=0, queries=2, **kw):
    qs, k, v, scale = attn_case(n, H, HKV, D, seed=seed, queries=queries, query_seed=seed + 1, centers=12)
    fast, torch_path, slow = layers(H, HKV, D, tau_default=tau, **kw)
    vmax = v.abs().max().item()
    for q in qs:
        a, sa = run(fast, q, k, v, scale)
        b, sb = run(torch_path, q, k, v, scale)
        ref, sr = run(slow, q, k, v, scale)
        assert torch.equal(sa.opened, sb.opened) and torch.equal(sa.opened, sr.opened)
        assert_within_derived(a, b, ref, floor=ulps(2, vmax))  # the exp polynomial's 2 ulp
        (acc,) = fast.debug_accounting()
        assert torch.equal(acc["coverage"], torch.ones_like(acc["coverage"]))
    assert fast.counters == torch_path.counters
    return fast


@pytest.mark.parametrize("H,HKV,D", [(14, 2, 64), (4, 1, 256), (6, 3, 48), (4, 2, 40), (8, 8, 32)])
@pytest.mark.parametrize("tau", [0.0, 0.01, 0.1, 0.5])
def test_matches_torch_path_and_serial(H, HKV, D, tau):
    check_case(H, HKV, D, 700, tau, cluster_size=24)


@pytest.mark.parametrize("H,HKV,D", [(14, 2, 64), (6, 3, 48)])
@pytest.mark.parametrize("tau", [0.0, 0.05])
def test_outliers_match_torch_path_and_serial(H, HKV, D, tau):
    layer = check_case(H, HKV, D, 700, tau, cluster_size=24, outliers=5)
    index = layer.indexes[0]
    M = index.num_clusters
    taken = int((index.out_slots[0, :M] >= 0).sum())
    assert taken == 5 * M - 1 and index.extra_slots.shape == (HKV, taken)  # 27 clusters of 24-5, one of 9-4


def test_outlier_copies_read_as_the_cache_rows():
    """The native call reads the outliers from the index's contiguous copies (extra_k/extra_v);
    given none it reads the same rows from the cache by slot: the outputs are the same bits."""
    H, HKV, D = 14, 2, 64
    qs, k, v, scale = attn_case(900, H, HKV, D, seed=4, queries=3, query_seed=5, centers=12)
    layer = SCSALayer(small_cfg(tau_default=0.05, cluster_size=24, outliers=5), H, HKV, D)
    layer.attend(qs[0], k, v, scale)
    index = layer.indexes[0]
    assert index.extra_k.shape == (HKV, index.extra_slots.shape[1], D) and index.extra_slots.shape[1] > 100
    s0, s1 = index.exact_slots(k.shape[2])
    st = index.store
    for q in qs:
        calls = [torch.ops.longattn_cpu.scsa_decode(
            q[0, :, 0], k[0], v[0], s0, s1, index.extra_slots, index.summ, index.resid, index.log_counts,
            index.radius, index.vmean, index.counts, index.num_clusters, st.kt, st.ks, st.vi, st.vs, layer.taus,
            scale, 0, 1, *copies) for copies in ((index.extra_k, index.extra_v), (None, None))]
        for a, b in zip(*calls):
            assert torch.equal(a, b)
    # a copy that differs from the cache is what the call reads: the copies are not decoration
    odd = index.extra_v.clone()
    odd[:, :, :] = 1e3
    moved = torch.ops.longattn_cpu.scsa_decode(
        qs[0][0, :, 0], k[0], v[0], s0, s1, index.extra_slots, index.summ, index.resid, index.log_counts,
        index.radius, index.vmean, index.counts, index.num_clusters, st.kt, st.ks, st.vi, st.vs, layer.taus,
        scale, 0, 1, index.extra_k, odd)[0]
    assert not torch.equal(moved, layer.attend(qs[0], k, v, scale)[0, :, 0])


@pytest.mark.parametrize("H,HKV,D", [(14, 2, 64), (6, 3, 48), (4, 2, 40), (4, 4, 64)])
@pytest.mark.parametrize("tau, dims, keys", [(0.5, 8, 1), (0.05, 8, 3), (1.0, 64, 2), (0.5, 1, 2)])
def test_probe_matches_torch_path_and_serial(H, HKV, D, tau, dims, keys):
    """The probe inside the native call opens what the PyTorch and float64 paths open (its
    scores as theirs: the same quantized masked query and integer block dots); with tau 1 only
    the probe opens anything, and all of D scored (dims 64 >= D) is the exact ranking. The
    native scorer reads, per query head, only the dimension runs where its query is non-zero:
    at one dimension one of a head's two q8 blocks (D 64, 4 or 7 heads per KV head) has none,
    so the skipped-block path is taken on every call."""
    layer = check_case(H, HKV, D, 700, tau, cluster_size=24, outliers=3, probe_dims=dims, probe_keys=keys)
    assert 0 < layer.counters["opened_rows"]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_split_the_opened_clusters(threads):
    torch.set_num_threads(threads)  # the autouse _one_thread_for_tiny_ops fixture restores it
    layer = check_case(14, 2, 64, 1500, 0.02, seed=3, cluster_size=16)
    assert 0 < layer.counters["opened_rows"]


def test_native_path_runs_and_partial_selection(monkeypatch):
    calls = []
    real = layer_mod._native_call

    def spy(*a):
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(layer_mod, "_native_call", spy)
    layer = check_case(14, 2, 64, 1200, 0.05, seed=4, cluster_size=16)
    assert len(calls) == 2
    M = layer.indexes[0].num_clusters
    opened = layer.counters["opened_rows"]
    assert 0 < opened < 2 * 2 * M * 16  # some clusters opened, not all


def test_decode_loop_shortcut_equals_the_general_path(monkeypatch):
    """SCSALayer._hot_call, the decode loop's step once a single-row call went native, against
    the general path on every step: a cache growing across rebuilds, a step at another scale, a
    bfloat16 query, another sequence of the same length, new taus. Outputs bit for bit, counters,
    accounting and indexes alike, and the shortcut taken where nothing changed (and only there)."""
    H, HKV, D, start, steps = 14, 2, 64, 900, 150  # rebuilds every 64 tokens: two or three of them
    run = decode_run(start, steps, H, HKV, D, seed=6, query_seed=7)
    other = decode_run(start, steps, H, HKV, D, seed=8, query_seed=9)
    scale = D ** -0.5
    fast, slow = (SCSALayer(small_cfg(tau_default=0.05, cluster_size=16, outliers=3), H, HKV, D) for _ in range(2))
    taken = []
    real = SCSALayer._hot_call

    def hot_call(self, *a):
        if self is slow:
            return None
        out = real(self, *a)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(SCSALayer, "_hot_call", hot_call)
    script = [(q, k, v, scale) for q, k, v in run[:60]] + [(run[60][0], run[60][1], run[60][2], scale * 0.5)]
    script += [(q, k, v, scale) for q, k, v in run[61:100]] + [(run[100][0].bfloat16(), run[100][1], run[100][2], scale)]
    script += [(q, k, v, scale) for q, k, v in run[101:120]] + [other[119]] + [(q, k, v, scale) for q, k, v in run[120:]]
    script = [s if len(s) == 4 else (*s, scale) for s in script]
    for i, (q, k, v, sc) in enumerate(script):
        if i == 130:
            for layer in (fast, slow):
                layer.set_taus([0.02, 0.1])
        a, b = fast.attend(q, k, v, sc), slow.attend(q, k, v, sc)
        assert torch.equal(a, b) and a.dtype == q.dtype, i
        assert fast.counters == slow.counters, i
        (x,), (y,) = fast.debug_accounting(), slow.debug_accounting()
        assert all(torch.equal(x[key], y[key]) for key in x), i
    assert torch.equal(fast.indexes[0].summ, slow.indexes[0].summ)
    assert fast.counters["rebuilds"] >= 3 and sum(taken) > 100
    # not taken: after a rebuild, the other scale, the bfloat16 query, the other sequence (and
    # the step back to the first one), after new taus
    assert len(taken) - sum(taken) >= 7


def test_strided_cache_rows_and_batch_rows():
    """Rows of a larger capacity buffer (the model's growing cache) and two batch rows with
    different caches: each row equals its own contiguous single-row call."""
    H, HKV, D, n = 6, 2, 32, 900
    qs, k, v, scale = attn_case(n, H, HKV, D, seed=7, queries=2, query_seed=2, centers=10)
    cap_k = torch.zeros(2, HKV, n + 77, D)
    cap_v = torch.zeros_like(cap_k)
    cap_k[0, :, :n], cap_v[0, :, :n] = k[0], v[0]
    cap_k[1, :, :n], cap_v[1, :, :n] = k[0].flip(1), v[0].flip(1)
    q = torch.cat([qs[0], qs[1]])
    batched = SCSALayer(small_cfg(tau_default=0.03, cluster_size=24), H, HKV, D)
    out = batched.attend(q, cap_k[:, :, :n], cap_v[:, :, :n], scale)
    for b in range(2):
        single = SCSALayer(small_cfg(tau_default=0.03, cluster_size=24), H, HKV, D)
        ref = single.attend(q[b:b + 1], cap_k[b:b + 1, :, :n].contiguous(), cap_v[b:b + 1, :, :n].contiguous(), scale)
        assert torch.equal(out[b:b + 1], ref)


def test_other_packings_and_hierarchical_keep_the_torch_path(monkeypatch):
    monkeypatch.setattr(SCSALayer, "_native_row", lambda *a, **kw: pytest.fail("native path taken"))
    qs, k, v, scale = attn_case(600, 4, 2, 32, seed=1, queries=1)
    for kw in (dict(packing="f16"), dict(packing="f32"), dict(hierarchical=True), dict(native=False)):
        SCSALayer(small_cfg(tau_default=0.05, **kw), 4, 2, 32).attend(qs[0], k, v, scale)


def test_kernel_rejects_bad_inputs():
    layer = SCSALayer(small_cfg(tau_default=0.05), 4, 2, 32)
    qs, k, v, scale = attn_case(600, 4, 2, 32, seed=1, queries=1)
    layer.attend(qs[0], k, v, scale)
    index = layer.indexes[0]
    st = index.store
    args = [qs[0][0, :, 0], k[0], v[0], 4, 500, index.extra_slots, index.summ, index.resid, index.log_counts,
            index.radius, index.vmean, index.counts, index.num_clusters, st.kt, st.ks, st.vi, st.vs, layer.taus,
            scale, 0, 1, None, None]
    torch.ops.longattn_cpu.scsa_decode(*args)  # the valid call (outliers read from the cache)
    for i, bad, needle in ((1, k[0].double(), "float32"), (4, 10_000, "s0 <= s1 <= N"),
                           (5, torch.full((2, 1), 550), r"extra slots must lie in \[s0, s1\)"),
                           (5, torch.zeros(2, 1, dtype=torch.int32), "extra int64"),
                           (12, index.summ.shape[1] + 1, "C >= M"), (17, torch.zeros(3), "taus"),
                           (19, -1, "probe_dims >= 0"), (20, 0, "probe_keys >= 1"),
                           (21, index.extra_k, "go together")):
        wrong = list(args)
        wrong[i] = bad
        with pytest.raises(RuntimeError, match=needle):
            torch.ops.longattn_cpu.scsa_decode(*wrong)
    X = index.extra_slots.shape[1]
    for shape in ((2, X + 1, 32), (2, X, 16)):
        with pytest.raises(RuntimeError, match=r"extra_k/extra_v float32 \[Hkv, X, D\]"):
            torch.ops.longattn_cpu.scsa_decode(*args[:21], torch.zeros(shape), torch.zeros(shape))
    # one row's 4-D tensors as the model holds them give the 3-D call's output, shaped [1, H, 1, D]
    four = torch.ops.longattn_cpu.scsa_decode(qs[0], k, v, *args[3:])
    three = torch.ops.longattn_cpu.scsa_decode(*args)
    assert four[0].shape == (1, 4, 1, 32) and torch.equal(four[0][0, :, 0], three[0])
    assert torch.equal(four[1], three[1]) and int(four[2]) == int(three[2])
    for q4, k4 in ((qs[0].expand(2, -1, -1, -1), k), (qs[0], k.expand(2, -1, -1, -1))):
        with pytest.raises(RuntimeError, match=r"a 4-D call is one row"):
            torch.ops.longattn_cpu.scsa_decode(q4, k4, k4, *args[3:])



@pytest.mark.parametrize("cluster_size", [20, 13])
def test_cluster_sizes_off_the_8_row_tiles(cluster_size):
    """Clusters whose size is not a multiple of the 8-row key tile (the last tile padded)."""
    layer = check_case(14, 2, 64, 700, 0.05, seed=5, cluster_size=cluster_size)
    assert 0 < layer.counters["opened_rows"]


@pytest.mark.parametrize("H,HKV,D,cluster_size", [(14, 2, 64, 16), (4, 1, 256, 24), (6, 3, 48, 13),
                                                  (4, 2, 40, 20), (18, 2, 32, 24)])
@pytest.mark.parametrize("probe,outliers", [(0, 0), (0, 5), (8, 0), (512, 0)])
def test_avx512_form_equals_the_avx2_form(H, HKV, D, cluster_size, probe, outliers):
    """The AVX-512 forms do the AVX2 ones' integer dots and float operations in the same order
    per element, so outputs, selections and counters are bit-identical: the opened-cluster phase
    (head dims with q8 blocks of 32, 16 and 8 values: with 8 the values stay AVX2; 9 query heads
    per KV head: head chunks of 8 + 1; with and without the probe, whose own tile forms score
    every row over 8 dimensions or all of them) and the exact rows' and tails' values where the
    head dim is a multiple of 64 (64 and 256 here: heads in passes of 4, so 7 = 4 + 3; with and
    without outliers among the exact rows). A CPU without AVX-512 refuses the forced form instead."""
    qs, k, v, scale = attn_case(900, H, HKV, D, seed=11, queries=3, query_seed=12, centers=12)
    cfg = dict(tau_default=0.03, cluster_size=cluster_size, probe_dims=probe, outliers=outliers)
    if not native.has_avx512():
        with pytest.raises(RuntimeError, match="lacks AVX-512"):
            SCSALayer(small_cfg(**cfg, isa="avx512"), H, HKV, D).attend(qs[0], k, v, scale)
        return
    results = []
    for isa in ("avx2", "avx512"):
        layer = SCSALayer(small_cfg(**cfg, isa=isa), H, HKV, D)
        outs = [layer.attend(q, k, v, scale) for q in qs]
        results.append((outs, layer._last[-1][1].opened, dict(layer.counters)))
    (a, sa, ca), (b, sb, cb) = results
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(sa, sb) and ca == cb
    assert 0 < ca["opened_rows"]
