"""``serve --policy sparse``: SCSA over the paged pool, its index kept with each stream.

A sparse stream's row runs SCSA over its own index (in the compiled step's op, or the eager model
over its stream alone); its prefill seals the prompt's full blocks into the index, and a later
turn that continues the stream keeps them. So a
sparse request's greedy tokens are the same alone, beside dense and other sparse requests, in any
chunk size and after its prefix is reused -- and SCSA really read through clusters to get them.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_dir
from longattn.checkpoint import load_checkpoint
from longattn.engine.sampling import SamplingConfig
from longattn.models import build_model
from longattn.serve.batching import Engine, EngineConfig, Request
from longattn.sparse import SCSAConfig
from longattn.sparse.policy import build_sparse_policy, policy_taus
from longattn.sparse.tau_cache import cached_taus
from test_paged_step import CharIds
from test_paged_step import _serve as submit_all

VOCAB = range(3, 96)
# tiny clusters and blocks: a few hundred tokens seal blocks, rebuild and open clusters
SMALL = dict(cluster_size=16, rebuild_interval=32, block_size=128, sink=4, recent=8, min_context=0,
             outliers=2, calib_steps=0, dense_when_cheaper=False)


@pytest.fixture(scope="module")
def tiny_ck():
    return load_checkpoint(tiny_dir("llama"), with_tokenizer=False)


@pytest.fixture(scope="module")
def model(tiny_ck):
    return build_model(tiny_ck.config, tiny_ck.state_dict, weights="int8")


def _engine(model, policy, tau_path=None, **cfg) -> Engine:
    return Engine(model, CharIds(), policy, EngineConfig(**{"block_size": 4, "num_blocks": 4096, **cfg}),
                  tau_path=tau_path).start()


def _run(engine, requests) -> list:
    """Submit ``requests`` [(prompt, max tokens, policy key)] at once; their Requests when done."""
    reqs = submit_all(engine, requests)
    assert all(r.finish_reason == "length" for r in reqs)
    return reqs


def _alone(model, policy, prompt, n, key=(), **cfg) -> list:
    engine = _engine(model, policy, max_batch=1, chunk=4096, retain=0, **cfg)
    try:
        return list(_run(engine, [(prompt, n, key)])[0].generated)
    finally:
        engine.stop()


@pytest.mark.parametrize("seed", [0, 1])
# "aot": sparse rows through the compiled step's SCSA op (sparse/paged_op.py); "none": the eager
# model, one sparse stream per call
@pytest.mark.parametrize("weights,kv,step", [("int8", "f32", "aot"), ("int4", "bf16", "aot"), ("int5", "int8", "none"),
                                             ("int8", "f32", "none")])
def test_sparse_requests_beside_dense_ones_equal_each_alone(tiny_ck, seed, weights, kv, step):
    torch.set_num_threads(2)
    model = build_model(tiny_ck.config, tiny_ck.state_dict, weights=weights)
    pol = build_sparse_policy(model.config, SCSAConfig(**SMALL))
    rng = random.Random(seed)
    requests = [([rng.choice(VOCAB) for _ in range(rng.randint(150, 400))], rng.randint(20, 50), key)
                for key in ((), (), (16, 2), ())]
    engine = _engine(model, pol, chunk=rng.randint(8, 90), max_batch=4, retain=0, kv=kv, compile=step)
    try:
        assert engine.step_kind == ("aot" if step == "aot" else "eager")
        together = [list(r.generated) for r in _run(engine, requests)]
        sparse = dict(engine.metrics.sparse)
    finally:
        engine.stop()
    engine = _engine(model, pol, max_batch=1, chunk=4096, retain=0, kv=kv, compile=step)
    try:
        alone = [list(_run(engine, [req])[0].generated) for req in requests]
    finally:
        engine.stop()
    assert together == alone
    assert sparse["opened_rows"] > 0 and sparse["clusters_scored"] > sparse["opened_rows"] // SMALL["cluster_size"]


def test_a_later_turn_keeps_the_streams_index_and_equals_the_turn_alone(model):
    torch.set_num_threads(2)
    pol = build_sparse_policy(model.config, SCSAConfig(**SMALL))
    rng = random.Random(7)
    prompt = [rng.choice(VOCAB) for _ in range(300)]
    engine = _engine(model, pol, chunk=64, rewind=64)
    try:
        first = _run(engine, [(prompt, 30, ())])[0]
        stream = engine.sched.retained[first.key][2]
        index = stream.op_state[0]["scsa"].indexes[0]
        sealed, version = index.seal_end, index.version
        prompt2 = prompt + list(first.generated) + [rng.choice(VOCAB) for _ in range(20)]
        second = _run(engine, [(prompt2, 30, ())])[0]
        assert second.reused >= len(prompt) and engine.metrics.prefix_hits == 1
        # the continued stream's index is the same object, grown from where the first turn left it
        assert stream.op_state[0]["scsa"].indexes[0] is index and index.seal_end > sealed
        assert index.version > version
    finally:
        engine.stop()
    assert list(second.generated) == _alone(model, pol, prompt2, 30)


def test_the_first_stream_that_calibrates_keeps_its_taus_for_the_next(model, tmp_path):
    torch.set_num_threads(2)
    pol = build_sparse_policy(model.config, SCSAConfig(**{**SMALL, "calib_steps": 3}))
    path = tmp_path / "taus.json"
    rng = random.Random(3)
    engine = _engine(model, pol, retain=0, tau_path=path)
    try:
        assert not policy_taus(engine.policies[()])
        _run(engine, [([rng.choice(VOCAB) for _ in range(200)], 10, ())])
        kept = policy_taus(engine.policies[()])
        assert sorted(kept) == [0, 1, 2] and cached_taus(path, pol, model.config) == kept
        # the next request's layers start calibrated: no calibrating call, straight to SCSA
        r = _run(engine, [([rng.choice(VOCAB) for _ in range(200)], 10, ())])[0]
        assert r.policy is engine.policies[()]
    finally:
        engine.stop()


def test_a_sparse_request_is_logged_as_such(model):
    pol = build_sparse_policy(model.config, SCSAConfig(**SMALL))
    engine = Engine(model, CharIds(), pol, EngineConfig(block_size=4, num_blocks=512))
    assert engine.attention_of(Request(prompt=[1], max_tokens=1, sampling=SamplingConfig(), emit=None,
                                       policy=pol)) == "sparse"
    assert engine.attention_of(Request(prompt=[1], max_tokens=1, sampling=SamplingConfig(), emit=None,
                                       policy_key=(8, 2))) == "window=8,sinks=2"


def test_gemma3_serves_its_global_layers_sparse_and_its_local_layers_windowed():
    """A hybrid checkpoint: SCSA on the global layers, the trained window on the local ones
    (whose blocks the pool frees as they leave it); batched == alone still."""
    torch.set_num_threads(2)
    ck = load_checkpoint(tiny_dir("gemma3"), with_tokenizer=False)
    model = build_model(ck.config, ck.state_dict, weights="int8")
    pol = build_sparse_policy(model.config, SCSAConfig(**SMALL))
    kinds = [lp.kind for lp in pol.layers]
    assert "sparse" in kinds and "window" in kinds
    rng = random.Random(5)
    requests = [([rng.choice(VOCAB) for _ in range(rng.randint(200, 300))], 30, ()) for _ in range(3)]
    engine = _engine(model, pol, chunk=37, max_batch=3, retain=0, compile="none")
    try:
        together = [list(r.generated) for r in _run(engine, requests)]
        assert engine.metrics.sparse["opened_rows"] > 0
    finally:
        engine.stop()
    assert together == [_alone(model, pol, p, n, compile="none") for p, n, _ in requests]
