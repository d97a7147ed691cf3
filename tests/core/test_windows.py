"""Windows and sinks on every attention site (full forward, chunked prefill, step decode,
several streams batched): unset == dense bit for bit, window >= prompt == no window bit for
bit, a real window changes the output, and all paths agree."""

import itertools

import pytest
import torch

from conftest import tiny_model
from longattn.cache.base import KVView
from longattn.errors import LongattnError
from longattn.ops.masks import allowed_mask
from longattn.policy import AttentionPolicy
from longattn.engine.session import Session
from model_paths import PATHS, T, assert_paths_agree, assert_streams_agree, ids_for, run_path
from tolerance import LOGIT_FLOOR, assert_within_derived


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_unset_and_wide_window_are_dense_bit_for_bit(family, path):
    m = tiny_model(family)
    ids = ids_for()
    dense = run_path(m, AttentionPolicy.build(m.config, "layers", windows=[None] * m.config.num_layers), ids, path)
    unset = run_path(m, AttentionPolicy([type(AttentionPolicy.from_config(m.config).layers[0])()] *
                                        m.config.num_layers), ids, path)
    wide = run_path(m, AttentionPolicy.build(m.config, "window", window=T), ids, path)
    wide_sinks = run_path(m, AttentionPolicy.build(m.config, "window", window=T + 100, sinks=3), ids, path)
    assert torch.equal(dense, unset)
    assert torch.equal(dense, wide)
    assert torch.equal(dense, wide_sinks)


@pytest.mark.parametrize("path", PATHS)
def test_real_window_changes_output(path):
    m = tiny_model("llama")
    ids = ids_for()
    dense = run_path(m, AttentionPolicy.build(m.config, "dense"), ids, path)
    win = run_path(m, AttentionPolicy.build(m.config, "window", window=6), ids, path)
    delta = (dense - win).abs().max().item()
    # positions < 6 see the same keys either way; later ones must change
    assert torch.equal(dense[:, :6], win[:, :6])
    assert delta > 1e-2, f"max |delta logit| = {delta:.3e}"
    print(f"window 6 vs dense on {path}: max |delta logit| = {delta:.3f}")


@pytest.mark.parametrize("family,window,sinks", [("llama", 5, 0), ("llama", 5, 2), ("gemma3", None, 0),
                                                 ("gemma3", 4, 1), ("qwen3", 3, 4)])
def test_all_paths_agree(family, window, sinks):
    m = tiny_model(family)
    m64 = tiny_model(family, dtype=torch.float64)
    pol = AttentionPolicy.from_config(m.config) if window is None else \
        AttentionPolicy.build(m.config, "window", window=window, sinks=sinks)
    assert_paths_agree(m, m64, pol)


@pytest.mark.parametrize("family,window,sinks", [("llama", None, 0), ("gemma3", None, 0), ("llama", 4, 2)])
def test_streams_batched_equal_each_alone(family, window, sinks):
    """Streams of different lengths prefilled and decoded together == each alone."""
    m = tiny_model(family)
    m64 = tiny_model(family, dtype=torch.float64)
    pol = AttentionPolicy.from_config(m.config) if window is None else \
        AttentionPolicy.build(m.config, "window", window=window, sinks=sinks)
    assert_streams_agree(m, m64, pol, lens=[5, 17, 11], steps=6)


@pytest.mark.parametrize("W,S", list(itertools.product([1, 2, 5], [0, 1, 3])))
def test_sink_mask_is_explicit(W, S):
    n = 14
    pos = torch.arange(n)[None]
    m = allowed_mask(pos, pos, W, S)[0, 0]
    for i in range(n):
        for j in range(n):
            want = j <= i and (i - j < W or j < S)
            assert bool(m[i, j]) == want, (i, j)


def test_sinks_reach_in_model():
    """With window 3 and 2 sinks, a 1-layer-deep change outside window+sinks is invisible."""
    m = tiny_model("llama", num_hidden_layers=1)
    pol = AttentionPolicy.build(m.config, "window", window=3, sinks=2)
    a = ids_for(1, 12, seed=7)
    b = a.clone()
    b[0, 4] = (b[0, 4] + 1) % 96          # position 4: outside the window of query 11, not a sink
    c = a.clone()
    c[0, 1] = (c[0, 1] + 1) % 96          # position 1: a sink, read by every query
    la, lb, lc = (m(x, policy=pol)[0, 11] for x in (a, b, c))
    assert torch.equal(la, lb)
    assert (la - lc).abs().max() > 1e-4


@pytest.mark.parametrize("kw,needle", [
    (dict(mode="window", window=-1), "non-negative"),
    (dict(mode="window", window=2.5), "integer"),
    (dict(mode="window", window=4, sinks=-2), "non-negative"),
    (dict(mode="layers", windows=[4]), "layers"),
    (dict(mode="window"), "needs --window"),
    (dict(mode="checkpoint", sinks=2), "sinks only matter"),
])
def test_bad_policy_settings(kw, needle):
    m = tiny_model("llama")
    with pytest.raises(LongattnError, match=needle):
        AttentionPolicy.build(m.config, **kw)


def test_model_prefill_takes_banded_path_and_agrees():
    """Windowed layers of a long prefill run banded attention (threshold lowered to 16
    tokens here); the result agrees with the masked-SDPA path within 2x its float32 error."""
    import longattn.ops.banded as banded_mod
    m = tiny_model("gemma3")
    m64 = tiny_model("gemma3", dtype=torch.float64)
    ids = ids_for(1, 70, seed=9)
    calls = []
    orig = banded_mod.banded_attention

    def spy(*a, **k):
        calls.append(a[3])
        return orig(*a, **k)
    banded_mod.banded_attention = spy
    try:
        fast = m(ids, policy=AttentionPolicy.from_config(m.config, banded_min_tokens=16))
    finally:
        banded_mod.banded_attention = orig
    plain = m(ids, policy=AttentionPolicy.from_config(m.config, banded_min_tokens=None))
    ref = m64(ids, policy=AttentionPolicy.from_config(m.config, banded_min_tokens=None))
    assert calls == [8, 8, 8, 8]  # the four local layers, window 8
    assert_within_derived(fast, plain, ref, floor=LOGIT_FLOOR)


def test_mask_memo_shared_across_layers_fresh_per_step():
    """Layers with the same window and sinks build their mask once per forward (the cache
    hands each layer its own key-position tensor, equal in value); each decode step, at
    new positions, builds it again and matches a policy that never reuses a mask."""
    m = tiny_model("gemma3")
    L = m.config.num_layers
    # decode steps read by the matmul form (the fused C++ read builds no mask at all)
    pol, ref_pol = (AttentionPolicy.from_config(m.config, fused_decode=False) for _ in range(2))
    groups = len({(lp.window, lp.sinks) for lp in pol.layers})
    assert 1 < groups < L  # local (window 8) and global layers
    ids = ids_for(1, 14, seed=3)  # 14 <= 16 tokens: every layer takes the masked path
    s, ref = Session(m, pol), Session(m, ref_pol)
    got, want = s.prefill(ids), ref.prefill(ids)
    assert torch.equal(got, want)
    memo = s.cache.masks  # the cache's: it lives as long as the streams whose positions it holds
    assert (memo.misses, memo.hits) == (groups, L - groups)
    for t in range(3):  # positions 14, 15, 16
        tok = ids_for(1, 1, seed=10 + t)[:, 0]
        ref.cache.masks.clear()
        want = ref.step(tok)
        misses, hits = memo.misses, memo.hits
        assert torch.equal(s.step(tok), want)
        assert (memo.misses - misses, memo.hits - hits) == (groups, L - groups)


def test_mask_memo_sees_positions_rewritten_in_place():
    """The same tensor objects with new values (as a cache writes its slots) build a new mask."""
    from longattn.ops.attention import MaskMemo, WindowOp
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (1, 10, 10))
    q_pos, k_pos = torch.tensor([[9]]), torch.arange(10)[None]
    op = WindowOp(4, 1, fused_decode=False)  # the masked (memo) path
    memo = MaskMemo()
    before = op(q, q_pos, KVView(k, v, k_pos, k, v, {}, memo), scale=0.35)
    q_pos.add_(1)
    k_pos.add_(1)
    after = op(q, q_pos, KVView(k, v, k_pos, k, v, {}, memo), scale=0.35)
    assert memo.misses == 2 and memo.hits == 0
    assert torch.equal(after, op(q, q_pos, KVView(k, v, k_pos, k, v), scale=0.35))  # no memo: built afresh
    assert not torch.equal(after, before)
    assert torch.equal(op(q, q_pos, KVView(k, v, k_pos.clone(), k, v, {}, memo), scale=0.35), after)
    assert memo.hits == 1
