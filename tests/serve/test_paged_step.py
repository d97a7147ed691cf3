"""The compiled paged step (engine/paged_step.py): each row's logits are the same bits whatever
shares its call, however a prompt is chunked, and whether a position is prefilled or decoded;
its error against float64 stays within the derived tolerance; one build serves every window and
sinks; a failing step ends only the request that fails.
"""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import tiny_dir, tiny_formats
from longattn.cache.paged import BlockPool, PagedKVCache, PagedStream, finish_rows, plan_rows
from longattn.checkpoint import load_checkpoint
from longattn.engine.paged_step import PagedStep
from longattn.engine.sampling import SamplingConfig
from longattn.models import build_model
from longattn.policy import AttentionPolicy
from longattn.serve import batching
from longattn.cache.kv_format import KV_FORMATS
from longattn.serve.batching import Engine, EngineConfig, Request
from test_invariance import CharIds
from tolerance import LOGIT_FLOOR, assert_within_derived

pytestmark = pytest.mark.skipif(not __import__("longattn.ops.native", fromlist=["x"]).available(),
                                reason="the compiled step calls the native kernels")


def _policy(cfg, name):
    return AttentionPolicy.build(cfg, "window", window=6, sinks=2) if name == "window" else \
        AttentionPolicy.from_config(cfg)


class _Streams:
    """Streams over one pool, stepped by one PagedStep: ``feed(stream, ids)`` stores ``ids`` after
    what the stream holds and returns every row's logits."""

    def __init__(self, model, policy, kv):
        cfg = model.config
        self.pool = BlockPool(4000, 4, cfg.num_kv_heads, cfg.head_dim, KV_FORMATS[kv])
        self.policy = policy
        self.step = PagedStep(model, policy, self.pool, progress=False)

    def new(self) -> PagedStream:
        return PagedStream.for_policy(self.policy, rewind=8)

    def feed(self, parts: list) -> list:
        """``parts`` [(stream, ids)] in one call -> per part its rows' logits ``[len(ids), V]``."""
        streams = [st for st, _ in parts]
        batch = plan_rows(self.pool, streams, [(st.next_pos, list(ids)) for st, ids in parts], self.step.groups)
        out = self.step(batch, torch.arange(batch.rows), self.policy)
        finish_rows(self.pool, streams, batch)
        sizes = [len(ids) for _, ids in parts]
        return list(out.split(sizes))


@pytest.mark.parametrize("family,weights,kv", [("llama", "int8", "f32"), ("llama", "int4", "bf16"),
                                               ("llama", "f32", "f32"), ("gemma2", "int8", "bf16"),
                                               ("llama", "int4", "int8")])
@pytest.mark.parametrize("policy", ["checkpoint", "window"])
def test_a_position_has_the_same_logits_in_any_chunk_batch_or_decoded(family, weights, kv, policy):
    """Every position of a sequence gets the same bits prefilled whole, in random chunks,
    decoded one by one after a prefix, and with another stream's rows (decode or prefill) in
    the same calls. Gemma 2 adds soft-capped scores and local/global layers (two groups)."""
    torch.set_num_threads(2)
    ck = load_checkpoint(tiny_dir(family), with_tokenizer=False)
    model = build_model(ck.config, ck.state_dict, weights=weights)
    s = _Streams(model, _policy(ck.config, policy), kv)
    gen = torch.Generator().manual_seed(len(weights))
    ids = torch.randint(3, 96, (64,), generator=gen).tolist()
    other = torch.randint(3, 96, (80,), generator=gen).tolist()

    def run(cuts: list, companion: bool) -> torch.Tensor:
        st, co = s.new(), s.new()
        outs, i, j = [], 0, 0
        for n in cuts:
            parts = [(st, ids[i:i + n])]
            if companion:  # another stream's next piece in the same call: 1 token, then 5, ...
                m = 1 + (j % 3) * 2
                parts.append((co, other[j:j + m]))
                j += m
            outs.append(s.feed(parts)[0])
            i += n
        st.release(s.pool)
        co.release(s.pool)
        return torch.cat(outs)

    whole = run([64], False)
    rng = torch.Generator().manual_seed(7)
    chunks = []
    while sum(chunks) < 64:
        chunks.append(min(int(torch.randint(1, 12, (1,), generator=rng)), 64 - sum(chunks)))
    for cuts, companion in (([64], True), (chunks, False), (chunks, True), ([24] + [1] * 40, False),
                            ([1] * 64, True)):
        assert torch.equal(run(cuts, companion), whole), (cuts[:4], companion)


@pytest.mark.parametrize("weights", ["f32", "int8"])
def test_the_compiled_step_is_within_the_derived_tolerance_of_float64(weights):
    """The compiled step's logits against a float64 model of the same weights: at most twice the
    eager paged path's error (its reference) plus a logit floor."""
    torch.set_num_threads(2)
    model, ref = tiny_formats("llama", weights)
    cfg = model.config
    pol = AttentionPolicy.from_config(cfg)
    ids = torch.randint(3, 96, (48,), generator=torch.Generator().manual_seed(3))
    s = _Streams(model, pol, "f32")
    fast = s.feed([(s.new(), ids.tolist())])[0]
    eager_pool = BlockPool(1000, 4, cfg.num_kv_heads, cfg.head_dim)
    plain = model(ids[None], cache=PagedKVCache(cfg, eager_pool, [PagedStream.for_policy(pol)]), policy=pol)[0]
    want = ref(ids[None])[0]
    assert_within_derived(fast, plain, want, LOGIT_FLOOR, "compiled paged step")


def _serve(engine, requests) -> list:
    """Greedy tokens of ``requests`` [(prompt, max tokens, policy key)] submitted at once."""
    done = [threading.Event() for _ in requests]
    reqs = [Request(prompt=list(p), max_tokens=n, sampling=SamplingConfig(), ignore_eos=True, policy_key=key,
                    emit=lambda kind, _, e=e: e.set() if kind != "text" else None)
            for (p, n, key), e in zip(requests, done)]
    for r in reqs:
        engine.submit(r)
    assert all(e.wait(120) for e in done)
    return reqs


def _engine(model, policy, **cfg):
    return Engine(model, CharIds(), policy, EngineConfig(**{"block_size": 4, "num_blocks": 2048, **cfg})).start()


def test_a_requests_own_window_runs_on_the_servers_build_and_equals_a_windowed_server():
    """One build serves every window and sinks: a request with its own window on a dense
    server runs the compiled step (no eager fallback, no new build) and gets the tokens a server
    whose policy is that window gives it."""
    torch.set_num_threads(2)
    ck = load_checkpoint(tiny_dir("llama"), with_tokenizer=False)
    model = build_model(ck.config, ck.state_dict, weights="int8")
    prompt = list(range(3, 40))
    dense = _engine(model, AttentionPolicy.from_config(ck.config))
    try:
        assert dense.step_kind == "aot"
        r, = _serve(dense, [(prompt, 12, (6, 2))])
    finally:
        dense.stop()  # joins the engine thread: the step in flight has counted itself
    assert r.finish_reason == "length" and dense.metrics.compiled_steps > 0
    assert dense.metrics.compiled_steps == dense.metrics.steps  # every step compiled
    windowed = _engine(model, AttentionPolicy.build(ck.config, "window", window=6, sinks=2))
    try:
        assert windowed.paged.key == dense.paged.key  # the same package
        w, = _serve(windowed, [(prompt, 12, ())])
        assert list(w.generated) == list(r.generated)
    finally:
        windowed.stop()


def test_a_failing_compiled_step_ends_only_the_request_that_fails(monkeypatch):
    """A compiled step that fails runs its requests again one by one: the one that fails alone
    ends with an error, the others finish with the tokens they get alone. The poisoned request
    fails from its first decode row on, so the failing calls are batched ones."""
    torch.set_num_threads(2)
    ck = load_checkpoint(tiny_dir("llama"), with_tokenizer=False)
    model = build_model(ck.config, ck.state_dict, weights="int4")
    engine = _engine(model, AttentionPolicy.from_config(ck.config), max_batch=4, chunk=8)
    prompts = [[5, 6, 7], [9, 10, 11, 12], [20, 21], [30, 31, 32, 33, 34]]
    try:
        alone = [list(_serve(engine, [(p, 12, ())])[0].generated) for p in prompts]
        poison, planned = [], []
        plan = batching.plan_rows

        def recording_plan(pool, streams, segments, groups):
            planned[:] = [(st, start) for st, (start, _) in zip(streams, segments)]
            return plan(pool, streams, segments, groups)

        step = engine.paged

        class Faulty:
            groups = step.groups

            def serves(self, policy):
                return step.serves(policy)

            def __call__(self, batch, sel, policy, sparse=(None, [])):
                if any(st is r.stream and start >= len(r.prompt) for st, start in planned for r in poison):
                    raise RuntimeError("injected fault")
                return step(batch, sel, policy, sparse)

        monkeypatch.setattr(batching, "plan_rows", recording_plan)
        engine.paged = Faulty()
        done = [threading.Event() for _ in prompts]
        reqs = [Request(prompt=p, max_tokens=12, sampling=SamplingConfig(), ignore_eos=True,
                        emit=lambda kind, _, e=e: e.set() if kind != "text" else None) for p, e in zip(prompts, done)]
        poison.append(reqs[1])  # before it is submitted: no race with a fast machine
        for r in reqs:
            engine.submit(r)
        assert all(e.wait(120) for e in done)
        assert reqs[1].finish_reason == "error"
        for i in (0, 2, 3):
            assert reqs[i].finish_reason == "length" and list(reqs[i].generated) == alone[i]
        snap = engine.snapshot()
        assert snap["running"] == 0 and snap["blocks_used"] == snap["blocks_retained"]
    finally:
        engine.stop()


def test_a_model_the_step_cannot_run_is_served_eagerly(caplog):
    """A rope that follows the sequence length cannot be a row-wise compiled graph: the engine
    says so in one log line and serves with the eager model."""
    ck = load_checkpoint(tiny_dir("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                         with_tokenizer=False)
    model = build_model(ck.config, ck.state_dict)
    with caplog.at_level("WARNING", logger="longattn.serve"):
        engine = Engine(model, None, AttentionPolicy.from_config(ck.config), EngineConfig(block_size=4))
    assert engine.step_kind == "eager" and engine.snapshot()["step"] == "eager"
    assert any("rope" in r.getMessage() for r in caplog.records)
