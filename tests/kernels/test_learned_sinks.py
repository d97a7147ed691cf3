"""Learned per-head sink logits (gpt-oss) on every attention kernel: the fused C++ decode kernel,
the small-query matmuls, the masked flash path, the causal kernel, banded prefill, the static
step's three buffer reads (SCSA's paths: tests/sparse/test_sparse_learned_sinks.py).

Each is compared with ``reference_attention`` in float64 under the same mask and sinks, within
twice the float32 reference's own error (tests/tolerance.py), plus the exp polynomial's 2 ulp
where a C++ kernel computes the weights. The sinks are drawn around the rows' own log-mass, so
they take a visible share of every softmax (a path that dropped them would be off by O(1))."""

import pytest
import torch

from longattn.ops import native
from longattn.ops.attention import attend, attend_buffer_and_new
from longattn.ops.banded import banded_attention
from longattn.ops.masks import allowed_mask
from longattn.ops.reference import reference_attention
from tolerance import assert_within_derived, max_err, ulps

H, HKV, D = 8, 2, 32
SCALE = D ** -0.5


def _case(B, Tq, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=g)
    k = torch.randn(B, HKV, S, D, generator=g)
    v = torch.randn(B, HKV, S, D, generator=g)
    sinks = torch.randn(H, generator=g) * 2 + 2.0  # near log(S / e^0.5): a share of every row
    return q, k, v, sinks


def _refs(q, k, v, q_pos, k_pos, window, n_sinks, sinks):
    """(float64 reference, float32 reference) under the allowed mask with learned sinks."""
    mask = allowed_mask(q_pos, k_pos, window, n_sinks)
    ref = reference_attention(q.double(), k.double(), v.double(), mask, SCALE, None, sinks.double())
    plain = reference_attention(q, k, v, mask, SCALE, None, sinks)
    return ref, plain


def _without_sinks_differs(out, q, k, v, q_pos, k_pos, window, n_sinks):
    mask = allowed_mask(q_pos, k_pos, window, n_sinks)
    assert max_err(out, reference_attention(q, k, v, mask, SCALE)) > 1e-2  # the sinks matter here


@pytest.mark.parametrize("window,n_sinks", [(None, 0), (64, 4)])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "matmul"])
def test_decode_step_with_learned_sinks(window, n_sinks, fused):
    B, S = 3, 300
    q, k, v, sinks = _case(B, 1, S)
    k_pos = torch.arange(S).expand(B, S).clone()
    k_pos[2, 250:] = -1  # a shorter stream: empty slots are never read
    q_pos = torch.tensor([[S - 1], [-1], [249]])  # stream 1 is padding: zeros out
    ref, plain = _refs(q, k, v, q_pos, k_pos, window, n_sinks, sinks)
    out = attend(q, q_pos, k, v, k_pos, window, n_sinks, SCALE, fused=fused, sink_logits=sinks)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_within_derived(out, plain, ref, floor=ulps(2, v.abs().max().item()))
    _without_sinks_differs(out, q, k, v, q_pos, k_pos, window, n_sinks)


@pytest.mark.parametrize("window,n_sinks,banded", [(None, 0, None), (64, 4, None), (64, 4, 32), (48, 0, 32)])
def test_prefill_with_learned_sinks(window, n_sinks, banded):
    """One-shot prefill (causal kernel when unwindowed, masked flash or banded when windowed)
    and a chunk over a longer cache."""
    S = 300
    q, k, v, sinks = _case(1, S, S, seed=1)
    pos = torch.arange(S)[None]
    for tq in (S, 40):
        qc, qp = q[:, :, S - tq:], pos[:, S - tq:]
        ref, plain = _refs(qc, k, v, qp, pos, window, n_sinks, sinks)
        out = attend(qc, qp, k, v, pos, window, n_sinks, SCALE, banded_min_tokens=banded, sink_logits=sinks)
        assert_within_derived(out, plain, ref)
        _without_sinks_differs(out, qc, k, v, qp, pos, window, n_sinks)


def test_banded_blocks_with_learned_sinks():
    """banded_attention itself (block sizes that cut the band at odd places)."""
    S = 257
    q, k, v, sinks = _case(1, S, S, seed=2)
    pos = torch.arange(S)[None]
    ref, plain = _refs(q, k, v, pos, pos, 40, 3, sinks)
    for block in (32, 7, 256):
        out = banded_attention(q, k, v, 40, 3, SCALE, block_size=block, sink_logits=sinks)
        assert_within_derived(out, plain, ref, what=f"block {block}")


@pytest.mark.parametrize("kernel", ["fused", "matmul", "flash"])
@pytest.mark.parametrize("window,n_sinks", [(None, 0), (64, 4)])
def test_static_step_with_learned_sinks(kernel, window, n_sinks):
    """The static step's read: a buffer plus the step's own key, in one softmax with the sink."""
    if kernel == "fused" and not native.available():
        pytest.skip("needs the AVX2 kernels (x86)")
    B, S = 2, 200
    q, k, v, sinks = _case(B, 1, S + 1, seed=3)
    k_pos = torch.arange(S + 1).expand(B, S + 1).clone()
    q_pos = torch.tensor([[S], [-1]])
    ref, plain = _refs(q, k, v, q_pos, k_pos, window, n_sinks, sinks)
    out = attend_buffer_and_new(q, q_pos, k[:, :, :S], v[:, :, :S], k_pos[:, :S], k[:, :, S:], v[:, :, S:],
                                window, n_sinks, SCALE, None, kernel, sinks)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_within_derived(out, plain, ref, floor=ulps(2, v.abs().max().item()))
