"""The scheduler (engine/scheduler.py) on its own, without a model: first-in-first-out admission
within the batch and the pool, the queue count the 429 path reads, prefix reuse that takes over
the longest usable retained stream (never evicting it to make room for its own taker), least
recently used eviction, and block accounting that returns every block."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from longattn.cache.paged import BlockPool, PagedStream
from longattn.engine.scheduler import Scheduler, common_prefix
from longattn.policy import LayerPolicy


class _Policy:
    """Two global layers (what PagedStream.for_policy reads)."""
    layers = [LayerPolicy("window", None, 0), LayerPolicy("window", None, 0)]


@dataclass
class _Req:
    prompt: list
    need: int
    key: int
    policy_key: tuple = ()
    policy: object = field(default_factory=_Policy)
    stream: Optional[PagedStream] = None
    fed: list = field(default_factory=list)
    reused: int = 0
    pending: Optional[int] = None
    finish_reason: Optional[str] = None


def _store(pool: BlockPool, r: _Req, n: int) -> None:
    """As if ``n`` more of ``r``'s prompt tokens were stored (blocks allocated per layer)."""
    st, bs = r.stream, pool.block_size
    for layer in range(len(st.tables)):
        for p in range(st.next_pos, st.next_pos + n):
            if p // bs not in st.tables[layer]:
                st.tables[layer][p // bs] = pool.alloc()
    r.fed = r.fed + r.prompt[st.next_pos:st.next_pos + n]
    st.next_pos += n


def test_admission_is_first_in_first_out_within_batch_and_pool():
    pool = BlockPool(20, 4, 1, 2, torch.float32)
    s = Scheduler(pool, max_batch=2, retain=0, rewind=0)
    a, b, c = _Req([1] * 8, 8, 0), _Req([2] * 8, 14, 1), _Req([3] * 4, 2, 2)
    s.waiting += [a, b, c]
    assert s.queued_with([]) == 2  # b does not fit beside a, and c waits behind it
    assert s.admit() == [a] and s.waiting == [b, c] and s.reserved == 8
    s.retire(a, keep=False)
    assert s.admit() == [b, c] and s.reserved == 16


def test_a_prompt_takes_over_the_longest_retained_prefix_and_blocks_come_back():
    pool = BlockPool(40, 4, 1, 2, torch.float32)
    s = Scheduler(pool, max_batch=4, retain=2, rewind=0)
    first = _Req(list(range(10)), 8, 0)
    s.waiting.append(first)
    s.admit()
    _store(pool, first, 10)
    s.retire(first, keep=True)
    assert list(s.retained) == [0] and pool.used == 6  # 3 blocks on each of 2 layers
    nxt = _Req(list(range(7)) + [99, 98], 8, 1)  # shares 7 tokens
    s.waiting.append(nxt)
    assert s.admit() == [nxt]
    assert nxt.reused == 7 and nxt.fed == list(range(7)) and nxt.stream.next_pos == 7
    assert not s.retained and pool.used == 4  # the block past position 7 went back
    s.retire(nxt, keep=False)
    assert pool.used == 0 and s.reserved == 0


def test_retained_streams_are_evicted_least_recently_used_first_but_never_the_one_taken_over():
    pool = BlockPool(16, 4, 1, 2, torch.float32)
    s = Scheduler(pool, max_batch=4, retain=4, rewind=0)
    done = []
    for k, base in enumerate((0, 50)):
        r = _Req([base + i for i in range(8)], 4, k)
        s.waiting.append(r)
        s.admit()
        _store(pool, r, 8)
        s.retire(r, keep=True)
        done.append(r)
    assert pool.used == 8 and list(s.retained) == [0, 1]
    # continues the older stream (key 0) and needs 13 of the 16 blocks: key 1 (more recently
    # used) is evicted for it, key 0 becomes its stream
    taker = _Req(list(range(8)) + [7], 13, 2)
    s.waiting.append(taker)
    assert s.admit() == [taker] and taker.reused == 8 and list(s.retained) == []
    assert pool.used == 4


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0
    assert common_prefix([5], [5]) == 1


def test_block_hashes_chain_every_earlier_block_and_name_their_namespace():
    from longattn.engine.prefix_index import PrefixIndex, block_hashes
    a = block_hashes(range(10), 4, "p")
    assert len(a) == 2 and a == block_hashes(list(range(10)), 4, "p")  # full blocks only, stable
    assert block_hashes([0, 1, 2, 3, 9, 5, 6, 7], 4, "p")[0] == a[0]
    assert block_hashes([0, 1, 2, 3, 9, 5, 6, 7], 4, "p")[1] != a[1]
    assert block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4, "p")[1] != a[1]  # a change earlier changes every later hash
    assert block_hashes(range(10), 4, "q")[0] != a[0]                # another policy never matches
    idx = PrefixIndex(4)
    idx.add("x", "p", list(range(10)))
    idx.add("y", "p", list(range(4)) + [7] * 8)
    assert idx.matches(block_hashes(list(range(12)), 4, "p")) == {"x": 2, "y": 1}
    assert idx.matches(block_hashes([7] * 12, 4, "p")) == {}
    idx.remove("x")
    assert idx.matches(block_hashes(list(range(12)), 4, "p")) == {"y": 1} and len(idx) == 1
    idx.remove("y")
    assert not idx._holders  # nothing left behind


def test_reuse_needs_a_whole_shared_block_and_never_crosses_policies():
    pool = BlockPool(60, 4, 1, 2, torch.float32)
    s = Scheduler(pool, max_batch=4, retain=4, rewind=0)
    for key, (prompt, pk) in enumerate((([1, 2, 3, 4, 5, 6], ()), ([1, 2, 3, 9, 9, 9], ()),
                                        ([1, 2, 3, 4, 5, 6, 7, 8, 9], ("window", 8)))):
        r = _Req(prompt, 4, key, policy_key=pk)
        s.waiting.append(r)
        s.admit()
        _store(pool, r, len(prompt))
        s.retire(r, keep=True)
    short = _Req([1, 2, 3, 7, 7], 4, 10)  # 3 tokens shared: less than a block
    s.waiting.append(short)
    s.admit()
    assert short.reused == 0 and len(s.retained) == 3
    s.retire(short, keep=False)
    longer = _Req([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 6, 11)  # the window stream shares more, but not its policy
    s.waiting.append(longer)
    s.admit()
    assert longer.reused == 6 and 0 not in s.retained and 2 in s.retained
