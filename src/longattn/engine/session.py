"""The prefill / decode loop: chunked prefill, step decode, several streams, generation.

A Session binds a model, a policy and a cache. ``prefill`` feeds prompts (right-padded
when streams differ in length) in chunks; ``step`` feeds one token per stream.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..cache import KVCache
from ..errors import LongattnError
from ..models.rope import longrope_switch
from ..policy import AttentionPolicy
from .sampling import SamplingConfig, sample


def pad_streams(prompts: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists -> ``ids [B, T]`` and positions ``[B, T]`` (-1 on padding)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise LongattnError("every stream needs at least one prompt token")
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.int64)
    pos = torch.full((len(prompts), T), -1, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.as_tensor(p, dtype=torch.int64)
        pos[b, : len(p)] = torch.arange(len(p))
    return ids, pos


class Session:
    """Prefill and decode for one or more streams.

    Args:
        model: a Transformer.
        policy: AttentionPolicy (default: the checkpoint's windows).
        cache: a KVCache (default: ``make_cache(kind="auto")`` — ring caches on windowed
            layers, so Gemma 3's local layers stay bounded; growing caches elsewhere).
        batch: number of streams when ``cache`` is not given.
        kv_dtype: the storage format of a cache made here (cache/kv_format.py; default: the
            model's activation dtype, float32 or float64 for reference runs).

    A model whose longrope switches to its long factors past the original context and whose
    transformers generation then recomputes the whole sequence (``ModelConfig.longrope_recompute``:
    Phi-3) gets the same here: the call that takes the streams past it rebuilds the cache from
    every token fed so far, rotated with the long factors (the Session keeps the tokens).
    """

    def __init__(self, model, policy: Optional[AttentionPolicy] = None, cache: Optional[KVCache] = None,
                 batch: int = 1, kv_dtype: Optional[torch.dtype] = None):
        self.model = model
        self.kv_dtype = kv_dtype or model.activation_dtype
        self.cfg = model.config
        self.policy = policy or AttentionPolicy.from_config(self.cfg)
        self._own_cache = cache is None
        self.cache = self._new_cache(batch) if cache is None else cache
        self.batch = self.cache.batch
        self.rope_switch = recompute_length(self.cfg)
        # every token fed, per stream: what a recompute at the rope switch runs again
        self.history = [[] for _ in range(self.batch)] if self.rope_switch is not None else None
        self._long = False  # the cache's keys carry the long rope factors

    def _new_cache(self, batch: int) -> KVCache:
        from ..cache.factory import make_cache
        return make_cache(self.cfg, self.policy, batch=batch, kind="auto", model=self.model,
                          dtype=self.kv_dtype)

    def _passes_switch(self, rope_len: int) -> bool:
        """This call takes the streams past the rope switch while the cache holds keys rotated
        with the short factors."""
        return (self.rope_switch is not None and not self._long and rope_len > self.rope_switch
                and int(self.cache.next_position().max()) > 0)

    def prefill(self, prompts, chunk: int = 512, logits: str = "last",
                progress: Optional[Callable[[int], None]] = None) -> torch.Tensor:
        """Feed prompts in chunks of ``chunk`` tokens.

        Args:
            prompts: list of token-id lists (one per stream) or an ``[B, T]`` tensor.
            chunk: tokens per forward (memory vs speed); ``<= 0`` means all at once. The chunks
                rotate as one call would (a length-dependent rope takes the whole length).
            logits: "last" -> ``[B, 1, V]`` at each stream's last prompt token;
                "all" -> ``[B, T, V]``.
        """
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist()
        if len(prompts) != self.batch:
            raise LongattnError(f"{len(prompts)} prompts for a session of {self.batch} streams")
        ids, pos = pad_streams(prompts)
        base = self.cache.next_position()  # [B, 1]
        pos = torch.where(pos >= 0, pos + base, pos)
        rope_len = int(pos.max()) + 1
        if self._passes_switch(rope_len):
            return self._recompute([list(p) for p in prompts], chunk, logits, progress)
        T = ids.shape[1]
        step = T if chunk <= 0 else chunk
        outs, last = [], None
        for s in range(0, T, step):
            e = min(T, s + step)
            # Only the logits asked for: the head of a 262K vocabulary costs more than the
            # whole transformer for a short chunk.
            out = self.model(ids[:, s:e], pos[:, s:e], cache=self.cache, policy=self.policy,
                             logits="all" if logits == "all" else "last", rope_len=rope_len)
            if logits == "all":
                outs.append(out)
            else:
                # keep, per stream, the logits of its last real token seen so far
                valid = pos[:, s:e] >= 0
                if valid.any():
                    cur = out[:, 0]  # [B, V] at each row's last real token in this chunk
                    last = cur if last is None else torch.where(valid.any(dim=1, keepdim=True), cur, last)
            if progress:
                progress(e - s)
        self._fed([list(p) for p in prompts], rope_len)
        if logits == "all":
            return torch.cat(outs, dim=1)
        return last[:, None]

    def step(self, tokens: torch.Tensor, active: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Decode one token per stream: ``tokens [B]`` -> logits ``[B, V]``.

        ``active [B]`` bool: inactive streams store a padding slot and their logits are junk.
        """
        pos = self.cache.next_position()  # [B, 1]
        if active is not None:
            pos = torch.where(active[:, None], pos, torch.full_like(pos, -1))
        if self.history is None:
            return self.model(tokens[:, None], pos, cache=self.cache, policy=self.policy, logits="all")[:, 0]
        fed = [[t] if p >= 0 else [] for t, p in zip(tokens.tolist(), pos[:, 0].tolist())]
        rope_len = int(pos.max()) + 1
        if self._passes_switch(rope_len):
            return self._recompute(fed, 0, "last", None)[:, 0]
        out = self.model(tokens[:, None], pos, cache=self.cache, policy=self.policy, logits="all")[:, 0]
        self._fed(fed, rope_len)
        return out

    def _fed(self, tokens: list, rope_len: int) -> None:
        """Record the tokens each stream was fed by a call of sequence length ``rope_len``."""
        if self.history is None:
            return
        for h, t in zip(self.history, tokens):
            h.extend(t)
        self._long = self._long or rope_len > self.rope_switch

    def _recompute(self, tokens: list, chunk: int, logits: str, progress) -> torch.Tensor:
        """Feed ``tokens`` (per stream, possibly none) after rebuilding the cache from every
        token fed so far, all rotated with the long factors (transformers' Phi-3 generation
        drops its cache there and runs the whole sequence again). Logits as ``prefill`` gives
        them for ``tokens``."""
        if not self._own_cache:
            raise LongattnError(f"this sequence passes the original context of {self.rope_switch} tokens "
                                "(longrope), where the Session rebuilds its cache with the long rope factors; "
                                "it cannot rebuild a cache it was given: create the Session without one")
        full = [h + t for h, t in zip(self.history, tokens)]
        self.cache = self._new_cache(self.batch)
        self.history = [[] for _ in range(self.batch)]
        out = self.prefill(full, chunk, logits, progress)
        if logits != "all":
            return out
        # each stream's new tokens follow its earlier ones in the rebuilt run
        start = torch.tensor([len(f) - len(t) for f, t in zip(full, tokens)])[:, None]
        T = max(len(t) for t in tokens)
        cols = (start + torch.arange(T)).clamp(max=out.shape[1] - 1)  # [B, T]
        return out.gather(1, cols[..., None].expand(-1, -1, out.shape[-1]))


def recompute_length(cfg) -> Optional[int]:
    """The sequence length past which a Session recomputes its cache (the longrope's original
    context, where ``cfg.longrope_recompute``), or None."""
    if not cfg.longrope_recompute:
        return None
    switches = [longrope_switch(s) for s in cfg.layer_rope_scaling]
    return min((s for s in switches if s is not None), default=None)


@dataclass
class GenerationResult:
    tokens: list = field(default_factory=list)    # per stream: generated ids
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    cache_bytes: int = 0
    stopped: list = field(default_factory=list)   # per stream: hit a stop token

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def generate(session: Session, prompts: list, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
             stop_ids: Optional[set] = None, chunk: int = 512,
             on_token: Optional[Callable[[int, int], None]] = None,
             stop: Optional[Callable[[int, list], bool]] = None) -> GenerationResult:
    """Prefill ``prompts`` then decode up to ``max_new_tokens`` per stream.

    ``on_token(stream, token_id)`` is called as each token is produced (streaming output).
    A stream stops at its first stop token (which is not emitted), or once
    ``stop(stream, tokens_so_far)`` returns True after a token (that token is kept).
    """
    if max_new_tokens < 0:
        raise LongattnError("max-new-tokens must be >= 0")
    gen = None
    if sampling.seed is not None:
        gen = torch.Generator().manual_seed(sampling.seed)
    stop_ids = set(stop_ids or ())
    B = session.batch
    res = GenerationResult(tokens=[[] for _ in range(B)], prompt_tokens=sum(len(p) for p in prompts),
                           stopped=[False] * B)
    t0 = time.perf_counter()
    logits = session.prefill(prompts, chunk=chunk)[:, 0]
    res.prefill_seconds = time.perf_counter() - t0
    active = torch.ones(B, dtype=torch.bool)
    t0 = time.perf_counter()
    for i in range(max_new_tokens):
        nxt = sample(logits, sampling, gen)
        for b in range(B):
            if not active[b]:
                continue
            t = int(nxt[b])
            if t in stop_ids:
                active[b] = False
                res.stopped[b] = True
                continue
            res.tokens[b].append(t)
            if on_token:
                on_token(b, t)
            if stop is not None and stop(b, res.tokens[b]):
                active[b] = False
                res.stopped[b] = True
        if not active.any() or i == max_new_tokens - 1:
            break
        logits = session.step(nxt, active if not active.all() else None)
    res.decode_seconds = time.perf_counter() - t0
    res.cache_bytes = session.cache.nbytes()
    return res
