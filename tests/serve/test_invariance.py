"""The serving engine's invariance contract on the quantized weight formats: a request's greedy
tokens are the same alone as batched with other streams' decode rows, under any prefill chunk
size (docs/design.md, invariant 3).

Random cases (seeded): prompts of random lengths, a random chunk size and decode batch, against
each request served alone in one prefill chunk. A tiny random model's logits are nearly tied,
so a last-bit difference in a row's arithmetic flips a greedy token within a few steps: these
comparisons fail when a kernel's result depends on the rows beside it (checked: with the
quantized prefill widened to a float32 GEMM, 5 of the 18 cases fail).
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from conftest import tiny_dir
from longattn.checkpoint import load_checkpoint
from longattn.engine.sampling import SamplingConfig
from longattn.models import build_model
from longattn.policy import AttentionPolicy
from longattn.serve.batching import Engine, EngineConfig, Request

VOCAB = range(3, 96)


class CharIds:
    """Text for the engine's output: one character per id (what the text says is not checked)."""

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return "".join(chr(32 + i % 95) for i in ids)


@pytest.fixture(scope="module")
def tiny_ck():
    return load_checkpoint(tiny_dir("llama"), with_tokenizer=False)


def _serve(model, policy, requests, **cfg) -> list[list[int]]:
    """Greedy tokens for ``requests`` [(prompt ids, max tokens)], all submitted at once to one
    engine built with ``cfg``."""
    engine = Engine(model, CharIds(), policy, EngineConfig(**{"block_size": 4, "num_blocks": 4096, **cfg})).start()
    try:
        done = [threading.Event() for _ in requests]
        reqs = [Request(prompt=list(p), max_tokens=n, sampling=SamplingConfig(), ignore_eos=True,
                        emit=lambda kind, _, e=e: e.set() if kind != "text" else None)
                for (p, n), e in zip(requests, done)]
        for r in reqs:
            engine.submit(r)
        assert all(e.wait(120) for e in done)
        assert all(r.finish_reason == "length" for r in reqs)
        return [list(r.generated) for r in reqs]
    finally:
        engine.stop()


def _alone(model, policy, prompt, n) -> list[int]:
    """The request served alone: one prefill chunk, nothing batched, no prefix cache."""
    return _serve(model, policy, [(prompt, n)], max_batch=1, chunk=4096, retain=0)[0]


@pytest.mark.parametrize("weights", ["int8", "int4", "int5"])
@pytest.mark.parametrize("policy", ["checkpoint", "window"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_chunked_and_reused_requests_equal_each_alone(tiny_ck, weights, policy, seed):
    torch.set_num_threads(2)  # rows split across threads too
    model = build_model(tiny_ck.config, tiny_ck.state_dict, weights=weights)
    pol = AttentionPolicy.build(tiny_ck.config, "window", window=6, sinks=2) if policy == "window" else \
        AttentionPolicy.from_config(tiny_ck.config)
    rng = random.Random(seed * 10 + len(weights))
    prompts = [[rng.choice(VOCAB) for _ in range(rng.randint(1, 64))] for _ in range(4)]
    ns = [rng.randint(4, 10) for _ in prompts]
    cfg = {"chunk": rng.randint(1, 40), "max_batch": rng.randint(2, 4), "retain": 0}

    together = _serve(model, pol, list(zip(prompts, ns)), **cfg)
    assert together == [_alone(model, pol, p, n) for p, n in zip(prompts, ns)]
