"""The paged KV cache: equal to the growing (masked dense) reference at every step, bounded on
windowed layers (blocks freed as they leave the window, sink blocks kept), several streams
batched == each alone, and prefix truncation only where the held blocks allow it.

Dense policies: the paged view is laid out like the growing cache's, so in float64 (where both
gather the view and run the same matmuls) the logits are torch.equal; in float32 a paged
prefill chunk runs its queries as rows of the fused decode kernel (so a position gets the same
bits prefilled or decoded), which agrees with the growing cache's prefill to float32
rounding. Windowed policies: the paged view holds fewer keys than
the growing cache's (freed blocks), so attention sums the same terms over a shorter row; that
is checked in float64 to 1e-10, as the ring cache is (tests/cache/test_cache_ring.py: any wrong or
missing key moves the output by O(1e-2) or more).
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from longattn.cache import make_cache
from longattn.ops import native
from longattn.cache.paged import BlockPool, PagedKVCache, PagedStream, PoolExhausted, blocks_bound
from longattn.policy import AttentionPolicy
from longattn.engine.session import Session

TOL = 1e-10


def _run(m, pol, ids, cache_of, prompt=20, chunk=6):
    """Prefill ``prompt`` tokens in chunks, then step one token at a time: all logits [T, V]."""
    s = Session(m, pol, cache_of())
    outs = [s.prefill([ids[:prompt].tolist()], chunk=chunk, logits="all")[0]]
    for t in range(prompt, len(ids)):
        outs.append(s.step(ids[t:t + 1]))
    return torch.cat(outs)


def _paged(m, pol, pool):
    st = PagedStream.for_policy(pol)
    return st, (lambda: PagedKVCache(m.config, pool, [st]))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_paged_dense_equals_growing_bit_for_bit(family):
    m = tiny_model(family, dtype=torch.float64)
    cfg = m.config
    pol = AttentionPolicy.build(cfg, "dense")
    ids = torch.randint(0, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(1))
    pool = BlockPool(200, 4, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float64)
    st, paged = _paged(m, pol, pool)
    got = _run(m, pol, ids, paged)
    ref = _run(m, pol, ids, lambda: make_cache(cfg, pol, kind="growing", dtype=torch.float64))
    assert torch.equal(got, ref)
    assert st.blocks() == cfg.num_layers * -(-70 // 4)  # global layers keep every block


@pytest.mark.parametrize("family,mode", [("llama", "window"), ("gemma3", "checkpoint"), ("gemma3", "window")])
def test_paged_windowed_equals_masked_reference_and_stays_bounded(family, mode):
    m = tiny_model(family, dtype=torch.float64)
    cfg = m.config
    pol = AttentionPolicy.build(cfg, mode, window=7 if mode == "window" else None, sinks=2)
    ids = torch.randint(0, cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(2))
    bs = 4
    pool = BlockPool(400, bs, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float64)
    st, paged = _paged(m, pol, pool)
    s = Session(m, pol, paged())
    ref = Session(m, pol, make_cache(cfg, pol, kind="growing", dtype=torch.float64))
    ring = Session(m, pol, make_cache(cfg, pol, kind="auto", dtype=torch.float64))
    pr = ids[:20].tolist()
    a, b, c = (x.prefill([pr], chunk=6, logits="all") for x in (s, ref, ring))
    assert (a - b).abs().max().item() < TOL and (a - c).abs().max().item() < TOL
    peak = 0
    for t in range(20, len(ids)):
        s.cache = paged()  # a new view per step, as the engine builds one
        a, b, c = s.step(ids[t:t + 1]), ref.step(ids[t:t + 1]), ring.step(ids[t:t + 1])
        assert (a - b).abs().max().item() < TOL and (a - c).abs().max().item() < TOL, t
        peak = max(peak, st.blocks())
        for layer, lp in enumerate(pol.layers):
            held = st.tables[layer]
            if lp.window is None:
                assert len(held) == -(-(t + 1) // bs)
                continue
            # every held block is a sink block or still meets the next query's window
            lo = t + 1 - lp.window + 1
            assert all(j * bs < lp.sinks or (j + 1) * bs > lo for j in held)
            assert len(held) <= blocks_bound(lp.window, lp.sinks, t + 1, 6, bs)
    if all(lp.window for lp in pol.layers):
        assert peak < cfg.num_layers * -(-90 // bs) // 3  # bounded, far below what 90 tokens fill
    assert pool.used == st.blocks()
    st.release(pool)
    assert pool.free == pool.num_blocks


def test_paged_batched_streams_equal_each_alone():
    m = tiny_model("llama", dtype=torch.float64)
    cfg = m.config
    pol = AttentionPolicy.build(cfg, "window", window=5, sinks=1)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (17, 6, 11)]
    nxt = torch.randint(0, cfg.vocab_size, (3, 10), generator=g)
    pool = BlockPool(300, 4, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float64)
    streams = [PagedStream.for_policy(pol) for _ in prompts]
    for st, p in zip(streams, prompts):  # each prefilled on its own, as the engine does
        Session(m, pol, PagedKVCache(cfg, pool, [st])).prefill([p], chunk=4)
    both = [Session(m, pol, PagedKVCache(cfg, pool, streams)).step(nxt[:, t]) for t in range(10)]
    for b in range(3):
        alone = m(torch.tensor([prompts[b] + nxt[b].tolist()]), policy=pol)[0, len(prompts[b]):]  # [10, V]
        got = torch.stack([x[b] for x in both])
        assert (got - alone).abs().max().item() < TOL


def test_truncate_only_where_held_blocks_cover_the_window():
    m = tiny_model("llama", dtype=torch.float64)
    cfg = m.config
    pol = AttentionPolicy.build(cfg, "window", window=6, sinks=2)
    pool = BlockPool(200, 4, cfg.num_kv_heads, cfg.head_dim, dtype=torch.float64)
    st, paged = _paged(m, pol, pool)
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(4))
    Session(m, pol, paged()).prefill([ids.tolist()], chunk=8)
    assert not st.truncate(10, pool)  # positions 5..9 left the window long ago
    assert st.next_pos == 40
    assert st.truncate(38, pool)  # 33..37 are still held
    # continuing from 38 equals never having gone past it
    cont = Session(m, pol, paged()).prefill([ids[38:].tolist()], chunk=8, logits="all")
    ref = m(ids[None], policy=pol)[:, 38:]
    assert (cont - ref).abs().max().item() < TOL


def test_pool_exhaustion_is_an_error_not_a_crash():
    pool = BlockPool(2, 4, 1, 8)
    pool.alloc(), pool.alloc()
    with pytest.raises(PoolExhausted):
        pool.alloc()


@pytest.mark.skipif(not native.available(), reason="needs the AVX2 kernels (x86)")
def test_decode_reads_the_pool_in_place_bit_for_bit():
    """A decode step's view is the pool and block tables (PagedRows), read in place by the
    fused kernel: equal, bit for bit, to the same kernel over the gathered copy, with windows
    that freed blocks (gaps in the tables), sink blocks kept, and streams of other lengths."""
    from longattn.ops.attention import PagedRows, attend
    m = tiny_model("llama")
    cfg = m.config
    pol = AttentionPolicy.build(cfg, "window", window=9, sinks=2)
    pool = BlockPool(300, 4, cfg.num_kv_heads, cfg.head_dim)
    streams = [PagedStream.for_policy(pol) for _ in range(3)]
    g = torch.Generator().manual_seed(5)
    for st, n in zip(streams, (30, 17, 41)):  # prefill each alone, then decode them together
        Session(m, pol, PagedKVCache(cfg, pool, [st])).prefill([torch.randint(0, 96, (n,), generator=g).tolist()],
                                                             chunk=5)
    cache = PagedKVCache(cfg, pool, streams)
    H, D = cfg.num_heads, cfg.head_dim
    for step in range(6):
        pos = cache.next_pos.view(-1, 1).clone()
        k_new = torch.randn(3, cfg.num_kv_heads, 1, D, generator=g)
        q = torch.randn(3, H, 1, D, generator=g)
        for layer in cache.layers:
            k, v, k_pos = layer.update(k_new, k_new, pos)
            assert isinstance(k, PagedRows) and isinstance(v, PagedRows)
            in_place = attend(q, pos, k, v, k_pos, 9, 2, D ** -0.5)
            gathered = attend(q, pos, k.gather(), v.gather(), k_pos, 9, 2, D ** -0.5)
            assert torch.equal(in_place, gathered)
        cache.advance(pos)
    assert any(sorted(st.tables[0]) != list(range(len(st.tables[0]))) for st in streams)  # gaps were read
