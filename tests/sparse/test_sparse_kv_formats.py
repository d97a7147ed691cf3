"""SCSA over caches stored as bfloat16 or int8 (cache/kv_format.py).

Every SCSA reader widens the stored rows it reads -- a block as it is sealed into the index, the
outliers as they are copied out, the exact rows (sink, outliers, suffix) of each call, the dense
read of calibration -- so SCSA over a cache of any format is SCSA over the float32 cache of the
values its rows widen to, bit for bit: the same index, the same decisions, the same output.
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from longattn.cache.kv_format import encode, row_bytes, widen
from longattn.engine.session import Session
from longattn.ops import native
from longattn.sparse.layer import SCSALayer
from longattn.sparse.policy import build_sparse_policy, stream_layers
from sparse_fixtures import assert_same_index, decode_run, small_cfg


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("calib_steps,outliers", [(0, 0), (3, 2)])
def test_scsa_over_stored_rows_equals_scsa_over_their_widened_values(dtype, calib_steps, outliers):
    H, Hkv, D = 4, 2, 64
    cfg = small_cfg(native=False, calib_steps=calib_steps, outliers=outliers)
    stored, widened = (SCSALayer(cfg, H, Hkv, D) for _ in range(2))
    opened = 0
    for q, k, v in decode_run(700, 8, H, Hkv, D, seed=3, query_seed=4):
        rk, rv = encode(k, dtype), encode(v, dtype)
        got = stored.attend(q, rk, rv, D ** -0.5)
        want = widened.attend(q, widen(rk, D), widen(rv, D), D ** -0.5)
        assert torch.equal(got, want)
        opened = stored.counters["opened_rows"]
    assert opened > 0 and stored.counters == widened.counters
    assert_same_index(stored.indexes[0], widened.indexes[0])
    assert torch.equal(stored.indexes[0].extra_k, widened.indexes[0].extra_k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_the_sparse_policy_decodes_through_quantized_caches(dtype):
    """A model under the sparse policy on int8 / bfloat16 caches: SCSA reads through its clusters
    (opened rows counted), and the caches hold the format's bytes."""
    m = tiny_model("llama")
    cfg = m.config
    pol = build_sparse_policy(cfg, small_cfg(calib_steps=0, outliers=2, sink=2))
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, cfg.vocab_size, (500,), generator=g).tolist()
    s = Session(m, pol, kv_dtype=dtype)
    logits = [s.prefill([prompt])[:, 0]]
    for _ in range(6):
        logits.append(s.step(logits[-1].argmax(-1)))
    assert torch.isfinite(torch.cat(logits)).all()
    layers = stream_layers(s.cache)
    assert layers and all(sc.counters["opened_rows"] > 0 for sc in layers.values())
    n = len(prompt) + 6
    assert s.cache.nbytes() >= cfg.num_layers * 2 * cfg.num_kv_heads * n * row_bytes(dtype, cfg.head_dim)


@pytest.mark.skipif(not native.available(), reason="needs the native kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_native_scsa_reads_stored_rows_as_their_widened_values(dtype):
    """The native call (and the decode loop's shortcut to it) widens each exact row of a
    bfloat16 or int8 cache as it reads it: the float32 call's bits on the widened cache."""
    H, Hkv, D = 4, 2, 64
    cfg = small_cfg(calib_steps=0, outliers=2)
    stored, widened = (SCSALayer(cfg, H, Hkv, D) for _ in range(2))
    for q, k, v in decode_run(700, 8, H, Hkv, D, seed=5, query_seed=6):
        rk, rv = encode(k, dtype), encode(v, dtype)
        assert stored._native_applies(stored.indexes[0], rk[0], rv[0]) if stored.indexes else True
        assert torch.equal(stored.attend(q, rk, rv, D ** -0.5),
                           widened.attend(q, widen(rk, D), widen(rv, D), D ** -0.5))
    assert stored._hot is not None and stored.counters == widened.counters and stored.counters["opened_rows"] > 0
