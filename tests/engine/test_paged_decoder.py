"""`generate`'s default decode (engine/paged_step.py, PagedDecoder): eager prefill loaded into a
paged pool, then the server's compiled step. It agrees with float64 within the derived tolerance
on dense, windowed (ring caches loaded) and hybrid policies, batched streams with one inactive,
and a window it has never used loads the package it already has.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_formats
from longattn.engine.paged_step import PagedDecoder, paged_key
from longattn.engine.session import Session
from longattn.ops import native
from longattn.policy import AttentionPolicy
from tolerance import LOGIT_FLOOR, assert_within_derived

pytestmark = pytest.mark.skipif(not native.available(), reason="the compiled step calls the native kernels")


def _teacher_forced(session, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits ``[B, T - prefill + 1, V]``: after the prefill, then after each later token fed."""
    outs = [session.prefill(ids[:, :prefill].tolist())[:, 0]]
    for t in range(prefill, ids.shape[1]):
        outs.append(session.step(ids[:, t]))
    return torch.stack(outs, dim=1)


@pytest.mark.parametrize("family,weights", [("llama", "int8"), ("llama", "f32"), ("gemma2", "int4")])
@pytest.mark.parametrize("policy", ["checkpoint", "window"])
def test_paged_decoder_is_within_the_derived_tolerance_of_float64(family, weights, policy):
    torch.set_num_threads(2)
    model, ref = tiny_formats(family, weights)
    cfg = model.config
    pol = AttentionPolicy.build(cfg, "window", window=6, sinks=2) if policy == "window" else \
        AttentionPolicy.from_config(cfg)
    ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(5))
    fast = _teacher_forced(PagedDecoder(model, pol, batch=2, max_len=64, progress=False), ids, 24)
    plain = _teacher_forced(Session(model, pol, batch=2), ids, 24)
    with torch.no_grad():
        want = ref(ids, policy=pol)[:, 23:]
    assert_within_derived(fast, plain, want, LOGIT_FLOOR, "paged decoder")


def test_an_inactive_stream_keeps_its_place_and_a_new_window_needs_no_build():
    torch.set_num_threads(2)
    model, _ = tiny_formats("llama", "int8")
    cfg = model.config
    ids = torch.randint(3, 96, (2, 30), generator=torch.Generator().manual_seed(1))
    dec = PagedDecoder(model, batch=2, max_len=64, progress=False)
    dec.prefill(ids[:, :20].tolist())
    full = PagedDecoder(model, batch=2, max_len=64, progress=False)  # both streams always active
    full.prefill(ids[:, :20].tolist())
    for t in range(20, 30):
        some = dec.step(ids[:, t], active=torch.tensor([True, t % 2 == 0]))
        assert torch.equal(some[0], full.step(ids[:, t])[0])  # a row's bits do not depend on the others
    assert dec.streams[1].next_pos == 25 and dec.streams[0].next_pos == 30
    window = AttentionPolicy.build(cfg, "window", window=7, sinks=3)
    assert paged_key(model, window, 16, torch.float32) == dec.paged.key


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("chunk", [64, 7])
def test_prefill_into_a_float32_pool_is_the_dense_prefill_bit_for_bit(family, chunk):
    """The prompt goes straight into the pool; with f32 keys every chunk's attention reads the
    very tensors a growing cache holds, so the logits are the dense prefill's, at every position
    (global layers; Gemma 2's local layers read their window from the pool)."""
    torch.set_num_threads(2)
    model, _ = tiny_formats(family, "int8")
    pol = AttentionPolicy.from_config(model.config)
    ids = torch.randint(3, 96, (2, 50), generator=torch.Generator().manual_seed(11)).tolist()
    ids[1] = ids[1][:37]  # rows of different lengths pad
    dec = PagedDecoder(model, pol, batch=2, max_len=64, progress=False)
    got = dec.prefill(ids, chunk=chunk, logits="all")
    want = Session(model, pol, batch=2).prefill(ids, chunk=chunk, logits="all")
    if family == "llama":
        assert torch.equal(got, want)
    else:  # windowed layers: the pool holds the window, the ring its own slots: other reduction orders
        assert (got - want).abs().max() < 1e-3
    assert [st.next_pos for st in dec.streams] == [50, 37]


def test_an_int8_pool_holds_a_quarter_of_the_float32_bytes_and_decodes_row_independently():
    torch.set_num_threads(2)
    model, _ = tiny_formats("llama", "int4")
    ids = torch.randint(3, 96, (2, 30), generator=torch.Generator().manual_seed(2))
    decs = {kv: PagedDecoder(model, batch=2, max_len=64, kv_dtype=dt, progress=False)
            for kv, dt in (("f32", torch.float32), ("int8", torch.int8))}
    for d in decs.values():
        d.prefill(ids[:, :20].tolist())
    D = model.config.head_dim
    assert decs["int8"].cache.nbytes() * 4 * D == decs["f32"].cache.nbytes() * (D + 4 * -(-D // 32))
    dec = decs["int8"]
    alone = PagedDecoder(model, batch=2, max_len=64, kv_dtype=torch.int8, progress=False)
    alone.prefill(ids[:, :20].tolist())
    for t in range(20, 30):
        some = dec.step(ids[:, t], active=torch.tensor([True, t % 3 == 0]))
        assert torch.equal(some[0], alone.step(ids[:, t], active=torch.tensor([True, False]))[0])


def test_a_sparse_policy_decodes_with_scsa_inside_the_compiled_step():
    """``generate --policy sparse --compile aot``: the prefill seals the prompt's blocks into the
    stream's index, and the compiled step's sparse op reads through its clusters from then on."""
    from longattn.sparse import SCSAConfig
    from longattn.sparse.policy import build_sparse_policy, stream_layers
    torch.set_num_threads(2)
    model, _ = tiny_formats("llama", "int8")
    pol = build_sparse_policy(model.config, SCSAConfig(cluster_size=16, rebuild_interval=32, block_size=128, sink=4,
                                                       recent=8, min_context=0, calib_steps=0,
                                                       dense_when_cheaper=False))
    ids = torch.randint(3, 96, (1, 330), generator=torch.Generator().manual_seed(2))
    dec = PagedDecoder(model, pol, batch=1, max_len=400, progress=False)
    dec.prefill(ids[:, :300].tolist())
    layers = stream_layers(dec.cache)
    assert sorted(layers) == [0, 1, 2] and all(sc.indexes[0].seal_end > 4 for sc in layers.values())
    for t in range(300, 330):
        assert torch.isfinite(dec.step(ids[:, t])).all()
    assert all(sc.counters["opened_rows"] > 0 and sc.counters["calls"] == 30 for sc in layers.values())
