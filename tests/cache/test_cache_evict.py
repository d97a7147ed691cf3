"""Eviction with renumbering == never having seen the span, and
bounded decode by trimming == windowed decode over the full cache.

Setting: tiny Llama (3 layers), window W = 6 on every layer, so a token reaches back
L * (W - 1) = 15 positions. Prompt = A (5 tokens) + X (7, evicted: positions 5..11) + B (20);
the last prompt token (31) and every later query reach back no further than 16 >= 12, so
no future computation depends on X -- nor on A. The never-seen run is A + B.

Tolerances, all derived (flash-attention's habit):
- Positions: exact (torch.equal); greedy tokens: identical.
- RoPE's translation invariance is exact in real arithmetic, but ``rope_cos_sin`` forms
  angles and cos/sin in float32 even for float64 models, so moving keys by d positions
  costs rounding. ``translation`` = the never-seen run re-run with every position shifted
  by d (float64), compared with the plain never-seen run: that is what relocating the
  same computation by d costs. Logits (float64) must lie within 2 x translation; float32
  logits within 2 x (translation + |never-seen float32 - float64|) of the float64 run.
- Keys: layer 0's keys do not depend on context, so eviction's re-rotation is their only
  error: within ``rerotate_error_bound`` (three float32 angle and cos/sin roundings) times
  the largest pair norm. Deeper layers also carry the translation noise of their inputs:
  within that bound plus 2 x the translated run's key error.
- Values: 2 x translation + 64 float64 ulps of the largest value (summation order: the
  runs feed different chunks).
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from longattn.cache import evict, make_cache, rerotate_error_bound, trim_to_window
from longattn.errors import LongattnError
from longattn.models.rope import apply_rope, rerotate, rope_cos_sin
from longattn.policy import AttentionPolicy
from longattn.engine.session import Session
from tolerance import derived_bound

W, S0, E0 = 6, 5, 12  # window, evicted span [S0, E0)
D_SPAN = E0 - S0
EPS64 = torch.finfo(torch.float64).eps


@pytest.fixture(scope="module")
def models():
    return {torch.float64: tiny_model("llama", dtype=torch.float64),
            torch.float32: tiny_model("llama", dtype=torch.float32)}


def _tokens(seed, vocab):
    g = torch.Generator().manual_seed(seed)
    r = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    return r(5), r(7), r(20)


def _by_position(layer):
    """A single-stream layer's filled entries in position order: (k, v, pos) copies."""
    k, v, p = layer.view()
    order = torch.argsort(p[0])[(p[0] < 0).sum():]
    return k[:, :, order].clone(), v[:, :, order].clone(), p[:, order].clone()


def _run(m, prompt, kind, span=None, offset=0, steps=10, forced=None):
    """Prefill (chunks of 5), optionally evict ``span``, then decode ``steps`` tokens
    (greedy, or ``forced``). Returns (logits [steps+1, V] float64, tokens, cache)."""
    cfg = m.config
    pol = AttentionPolicy.build(cfg, "window", window=W)
    cache = make_cache(cfg, pol, kind=kind, dtype=m.model.embed_tokens.weight.dtype)
    cache.next_pos[:] = offset
    s = Session(m, pol, cache)
    logits = [s.prefill([prompt], chunk=5)[:, 0]]
    snap = [_by_position(layer) for layer in cache.layers]
    if span is not None:
        evict(cache, span[0], span[1], m)
    after = [_by_position(layer) for layer in cache.layers]
    toks = []
    for i in range(steps):
        t = int(logits[-1].argmax()) if forced is None else forced[i]
        toks.append(t)
        logits.append(s.step(torch.tensor([t])))
    return torch.cat(logits).double(), toks, snap, after


def _pair_norm(k):
    h = k.shape[-1] // 2
    return torch.sqrt(k[..., :h] ** 2 + k[..., h:] ** 2).max().item()


@pytest.mark.parametrize("kind", ["growing", "bounded"])
def test_evict_equals_never_seen(models, kind):
    m64, m32 = models[torch.float64], models[torch.float32]
    A, X, B = _tokens(0, m64.config.vocab_size)
    ev, toks, _, cache_e = _run(m64, A + X + B, kind, span=(S0, E0))
    nv, toks_n, cache_n, _ = _run(m64, A + B, kind)
    tr, _, cache_t, _ = _run(m64, A + B, kind, offset=D_SPAN, forced=toks_n)
    assert toks == toks_n
    translation = (tr - nv).abs().max().item()
    err = (ev - nv).abs().max().item()
    assert 0 < translation < 1e-6
    assert err <= derived_bound(translation), f"float64 logits: {err:.2e} > 2 x translation {translation:.2e}"

    ev32, toks32, _, _ = _run(m32, A + X + B, kind, span=(S0, E0))
    nv32, toks32_n, _, _ = _run(m32, A + B, kind)
    assert toks32 == toks32_n
    arith = (nv32 - nv).abs().max().item()
    err32 = (ev32 - nv).abs().max().item()
    assert err32 <= derived_bound(translation + arith), f"float32 logits: {err32:.2e} > 2 x ({translation:.2e} + {arith:.2e})"

    # cache contents right after the eviction, against the never-seen cache
    max_pos = len(A) + len(X) + len(B)
    for i, ((ke, ve, pe), (kn, vn, pn), (kt, vt, pt)) in enumerate(zip(cache_e, cache_n, cache_t)):
        assert torch.equal(pe, pn), f"layer {i}: positions differ"
        assert torch.equal(pt[pt >= 0] - D_SPAN, pn[pn >= 0])
        inv_f = m64.model.layers[i].self_attn.inv_freq
        # entries no longer influenced by the span (or by A/X differences): prefix, or
        # at least i * (W - 1) positions past the span's end
        sel = (pn[0] < S0) | (pn[0] >= S0 + i * (W - 1))
        assert sel.sum() >= W - 1
        kt_back = rerotate(kt, torch.full_like(pt, -D_SPAN), inv_f)
        key_transl = (kt_back - kn)[:, :, sel].abs().max().item()
        bound = rerotate_error_bound(max_pos * float(inv_f.max())) * _pair_norm(kn)
        key_err = (ke - kn)[:, :, sel].abs().max().item()
        if i == 0:
            assert key_err <= bound, f"layer 0 keys: {key_err:.2e} > re-rotation bound {bound:.2e}"
        assert key_err <= derived_bound(key_transl, floor=bound), f"layer {i} keys: {key_err:.2e}"
        val_transl = (vt - vn)[:, :, sel].abs().max().item()
        val_err = (ve - vn)[:, :, sel].abs().max().item()
        # floor: 64 float64 ulps of the largest value (the runs feed different chunks)
        assert val_err <= derived_bound(val_transl, floor=64 * EPS64 * vn.abs().max().item()), f"layer {i} values"
        if kind == "bounded":
            assert bool(sel.all())  # a ring holds only span-independent entries


def test_evict_mid_span_in_growing_cache_shifts_and_rotates(models):
    """Structural: the span's slots go, later positions move down by d with keys rotated by
    -d (compared with rotating the originals directly), earlier ones are untouched."""
    m = models[torch.float64]
    cfg = m.config
    pol = AttentionPolicy.build(cfg, "window", window=W)
    cache = make_cache(cfg, pol, kind="growing", dtype=torch.float64)
    Session(m, pol, cache).prefill([list(range(1, 21))], chunk=7)
    before = [tuple(x.clone() for x in layer.view()) for layer in cache.layers]
    evict(cache, 4, 9, m)
    assert cache.next_pos.tolist() == [15]
    for i, ((k0, v0, p0), layer) in enumerate(zip(before, cache.layers)):
        k, v, p = layer.view()
        assert p.tolist() == [list(range(15))]
        keep = (p0[0] < 4) | (p0[0] >= 9)
        assert torch.equal(v, v0[:, :, keep])
        assert torch.equal(k[:, :, :4], k0[:, :, :4])
        want = rerotate(k0[:, :, 9:], torch.full((1, 11), -5), m.model.layers[i].self_attn.inv_freq)
        assert torch.equal(k[:, :, 4:], want)


def test_rerotate_error_bound_holds_for_round_trips():
    """|R(-d) R(p) k - R(p - d) k| <= rerotate_error_bound(max angle) * max pair norm,
    over positions up to 32K and head dims 16..256 (float64 keys, float32 angles)."""
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for D, theta in ((16, 1e4), (64, 1e5), (256, 1e6)):
        inv_f = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
        k = torch.randn(1, 2, 64, D, generator=g, dtype=torch.float64)
        p = torch.randint(0, 32768, (1, 64), generator=g)
        d = torch.randint(0, 32768, (1, 64), generator=g).minimum(p)
        cos, sin = rope_cos_sin(p, inv_f)
        kp = apply_rope(k, cos.double(), sin.double())
        cos, sin = rope_cos_sin(p - d, inv_f)
        direct = apply_rope(k, cos.double(), sin.double())
        moved = rerotate(kp, -d, inv_f)
        bound = rerotate_error_bound(32768 * float(inv_f.max())) * _pair_norm(k)
        err = (moved - direct).abs().max().item()
        assert err <= bound
        worst = max(worst, err / bound)
    assert worst > 1e-3  # the bound is not vacuous: actual errors are within 1000x of it


def _snapshot(cache):
    return ([tuple(x.clone() for x in (l.k, l.v, l.pos)) + ((getattr(l, "len", None)),) for l in cache.layers],
            cache.next_pos.clone())


def _same(a, b):
    (la, na), (lb, nb) = a, b
    return torch.equal(na, nb) and all(
        all(torch.equal(x, y) for x, y in zip(p[:3], q[:3])) and p[3] == q[3] for p, q in zip(la, lb))


@pytest.mark.parametrize("start, end, match", [
    (-1, 3, "start must be >= 0"),
    (3, 3, "empty"),
    (5, 2, "empty"),
    (4, 21, "outside the cache: it holds positions 0..19"),
    (30, 40, "outside the cache"),
    (1.5, 3, "start must be an integer"),
    (True, 3, "start must be an integer"),
    (0, "3", "end must be an integer"),
])
def test_evict_bad_range_raises_and_changes_nothing(models, start, end, match):
    m = models[torch.float64]
    cfg = m.config
    pol = AttentionPolicy.build(cfg, "window", window=W)
    for kind in ("growing", "bounded"):
        cache = make_cache(cfg, pol, kind=kind, dtype=torch.float64)
        Session(m, pol, cache).prefill([list(range(1, 21))], chunk=7)
        snap = _snapshot(cache)
        with pytest.raises(LongattnError, match=match) as e:
            evict(cache, start, end, m)
        assert "\n" not in str(e.value)
        assert _same(snap, _snapshot(cache))


def test_evict_bad_frequencies_and_sinks_raise_and_change_nothing(models):
    m = models[torch.float64]
    cfg = m.config
    pol = AttentionPolicy.build(cfg, "window", window=W, sinks=2)
    cache = make_cache(cfg, pol, kind="bounded", dtype=torch.float64)
    Session(m, pol, cache).prefill([list(range(1, 21))], chunk=7)
    snap = _snapshot(cache)
    with pytest.raises(LongattnError, match="inv_freq tensors for a cache of 3 layers"):
        evict(cache, 10, 12, [torch.ones(8)])
    with pytest.raises(LongattnError, match="needs the model"):
        evict(cache, 10, 12, None)
    with pytest.raises(LongattnError, match="already dropped the tokens that would become its 2 sink"):
        evict(cache, 1, 3, m)  # position 3 and 4 (new sinks) left the ring long ago
    assert _same(snap, _snapshot(cache))


def test_ring_eviction_equals_growing_eviction_on_what_the_ring_holds(models):
    """Before and after the wrap, with sinks: the ring after eviction holds exactly the
    growing cache's entries (after the same eviction) that a ring of that size keeps."""
    m = models[torch.float64]
    cfg = m.config
    pol = AttentionPolicy.build(cfg, "window", window=W, sinks=2)
    for n, span in ((7, (1, 3)), (7, (3, 5)), (20, (14, 17)), (20, (2, 6))):
        ring = make_cache(cfg, pol, kind="bounded", dtype=torch.float64)
        grow = make_cache(cfg, pol, kind="growing", dtype=torch.float64)
        for c in (ring, grow):
            Session(m, pol, c).prefill([list(range(1, n + 1))], chunk=4)
        d = span[1] - span[0]
        renumbered = [{p if p < span[0] else p - d for p in l.pos[0].tolist() if p >= 0 and not span[0] <= p < span[1]}
                      for l in ring.layers]
        for c in (ring, grow):
            evict(c, span[0], span[1], m)
        assert ring.next_pos.tolist() == grow.next_pos.tolist() == [n - d]
        for lr, lg, want in zip(ring.layers, grow.layers, renumbered):
            kg, vg, pg = lg.view()
            assert {p for p in lr.pos[0].tolist() if p >= 0} == want
            for slot, p in enumerate(lr.pos[0].tolist()):
                if p < 0:
                    continue
                assert slot == (p if p < 2 else 2 + (p - 2) % W)
                j = int((pg[0] == p).nonzero())
                # the two caches saw the prompt through different views: float64 rounding apart
                assert (lr.k[0, :, slot] - kg[0, :, j]).abs().max().item() < 1e-12
                assert (lr.v[0, :, slot] - vg[0, :, j]).abs().max().item() < 1e-12


def test_evict_without_renumber_leaves_a_gap(models):
    m = models[torch.float64]
    cfg = m.config
    pol = AttentionPolicy.build(cfg, "window", window=W)
    cache = make_cache(cfg, pol, kind="growing", dtype=torch.float64)
    Session(m, pol, cache).prefill([list(range(1, 21))], chunk=7)
    k0 = cache.layers[1].view()[0].clone()
    evict(cache, 4, 9, m, renumber=False)
    assert cache.next_pos.tolist() == [20]
    k, _, p = cache.layers[1].view()
    assert p[0].tolist() == list(range(4)) + list(range(9, 20))
    assert torch.equal(k, torch.cat((k0[:, :, :4], k0[:, :, 9:]), dim=2))


def test_evict_batched_streams_equal_each_alone(models):
    m = models[torch.float64]
    cfg = m.config
    pol = AttentionPolicy.build(cfg, "window", window=W)
    prompts = [list(range(1, 23)), list(range(40, 56))]
    both = make_cache(cfg, pol, batch=2, kind="growing", dtype=torch.float64)
    Session(m, pol, both).prefill(prompts, chunk=6)
    evict(both, 3, 8, m)
    for b, pr in enumerate(prompts):
        alone = make_cache(cfg, pol, kind="growing", dtype=torch.float64)
        Session(m, pol, alone).prefill([pr], chunk=6)
        evict(alone, 3, 8, m)
        assert both.next_pos[b] == alone.next_pos[0]
        for lb, la in zip(both.layers, alone.layers):
            kb, vb, pb = lb.view()
            ka, va, pa = la.view()
            n = pa.shape[1]
            assert torch.equal(pb[b, :n], pa[0]) and bool((pb[b, n:] < 0).all())
            assert (kb[b, :, :n] - ka[0]).abs().max().item() < 1e-12
            assert (vb[b, :, :n] - va[0]).abs().max().item() < 1e-12


# ---------------------------------------------------------------- trim_to_window

@pytest.mark.parametrize("family, sinks, slack", [("llama", 0, 0), ("llama", 2, 3), ("gemma3", 0, 1)])
def test_trimmed_decode_equals_windowed_decode_over_full_cache(family, sinks, slack):
    """Teacher-forced 200 steps: trimming after every step keeps argmax identical to the
    untrimmed windowed run, and windowed layers never hold more than W + S + slack slots."""
    m = tiny_model(family)
    cfg = m.config
    if family == "gemma3":
        pol = AttentionPolicy.build(cfg, "checkpoint", sinks=sinks)  # 8 local, global layers grow
    else:
        pol = AttentionPolicy.build(cfg, "window", window=7, sinks=sinks)
    ids = torch.randint(0, cfg.vocab_size, (230,), generator=torch.Generator().manual_seed(7))
    full = make_cache(cfg, pol, kind="growing")
    trim = make_cache(cfg, pol, kind="growing")
    sf, st = Session(m, pol, full), Session(m, pol, trim)
    lf, lt = sf.prefill([ids[:30].tolist()], chunk=8), st.prefill([ids[:30].tolist()], chunk=8)
    trim_to_window(trim, pol, slack)
    cap = max(w for w in pol.windows if w) + sinks + slack
    worst = 0.0
    for t in range(30, 230):
        assert torch.equal(lf.argmax(-1), lt.argmax(-1)), f"step {t}"
        worst = max(worst, (lf - lt).abs().max().item())
        lf, lt = sf.step(ids[t:t + 1]), st.step(ids[t:t + 1])
        trim_to_window(trim, pol, slack)
        for i, (layer, lp) in enumerate(zip(trim.layers, pol.layers)):
            if lp.window:
                assert layer.tokens() <= cap
                held = set(layer.positions()[0].tolist())
                assert held == set(range(min(sinks, t + 1))) | set(range(t + 1 - lp.window - slack, t + 1))
            else:
                assert layer.tokens() == t + 1
    assert worst < 1e-4  # float32, summation order only
    assert full.tokens() == [230] * cfg.num_layers


def test_trim_bad_settings_raise():
    m = tiny_model("llama")
    cfg = m.config
    cache = make_cache(cfg, AttentionPolicy.build(cfg, "window", window=4), kind="growing")
    with pytest.raises(LongattnError, match="slack"):
        trim_to_window(cache, AttentionPolicy.build(cfg, "window", window=4), -1)
    g = tiny_model("gemma3").config
    with pytest.raises(LongattnError, match="policy has 6 layers; the cache has 3"):
        trim_to_window(cache, AttentionPolicy.from_config(g))
