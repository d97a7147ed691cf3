"""Streaming a long token sequence in bounded memory, and scoring it exactly."""

import os

import pytest
import torch

from conftest import tiny_model
from longattn.cache import KVCache
from longattn.cache.factory import make_cache
from longattn.policy import AttentionPolicy
from longattn.lab.stream import nll_bits, stream_score
from tolerance import TIE_FLOOR, derived_bound


def _ids(n, seed=0, vocab=96):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("window,sinks,chunk", [(8, 0, 5), (8, 4, 16), (16, 2, 64), (None, 0, 7)])
def test_stream_bits_equal_full_forward_with_same_mask(window, sinks, chunk):
    """The stream through a ring cache scores every position 1..N-1 exactly as one full
    forward under the same window/sink mask (tolerance: 2x the full forward's float32 error
    against float64, as the mean absolute per-position error in bits)."""
    m = tiny_model("llama")
    m64 = tiny_model("llama", dtype=torch.float64)
    pol = AttentionPolicy.build(m.config, "window", window=window, sinks=sinks) if window else \
        AttentionPolicy.build(m.config, "dense")
    ids = _ids(150)
    res = stream_score(m, ids, pol, make_cache(m.config, pol, kind="auto"), chunk=chunk)
    full_pos = nll_bits(m(ids[None], policy=pol)[0, :-1], ids[1:])
    ref_pos = nll_bits(m64(ids[None], policy=pol)[0, :-1], ids[1:])
    full, ref = full_pos.mean().item(), ref_pos.mean().item()
    assert res.scored == 149
    # |mean(stream) - mean(ref)| <= mean |per-position error|; allow 2x the full forward's.
    tol = derived_bound((full_pos - ref_pos).abs().mean().item(), floor=TIE_FLOOR)
    assert abs(res.bits_per_token - ref) <= tol, (res.bits_per_token, full, ref)
    if window:
        assert res.max_cache_tokens <= window + sinks + chunk  # ring + one chunk in flight at most


def test_stream_long_bounded_memory():
    """128K tokens (LONGATTN_STREAM_TOKENS raises it, e.g. to 1,000,000) through a tiny model:
    the cache never grows past its bound and its bytes are the same at every chunk."""
    n = int(os.environ.get("LONGATTN_STREAM_TOKENS", 131072))
    m = tiny_model("llama", num_hidden_layers=2)
    W, S, chunk = 64, 4, 512
    pol = AttentionPolicy.build(m.config, "window", window=W, sinks=S)
    cache = make_cache(m.config, pol, kind="bounded")
    sizes = set()

    def on_chunk(_, res):
        sizes.add(cache.nbytes())
        assert max(cache.tokens()) <= W + S
    ids = torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(0))
    res = stream_score(m, ids, pol, cache, chunk=chunk, on_chunk=on_chunk)
    assert res.tokens == n and res.scored == n - 1
    assert len(sizes) == 1, sizes
    assert torch.isfinite(torch.tensor(res.bits_per_token))
    print(f"streamed {n} tokens: {res.bits_per_token:.3f} bits/token, {n / res.seconds:.0f} tok/s, "
          f"cache {res.cache_bytes} B, peak RSS {res.peak_rss_bytes / 2**20:.0f} MiB")


def test_stream_growing_cache_grows():
    m = tiny_model("llama")
    pol = AttentionPolicy.build(m.config, "dense")
    cache = KVCache(m.config, 1)
    stream_score(m, _ids(300), pol, cache, chunk=100)
    assert cache.tokens() == [300] * m.config.num_layers


def test_streams_through_bfloat16_and_int8_caches_hold_their_formats_bytes():
    from longattn.cache.kv_format import row_bytes
    m = tiny_model("llama")
    pol = AttentionPolicy.build(m.config, "window", window=8, sinks=2)
    ids = _ids(120, seed=3)
    res = {dt: stream_score(m, ids, pol, make_cache(m.config, pol, kind="auto", dtype=dt), chunk=16)
           for dt in (torch.float32, torch.bfloat16, torch.int8)}
    D = m.config.head_dim
    for dt in (torch.bfloat16, torch.int8):
        assert res[dt].max_cache_bytes * 4 * D == res[torch.float32].max_cache_bytes * row_bytes(dt, D)
        assert torch.isfinite(torch.tensor(res[dt].bits_per_token))