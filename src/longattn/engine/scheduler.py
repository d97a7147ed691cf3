"""Which requests run, and where their KV blocks come from.

Admission is first in, first out: the request at the head of the queue starts once a batch row
is free and the pool can give it the most blocks it can ever hold (``need``, reserved whole, so
the running requests never exhaust the pool). A finished request's stream may stay in the pool
(``retain`` of them, least recently used evicted first, and only when admission needs their
blocks) with the chained hashes of the tokens it stored (engine/prefix_index.py); a new request
with the same policy whose prompt shares at least one whole block with one takes it over, cut
back to the shared length (whole blocks, then the tokens of the next block that agree) where
every layer still holds what a query there reads (``PagedStream.truncate``), and prefills only
the rest.

Pure Python over the pool's block counts and the requests' fields: no model, no thread, so it is
tested on its own (tests/engine/test_scheduler.py). The serving engine (serve/batching.py) runs it
under its lock at each step boundary.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from ..cache.paged import BlockPool, PagedStream
from .prefix_index import PrefixIndex, block_hashes


class Scheduler:
    """The queue, the running batch and the retained streams of one pool.

    Args:
        pool: the BlockPool the streams take blocks from (counts and releases only).
        max_batch: requests running at once. retain: finished streams kept for reuse (0: none).
        rewind: positions a windowed layer keeps beyond its window (``PagedStream``).
        metrics: an object with ``prompt_tokens``, ``prefix_queries``, ``prefix_hits`` and
            ``prefix_tokens`` counters (the engine's /metrics), or None.
        rope_switch: a long-rope model's factor switch (Phi-3): a stream is continued only by a
            prompt on its side of it.

    Requests need ``prompt``, ``policy_key``, ``policy``, ``need``, ``key`` and the fields this
    class fills: ``stream``, ``fed``, ``reused``.
    """

    def __init__(self, pool: BlockPool, max_batch: int, retain: int, rewind: int, metrics=None,
                 rope_switch: Optional[int] = None):
        self.pool, self.max_batch, self.retain, self.rewind = pool, max_batch, retain, rewind
        self.metrics, self.rope_switch = metrics, rope_switch
        self.waiting: list = []
        self.running: list = []
        # request key -> (policy_key, tokens, stream). Keys, never ``id()``: a dropped request's
        # address goes to a later one, and a clash would overwrite a retained stream without
        # giving its blocks back
        self.retained: OrderedDict = OrderedDict()
        self.index = PrefixIndex(pool.block_size)  # the retained streams' block hashes
        self._head_hashes: tuple = (None, [])  # (request key, its prompt's hashes): the queue's head
        self.reserved = 0  # blocks promised to the running requests

    def queued_with(self, incoming: list) -> int:
        """How many requests would wait for admission with ``incoming`` queued after the waiting
        ones: the requests ahead take batch rows and blocks first, and once one does not fit every
        later one waits too."""
        rows = self.max_batch - len(self.running)
        free = self.pool.num_blocks - self.reserved
        queued = 0
        for r in list(self.waiting) + list(incoming):
            if queued == 0 and rows > 0 and r.need <= free:
                rows, free = rows - 1, free - r.need
            else:
                queued += 1
        return queued

    def admit(self) -> list:
        """Start the waiting requests that fit, in order; returns them."""
        started = []
        while self.waiting:
            r = self.waiting[0]
            # The retained stream this request would continue is found first and never evicted
            # to make room for it: its blocks become the request's own (counted in r.need).
            # Evicting it first would make every long windowed chat re-prefill, since a turn's
            # need and the stream it continues together often exceed the pool.
            reuse = self.best_reuse(r)
            keep = reuse[0] if reuse else None
            while not self.fits_with_retained(r, keep) and any(k != keep for k in self.retained):
                victim = next(k for k in self.retained if k != keep)  # least recently used
                self._unretain(victim).release(self.pool)
            if not self.fits_with_retained(r, keep):
                break
            self.waiting.pop(0)
            self.reserved += r.need
            if self.metrics is not None:
                self.metrics.prompt_tokens += len(r.prompt)
                self.metrics.prefix_queries += 1
            r.stream = self._take_over(r, *reuse) if reuse else PagedStream.for_policy(r.policy, self.rewind)
            self.running.append(r)
            started.append(r)
        return started

    def fits_with_retained(self, r, keep=None) -> bool:
        """Whether ``r`` fits beside the running requests and the retained streams (but ``keep``,
        the stream ``r`` takes over)."""
        held = sum(s.blocks() for k, (_, _, s) in self.retained.items() if k != keep)
        return len(self.running) < self.max_batch and self.reserved + r.need <= self.pool.num_blocks - held

    def _namespace(self, policy_key, length: int) -> str:
        """What a sequence's keys were computed under: its policy and, for a long-rope model, its
        side of the factor switch (a stream is continued only on its own side)."""
        side = self.rope_switch is not None and length > self.rope_switch
        return repr((policy_key, side))

    def best_reuse(self, r) -> Optional[tuple]:
        """``(key, n)``: the retained stream sharing the longest usable prefix (n tokens, at
        least one whole block) with ``r.prompt``, or None. Usable: the stream still holds what a
        query at ``n`` reads. Ties go to the least recently used stream."""
        if self._head_hashes[0] != r.key:  # a waiting head is looked at every step: hashed once
            self._head_hashes = (r.key, block_hashes(r.prompt, self.pool.block_size,
                                                     self._namespace(r.policy_key, len(r.prompt))))
        hashes = self._head_hashes[1]
        found = self.index.matches(hashes)
        best = None
        for key in (k for k in self.retained if k in found):
            _, toks, st = self.retained[key]
            start = found[key] * self.pool.block_size
            n = start + common_prefix(toks[start:], r.prompt[start:])
            n = min(n, len(r.prompt) - 1)  # at least one token is fed: its logits start the reply
            if n > (best[1] if best else 0) and st.can_truncate(n, self.pool):
                best = (key, n)
        return best

    def _unretain(self, key) -> PagedStream:
        """Take ``key`` out of the retained streams (and the index); returns its stream."""
        self.index.remove(key)
        return self.retained.pop(key)[2]

    def _take_over(self, r, key, n: int) -> PagedStream:
        """Continue the retained stream ``key`` from position ``n`` as ``r``'s stream."""
        toks = self.retained[key][1]
        st = self._unretain(key)
        st.truncate(n, self.pool)
        r.fed = toks[:n]
        r.reused = n
        if self.metrics is not None:
            self.metrics.prefix_hits += 1
            self.metrics.prefix_tokens += n
        return st

    def next_prefill(self):
        """The first running request with prompt tokens left to feed, or None."""
        return next((r for r in self.running if r.pending is None and r.finish_reason is None), None)

    def retire(self, r, keep: bool) -> None:
        """``r`` has finished: it leaves the batch; its stream is retained for reuse when
        ``keep`` (and reuse is on), else its blocks go back to the pool."""
        if r in self.running:
            self.running.remove(r)
            self.reserved -= r.need
        st, r.stream = r.stream, None
        if st is None:
            return
        if keep and self.retain and r.fed:
            self.retained[r.key] = (r.policy_key, r.fed, st)  # r is done: its ids stay as they are
            self.index.add(r.key, self._namespace(r.policy_key, len(r.fed)), r.fed)
            while len(self.retained) > self.retain:
                self._unretain(next(iter(self.retained))).release(self.pool)
        else:
            st.release(self.pool)

    def retained_blocks(self) -> int:
        return sum(s.blocks() for _, _, s in self.retained.values())


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
