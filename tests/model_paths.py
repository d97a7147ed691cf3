"""Running a tiny model through each attention site, and the two agreement checks every
op and cache kind must pass (used by tests/core/test_windows.py, tests/core/test_weights.py,
tests/engine/test_invariant_grid.py and the static decoders' tests).

Sites: ``forward`` (one full forward), ``chunked`` (chunked prefill through a Session),
``step`` (one token at a time through a Session).
"""

from __future__ import annotations

import torch

from longattn.engine.session import Session
from tolerance import LOGIT_FLOOR, assert_within_derived

T = 29
PATHS = ["forward", "chunked", "step"]


def ids_for(B: int = 1, T: int = T, seed: int = 0, vocab: int = 96) -> torch.Tensor:
    """Deterministic token ids ``[B, T]``."""
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def run_path(model, policy, ids, path, cache_factory=None):
    """Logits [B, T, V] of ``ids`` [B, T] through one of the attention sites.

    cache_factory: ``batch -> cache`` for the Session paths (default: the Session's own)."""
    if path == "forward":
        return model(ids, policy=policy)

    def session():
        cache = None if cache_factory is None else cache_factory(ids.shape[0])
        return Session(model, policy, cache, batch=ids.shape[0])
    if path == "chunked":
        return session().prefill(ids, chunk=7, logits="all")
    if path == "step":
        s = session()
        out = [s.prefill(ids[:, :1], logits="all")[:, 0]]
        for t in range(1, ids.shape[1]):
            out.append(s.step(ids[:, t]))
        return torch.stack(out, 1)
    raise ValueError(path)


def assert_paths_agree(m, m64, pol, cache_factory=None, ids=None):
    """Chunked prefill and step decode within the derived tolerance of the full forward's
    error against the float64 model ``m64`` (the plain reference error of this arithmetic)."""
    ids = ids_for(2, seed=5) if ids is None else ids
    ref = m64(ids, policy=pol)
    full = run_path(m, pol, ids, "forward")
    for p in ("chunked", "step"):
        assert_within_derived(run_path(m, pol, ids, p, cache_factory), full, ref, floor=LOGIT_FLOOR, what=p)


def assert_streams_agree(m, m64, pol, lens, steps, cache_factory=None):
    """Streams of ``lens`` prompt tokens prefilled (chunk 4) and decoded ``steps`` tokens
    together stay within the derived tolerance of each stream's own full-forward error
    against ``m64``."""
    n = len(lens)
    prompts = [ids_for(1, k, seed=10 + i)[0].tolist() for i, k in enumerate(lens)]
    cont = [ids_for(1, steps, seed=20 + i)[0] for i in range(n)]
    s = Session(m, pol, None if cache_factory is None else cache_factory(n), batch=n)
    batched = [s.prefill(prompts, chunk=4)[:, 0]]
    for t in range(steps):
        batched.append(s.step(torch.stack([c[t] for c in cont])))
    batched = torch.stack(batched, 1)  # [n, steps + 1, V]
    for b in range(n):
        full = torch.tensor([prompts[b] + cont[b].tolist()])
        ref = m64(full, policy=pol)[0, lens[b] - 1: lens[b] + steps]
        alone = m(full, policy=pol)[0, lens[b] - 1: lens[b] + steps]
        assert_within_derived(batched[b], alone, ref, floor=LOGIT_FLOOR, what=f"stream {b}")
