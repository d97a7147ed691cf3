"""Eager decode steps read the cache through the fused C++ kernel (WindowOp, fused_decode=True):
same answer as the matmul form and as float64 attention under ``allowed_mask``, on the layouts
the eager caches hand it -- a growing cache's strided view (capacity > length), ring buffers
with positions out of order, empty slots, padding streams -- and bit-identical between an unset
window and one wider than the context.

Tolerance, derived as for the kernel's own tests: twice the plain float32 (matmul form) error
against float64, plus the exp polynomial's 2 ulp on a convex combination of values."""

import pytest
import torch

from longattn.cache.base import KVView
from longattn.ops import native
from longattn.ops.masks import allowed_mask
from longattn.ops.reference import reference_attention
from longattn.policy import AttentionPolicy, WindowOp
from longattn.engine.session import Session
from conftest import tiny_model
from tolerance import assert_within_derived, ulps

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the AVX2 kernels (x86)")


def case(B, H, Hkv, N, cap, D, seed, ring=False, empty=0.0):
    """q [B, H, 1, D]; k, v as views [B, Hkv, N, D] of buffers with ``cap`` slots; positions."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, 1, D, generator=g) * 2
    kb, vb = (torch.randn(B, Hkv, cap, D, generator=g) * 2 for _ in range(2))
    k, v = kb[:, :, :N], vb[:, :, :N]
    k_pos = torch.stack([torch.randperm(N, generator=g) if ring else torch.arange(N) for _ in range(B)])
    k_pos[torch.rand(B, N, generator=g) < empty] = -1
    q_pos = torch.full((B, 1), N - 1)  # the newest key is the query's own (already in the cache)
    return q, k, v, k_pos, q_pos


def check(q, k, v, k_pos, q_pos, window, sinks):
    scale = q.shape[-1] ** -0.5
    fused = WindowOp(window, sinks)(q, q_pos, KVView(k, v, k_pos, k, v), scale)
    plain = WindowOp(window, sinks, fused_decode=False)(q, q_pos, KVView(k, v, k_pos, k, v), scale)
    mask = allowed_mask(q_pos, k_pos, window, sinks)
    ref = reference_attention(q.double(), k.double(), v.double(), mask, scale)
    assert_within_derived(fused, plain, ref, floor=ulps(2, v.abs().max().item()))  # exp polynomial
    return fused


@pytest.mark.parametrize("B,H,Hkv,N,cap,D", [(1, 14, 2, 700, 1024, 64), (2, 4, 1, 300, 301, 256),
                                             (3, 6, 3, 50, 80, 24)])
@pytest.mark.parametrize("window,sinks", [(None, 0), (64, 0), (32, 4)])
@pytest.mark.parametrize("ring", [False, True])
def test_fused_decode_matches_matmul_form_and_float64(B, H, Hkv, N, cap, D, window, sinks, ring):
    for seed in range(2):
        check(*case(B, H, Hkv, N, cap, D, seed, ring=ring, empty=0.1 if ring else 0.0), window, sinks)


def test_padding_stream_outputs_zeros():
    q, k, v, k_pos, q_pos = case(2, 4, 2, 90, 128, 32, 3)
    q_pos[1] = -1
    out = check(q, k, v, k_pos, q_pos, 16, 2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_unset_window_equals_a_window_wider_than_the_context():
    q, k, v, k_pos, q_pos = case(2, 6, 2, 400, 512, 64, 4)
    a = WindowOp(None)(q, q_pos, KVView(k, v, k_pos, k, v), 0.125)
    b = WindowOp(10_000)(q, q_pos, KVView(k, v, k_pos, k, v), 0.125)
    assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_session_decode_fused_vs_matmul_vs_float64(kind):
    """A tiny model decoding 12 teacher-forced steps for a batch of two prompts (one shorter, so
    padded): the fused read's logits are within twice the matmul read's float32 error against
    the same model in float64 (which reads by matmul: the kernel is float32 only), plus 4 ulp
    of the largest logit."""
    prompts = [list(range(3, 30)), list(range(5, 17))]
    forced = torch.randint(3, 60, (12, 2), generator=torch.Generator().manual_seed(1))
    outs = {}
    for name, dtype, fused in (("fused", torch.float32, True), ("matmul", torch.float32, False),
                               ("f64", torch.float64, False)):
        m = tiny_model(kind, dtype=dtype)
        s = Session(m, AttentionPolicy.from_config(m.config, fused_decode=fused), batch=2)
        s.prefill(prompts)
        outs[name] = torch.stack([s.step(tok) for tok in forced]).double()
    ref = outs["f64"]
    assert_within_derived(outs["fused"], outs["matmul"], ref, floor=ulps(4, ref.abs().max().item()))
