"""Every path computes the same function: full forward, chunked prefill, step decode.

Tolerance: each path is compared with a float64 evaluation of the same weights; a path's
error may be at most 2x the float32 full forward's own error (+1e-6 for the near-zero case).
Paths differ only in matmul shapes (summation order), so each path's rounding error is of
the same size as the reference path's.
"""

import pytest
import torch

from conftest import tiny_model
from longattn.cache import KVCache
from longattn.engine.session import Session
from tolerance import LOGIT_FLOOR, assert_within_derived, derived_bound, max_err

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt_oss"]


def _paths(model, ids, chunk):
    full = model(ids)
    s = Session(model)
    chunked = s.prefill(ids, chunk=chunk, logits="all")
    s2 = Session(model)
    steps = [s2.prefill(ids[:, :1], logits="all")[:, 0]]
    for t in range(1, ids.shape[1]):
        steps.append(s2.step(ids[:, t]))
    return full, chunked, torch.stack(steps, dim=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_chunked_step_agree(family):
    m32 = tiny_model(family)
    m64 = tiny_model(family, dtype=torch.float64)
    ids = torch.randint(0, m32.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(3))
    ref = m64(ids)
    full, chunked, steps = _paths(m32, ids, chunk=5)
    base = max_err(full, ref)
    tol = derived_bound(base, floor=LOGIT_FLOOR)
    for name, out in [("chunked", chunked), ("step", steps)]:
        err = max_err(out, ref)
        assert err <= tol, f"{family} {name}: err {err:.2e} > 2x full-forward err {base:.2e}"
    # and the chunked prefill's last logits equal one-shot prefill's, within the same bound
    one = Session(m32).prefill(ids, chunk=0, logits="all")
    assert max_err(one, ref) <= tol


def test_prefill_logits_last_matches_all():
    """logits="last" computes the head on one row only: same values up to summation order."""
    m = tiny_model("llama")
    m64 = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(4))
    a = Session(m).prefill(ids, chunk=6, logits="all")[:, -1]
    b = Session(m).prefill(ids, chunk=6, logits="last")[:, 0]
    ref = m64(ids)[:, -1]
    assert_within_derived(b, a, ref, floor=LOGIT_FLOOR)


def test_cache_grows_and_counts_bytes():
    m = tiny_model("llama")
    c = KVCache(m.config, 1)
    s = Session(m, cache=c)
    s.prefill([[i % 96 for i in range(300)]], chunk=100)
    assert c.tokens() == [300] * m.config.num_layers
    for layer in c.layers:
        assert layer.nbytes() == layer.k.numel() * 4 * 2
