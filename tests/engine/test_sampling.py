"""Sampling: greedy, temperature, top-k, top-p, seeds, stop tokens, streamed callbacks."""

import pytest
import torch

from conftest import tiny_model
from longattn.errors import LongattnError
from longattn.engine.sampling import GREEDY_CHUNK, SamplingConfig, greedy, sample
from longattn.engine.session import Session, generate


def test_greedy_is_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, SamplingConfig(0.0)), logits.argmax(-1))


@pytest.mark.parametrize("V", [262144, 151936, 49152, 16 * GREEDY_CHUNK + 7, 300])
def test_chunked_greedy_equals_argmax_with_ties_and_nan(V):
    """The chunked argmax returns argmax's index exactly: random rows, a maximum repeated in
    several chunks and in the tail (the first wins), a row whose maximum is in the tail, a NaN."""
    g = torch.Generator().manual_seed(V)
    x = torch.randn(5, V, generator=g)
    x[1, [V - 1, V // 2, 3]] = 50.0  # ties across chunks: index 3 wins
    x[2, V - 1] = 60.0  # the maximum sits in the tail past the last whole chunk
    x[3, [V // 3, V - 2]] = float("nan")
    x[4] = x[4].round()  # many ties everywhere
    assert torch.equal(greedy(x), x.argmax(-1))
    assert torch.equal(greedy(x[:1]), x[:1].argmax(-1))


def test_top_k_only_picks_top_k():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(1))
    top = set(torch.topk(logits[0], 5).indices.tolist())
    g = torch.Generator().manual_seed(0)
    picks = {int(sample(logits, SamplingConfig(1.0, top_k=5), g)) for _ in range(300)}
    assert picks <= top and len(picks) > 1


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    g = torch.Generator().manual_seed(0)
    picks = {int(sample(probs.log(), SamplingConfig(1.0, top_p=0.7), g)) for _ in range(300)}
    assert picks == {0, 1}  # 0.5 < 0.7 needs the second; 0.8 >= 0.7 stops there


@pytest.mark.parametrize("temperature,top_p", [(1e-300, 1.0), (1e-45, 1.0), (1.0, 1e-300), (1e-300, 1e-300)])
def test_extreme_temperature_and_top_p_pick_the_best_token(temperature, top_p):
    """A vanishing temperature or nucleus is a near-greedy choice, not a NaN that fails
    the step (a served request's sampling must not break the batch it runs in)."""
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(2)) * 30
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample(logits, SamplingConfig(temperature, top_p=top_p), g), logits.argmax(-1))


def test_seed_reproducible_and_stop_tokens():
    m = tiny_model("llama")
    cfg = SamplingConfig(1.0, top_k=20, seed=7)
    a = generate(Session(m), [[1, 2, 3]], 20, cfg).tokens[0]
    b = generate(Session(m), [[1, 2, 3]], 20, cfg).tokens[0]
    assert a == b and len(a) == 20
    stop = a[5]
    first = a.index(stop)
    seen = []
    r = generate(Session(m), [[1, 2, 3]], 20, cfg, stop_ids={stop}, on_token=lambda s, t: seen.append(t))
    assert r.tokens[0] == a[:first] == seen and r.stopped == [True]


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_settings(kw):
    with pytest.raises(LongattnError):
        SamplingConfig(**kw)


def test_bf16_weights_close_to_f32_weights_rounded():
    """bf16 weights: the same function as float32 weights rounded to bf16 with inputs of each
    projection rounded to bf16; agreement bounded by bf16's relative step (2^-8) per layer."""
    m32 = tiny_model("llama")
    mbf = tiny_model("llama", dtype=torch.bfloat16)
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(3))
    a, b = m32(ids), mbf(ids)
    assert b.dtype == torch.float32
    rel = ((a - b).norm() / a.norm()).item()
    # 3 layers x 7 projections, each rounding inputs and weights by <= 2^-9 relative
    assert rel < 3 * 7 * 2 * 2 ** -9, rel
    assert rel > 0  # it really ran in bf16
