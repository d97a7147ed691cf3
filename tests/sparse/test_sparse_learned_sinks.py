"""SCSA with learned per-head sink logits (gpt-oss): the sink is one more exact term with a zero
value row, in the output's normaliser and in the stop rule's exact mass. The native, PyTorch and
serial float64 paths make the same selection and agree within the derived bound; the exact call
(below min_context, calibrating) includes the sinks as the reference does."""

import pytest
import torch

from longattn.ops import native
from longattn.ops.reference import reference_attention
from longattn.sparse import SCSALayer
from sparse_fixtures import attn_case, small_cfg
from tolerance import assert_within_derived, ulps


def _scsa_case():
    qs, k, v, scale = attn_case(700, 14, 2, 64, seed=0, queries=2, query_seed=1, centers=12)
    return qs, k, v, scale


def _scsa_layers(tau):
    return [SCSALayer(small_cfg(tau_default=tau, cluster_size=24, native=n, serial=s), 14, 2, 64)
            for n, s in ((True, False), (False, False), (False, True))]


def _log_mass(q, k, scale):
    """Each query head's log of its keys' softmax mass ``[H]``."""
    kr = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    return ((q @ kr.transpose(-1, -2)) * scale).logsumexp(-1).flatten()


@pytest.mark.skipif(not native.available(), reason="needs the AVX2 kernels (x86)")
@pytest.mark.parametrize("tau", [0.0, 0.1])
def test_scsa_paths_agree_with_learned_sinks(tau):
    """Native, PyTorch and serial float64 SCSA make the same selection with learned sinks and
    their outputs agree within the derived bound (the serial path is the reference)."""
    qs, k, v, scale = _scsa_case()
    for q in qs:
        sinks = _log_mass(q, k, scale) + torch.linspace(-2, 2, 14)
        outs, opened = [], []
        for layer in _scsa_layers(tau):
            outs.append(layer.attend(q, k, v, scale, sinks))
            opened.append(layer._last[-1][1].opened)
        assert torch.equal(opened[0], opened[1]) and torch.equal(opened[0], opened[2])
        assert_within_derived(outs[0], outs[1], outs[2], floor=ulps(2, v.abs().max().item()))


@pytest.mark.skipif(not native.available(), reason="needs the AVX2 kernels (x86)")
def test_scsa_learned_sinks_join_the_exact_mass():
    """A sink holding most of a row's mass counts as captured exact mass in the stop rule: the
    same threshold opens fewer clusters than without it, on every path alike."""
    qs, k, v, scale = _scsa_case()
    q = qs[0]
    sinks = _log_mass(q, k, scale) + 2.0
    fewer = []
    for with_sinks, without in zip(_scsa_layers(0.1), _scsa_layers(0.1)):
        with_sinks.attend(q, k, v, scale, sinks)
        without.attend(q, k, v, scale)
        a, b = with_sinks._last[-1][1].opened, without._last[-1][1].opened
        assert not (a & ~b).any()  # never opens a cluster the sinkless call left closed
        fewer.append(int(a.sum()) < int(b.sum()))
    assert all(fewer)


def test_scsa_exact_call_with_learned_sinks():
    """Below min_context (and while calibrating) SCSA attends exactly: sinks included."""
    qs, k, v, scale = _scsa_case()
    q = qs[0]
    sinks = _log_mass(q, k, scale)
    layer = SCSALayer(small_cfg(min_context=10_000), 14, 2, 64)
    out = layer.attend(q, k, v, scale, sinks)
    mask = torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool)
    ref = reference_attention(q.double(), k.double(), v.double(), mask, scale, None, sinks.double())
    plain = reference_attention(q, k, v, mask, scale, None, sinks)
    assert_within_derived(out, plain, ref)
