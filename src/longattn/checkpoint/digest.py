"""Content digests of checkpoint files, remembered per (path, size, mtime).

Cache entries (assembled sources, conversions, oracle copies) are keyed by what a file
holds, not where it lives: every fresh virtual environment installs the bundled packages
at a new path with new mtimes, and keying by path made each clone convert (and store) all
three models again, ~9 GB a time. Hashing 0.5 GB takes about a second, so the digest of a
file is remembered in ``$LONGATTN_CACHE/digests.json`` under its path, size and mtime and
recomputed only when one of those changes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .paths import atomic_write_path, cache_root

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
    with atomic_write_path(cache_root() / _MEMO_FILE) as tmp:
        tmp.write_text(json.dumps(memo, indent=0, sort_keys=True))


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
