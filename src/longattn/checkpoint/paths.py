"""Cache directory and atomic writes (a crash never leaves a half-written entry behind)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """``$LONGATTN_CACHE`` or ``~/.cache/longattn``."""
    root = Path(os.environ.get("LONGATTN_CACHE") or Path.home() / ".cache" / "longattn")
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def atomic_write_path(target: Path):
    """Yield a temporary path next to ``target``; rename it into place only on success."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_dir(target: Path):
    """Yield a temporary directory next to ``target``; rename it into place on success."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def cache_usage() -> dict:
    """Bytes under each top-level entry of the cache dir (converted, oracle, sources, kernels...)."""
    root = cache_root()
    out = {}
    for d in sorted(root.iterdir()):
        files = [d] if d.is_file() else [f for f in d.rglob("*") if f.is_file()]
        out[d.name] = sum(f.stat().st_size for f in files)
    return out


def clear_cache() -> int:
    """Delete everything under the cache dir; returns the bytes freed. Every entry is rebuilt
    on demand (conversions take tens of seconds per model, the int8 kernel ~10 s)."""
    root = cache_root()
    freed = sum(cache_usage().values())
    for d in root.iterdir():
        if d.is_dir():
            shutil.rmtree(d)
        else:
            d.unlink()
    return freed
