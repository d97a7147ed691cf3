"""Content digests of checkpoint files, remembered per (path, size, mtime).

Cache entries (assembled sources, conversions, oracle copies) are keyed by what a file
holds, not where it lives: every fresh virtual environment installs the bundled packages
at a new path with new mtimes, and keying by path made each clone convert (and store) all
three models again, ~9 GB a time. Hashing 0.5 GB takes about a second, so the digest of a
file is remembered in ``$LONGATTN_CACHE/digests.json`` under its path, size and mtime and
recomputed only when one of those changes.

Prepared weights are checked on every load instead, by ``chunk_crcs``: CRC-32 (zlib) of
8 MiB pieces hashed on several threads straight from a memory map, about 2.3 GB/s per core.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .paths import CacheWriteError, atomic_write_path, cache_root

_MEMO_FILE = "digests.json"


def _stat_key(p: Path) -> str:
    st = p.stat()
    return f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def _memo_key(paths: list[Path]) -> str:
    return "\n".join(_stat_key(p) for p in paths)


def _load_memo() -> dict:
    try:
        return json.loads((cache_root() / _MEMO_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _save_memo(memo: dict) -> None:
    try:
        with atomic_write_path(cache_root() / _MEMO_FILE) as tmp:
            tmp.write_text(json.dumps(memo, indent=0, sort_keys=True))
    except CacheWriteError:
        pass  # a full disk: the memo only saves hashing, and the files are hashed again next time


def content_digest(paths: list[Path], remember: bool = True) -> str:
    """SHA-256 (hex) of the concatenated contents of ``paths``, in order.

    The digest of a model's parts equals the digest of the file they assemble into, so a
    package's published checksum of the whole file can be compared directly. With
    ``remember=False`` a newly computed digest is not written to the memo: callers that may
    still reject the file (a truncated GGUF) record it only once the file proved good, so a
    failed load leaves nothing in the cache directory.
    """
    memo = _load_memo()
    key = _memo_key(paths)
    if key in memo:
        return memo[key]
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    digest = h.hexdigest()
    if remember:
        remember_digest(paths, digest, memo)
    return digest


def remember_digest(paths: list[Path], digest: str, memo: dict | None = None) -> None:
    """Record a digest already known (e.g. a file just assembled from parts)."""
    memo = _load_memo() if memo is None else memo
    key = _memo_key(paths)
    if memo.get(key) == digest:
        return
    memo[key] = digest
    # Drop entries for files that no longer exist (a deleted clone's packages).
    for k in [k for k in memo if not all(Path(s.rsplit("|", 2)[0]).exists() for s in k.split("\n"))]:
        del memo[k]
    _save_memo(memo)


CRC_CHUNK = 8 << 20  # bytes per CRC-32: the pieces are hashed in parallel


def chunk_crcs(path: Path) -> list:
    """CRC-32 of each ``CRC_CHUNK``-byte piece of ``path``, in order (``[0]`` for an empty file).

    The file is memory-mapped (no copy; the pages are the ones a model mapping it uses) and
    the pieces hashed on up to 8 threads: zlib releases the GIL while it hashes.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return [0]
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm, memoryview(mm) as view:
            pieces = [view[i:i + CRC_CHUNK] for i in range(0, size, CRC_CHUNK)]
            try:
                workers = min(len(pieces), os.cpu_count() or 1, 8)
                if workers == 1:
                    return [zlib.crc32(p) for p in pieces]
                with ThreadPoolExecutor(workers) as pool:
                    return list(pool.map(zlib.crc32, pieces))
            finally:
                for p in pieces:
                    p.release()  # the map closes only once no view of it is left
