"""Chained block hashes of token sequences: what prefix reuse matches by.

Block ``i`` of a sequence (tokens ``[i*bs, (i+1)*bs)``) is hashed together with every block
before it: ``h_i = blake2b(h_{i-1} || tokens of block i)``, where ``h_{-1}`` hashes a namespace
naming what the tokens were computed under (the request's policy, the side of a long-rope
switch). Two sequences share block ``i``'s hash exactly when they share their first
``(i+1)*bs`` tokens in the same namespace (barring a 128-bit collision), so the streams holding
the longest prefix of a prompt are found with one dictionary lookup per block of the prompt,
however many streams are retained. The hashes are the same in every process (no per-process
hash seed), so a router in front of several servers can compare them.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Hashable, Iterable


def block_hashes(tokens: Iterable[int], block_size: int, namespace: str) -> list:
    """The chained hashes (16 bytes each) of the full blocks of ``tokens``."""
    toks = list(tokens)
    h = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    out = []
    for i in range(len(toks) // block_size):
        h = hashlib.blake2b(h + array("q", toks[i * block_size:(i + 1) * block_size]).tobytes(),
                            digest_size=16).digest()
        out.append(h)
    return out


class PrefixIndex:
    """Which retained sequences (by key) hold which chained block hashes."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._holders: dict = {}  # hash -> set of keys
        self._hashes: dict = {}   # key -> its hashes

    def add(self, key: Hashable, namespace: str, tokens: list) -> None:
        self.remove(key)
        hs = block_hashes(tokens, self.block_size, namespace)
        self._hashes[key] = hs
        for h in hs:
            self._holders.setdefault(h, set()).add(key)

    def remove(self, key: Hashable) -> None:
        for h in self._hashes.pop(key, ()):
            keys = self._holders[h]
            keys.discard(key)
            if not keys:
                del self._holders[h]

    def matches(self, hashes: list) -> dict:
        """``{key: full blocks shared}`` for every key sharing at least the first block of the
        sequence whose chained hashes are ``hashes``."""
        found: dict = {}
        for i, h in enumerate(hashes):
            keys = self._holders.get(h)
            if not keys:
                break  # chained: no later block can match once one does not
            for k in keys:
                found[k] = i + 1
        return found

    def __len__(self) -> int:
        return len(self._hashes)
