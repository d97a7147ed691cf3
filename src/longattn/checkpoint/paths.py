"""The cache directory: where it is, whether it can be used, and writing into it safely.

A crash never leaves a half-written entry behind, a killed process's temporaries are removed
by the next run, and two processes filling the same entry both succeed:
- every temporary is named ``.tmp-<host>-<pid>-<start time>-<random>``, so a later run can
  tell whether its owner is still alive (pid reuse is caught by the start time) and remove
  it when not;
- entries are staged in such a temporary and renamed into place; when another process has
  put a complete entry there first, that one is kept (it may be reading it) and ours is
  discarded, since entries are keyed by content and so hold the same thing;
- an unusable ``$LONGATTN_CACHE`` (a file, under a file, read-only) is noticed before any
  slow work: the run falls back to a private temporary cache with one warning, or refuses
  when there is none.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import stat
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

from ..errors import LongattnError

TMP_PREFIX = ".tmp-"
# A temporary whose name carries no owner (an older layout) is stale once this old.
UNOWNED_STALE_SECONDS = 3600
_roots: dict = {}  # configured root -> the root this process uses (checked and swept once)


def configured_cache() -> Path:
    """``$LONGATTN_CACHE`` or ``~/.cache/longattn``, as configured (not created, not checked)."""
    return Path(os.path.expanduser(os.environ.get("LONGATTN_CACHE") or Path.home() / ".cache" / "longattn"))


def _host() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ("0" where /proc cannot tell)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return text.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "0"


def owner_tag(pid: Optional[int] = None) -> str:
    """``<host>-<pid>-<start time>``: names this process in temporaries and locks."""
    pid = os.getpid() if pid is None else pid
    return f"{_host()}-{pid}-{_start_time(pid)}"


def owner_alive(tag: str) -> bool:
    """False only when the process that ``tag`` names is certainly gone (same host, and
    no process with that pid, or one started at another time)."""
    try:
        host, pid_s, start = tag.split("-")[:3]
        pid = int(pid_s)
    except ValueError:
        return True
    if host != _host():
        return True  # another machine sharing the cache: cannot tell
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    now = _start_time(pid)
    return start == "0" or now == "0" or now == start


def temp_prefix() -> str:
    """Prefix of a temporary this process owns."""
    return f"{TMP_PREFIX}{owner_tag()}-"


def _stale(entry: Path) -> bool:
    tag = entry.name[len(TMP_PREFIX):]
    parts = tag.split("-")
    if len(parts) >= 4 and parts[1].isdigit():
        return not owner_alive(tag)
    try:  # no owner recorded: judged by age
        return time.time() - entry.lstat().st_mtime > UNOWNED_STALE_SECONDS
    except OSError:
        return False


def remove_path(p: Path) -> None:
    """Delete a file or a directory tree, ignoring what is already gone."""
    for _ in range(2):  # a second pass catches files a dying writer added meanwhile
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                p.unlink()
        if not os.path.lexists(p):
            return


def sweep_stale(directory: Path) -> list:
    """Remove temporaries in ``directory`` whose owner process is gone; returns their paths."""
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(TMP_PREFIX) and _stale(entry):
            remove_path(entry)
            removed.append(entry)
    return removed


def sweep_cache(root: Path) -> list:
    """``sweep_stale`` over the cache root and each of its top-level directories."""
    removed = sweep_stale(root)
    with contextlib.suppress(OSError):
        for d in root.iterdir():
            if d.is_dir() and not d.name.startswith(TMP_PREFIX):
                removed += sweep_stale(d)
    return removed


def cache_problem(root: Path) -> Optional[str]:
    """Why ``root`` cannot hold the cache (a file, under a file, not writable), or None.

    Probes by creating the directory and a temporary file in it: permission bits do not tell
    a read-only filesystem, nor what root may write.
    """
    p = root
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    if p.exists() and not p.is_dir():
        return f"{p} is a file, not a directory" if p == root else f"{root} lies under {p}, which is a file"
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=temp_prefix(), dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{root} is not writable ({e.strerror or e})"
    return None


def _private_fallback() -> Path:
    """A per-user cache under the temporary directory, used only when it is ours alone (a
    directory another user could write into might hold a planted kernel library)."""
    fallback = Path(tempfile.gettempdir()) / f"longattn-cache-{os.getuid()}"
    try:
        fallback.mkdir(mode=0o700, exist_ok=True)
        st = fallback.lstat()
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022:
            return fallback
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="longattn-cache-"))


def cache_root() -> Path:
    """The cache directory this process writes to: ``configured_cache()`` when usable,
    else a private temporary cache (one warning naming why). Stale temporaries under it
    are removed on the first call.

    Raises:
        LongattnError: neither the configured nor a temporary cache can be written.
    """
    configured = configured_cache()
    root = _roots.get(configured)
    if root is not None and root.is_dir():
        return root
    why = cache_problem(configured)
    root = configured
    if why is not None:
        try:
            root = _private_fallback()
        except OSError as e:
            raise LongattnError(f"cache directory unusable: {why}, and no temporary directory "
                                f"can be made ({e.strerror or e}); set LONGATTN_CACHE to a writable "
                                "directory") from None
        if cache_problem(root) is not None:
            raise LongattnError(f"cache directory unusable: {why}, and so is {root}; set "
                                "LONGATTN_CACHE to a writable directory")
        warnings.warn(f"cache directory unusable: {why}; using {root} for now (set LONGATTN_CACHE "
                      "to a writable directory to keep conversions)", stacklevel=2)
    sweep_cache(root)
    _roots[configured] = root
    return root


@contextlib.contextmanager
def atomic_write_path(target: Path):
    """Yield a temporary path next to ``target``; rename it into place only on success."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(), dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def publish_dir(tmp: Path, target: Path, complete: Callable[[Path], bool]) -> None:
    """Rename the finished directory ``tmp`` to ``target``. When ``target`` exists and is
    ``complete`` it stays (another process put it there and may be reading it) and ``tmp``
    is left for the caller to delete; an incomplete one is moved aside and replaced."""
    try:
        os.rename(tmp, target)  # fails when target is a non-empty directory
        return
    except OSError:
        if not target.exists():
            raise
    if complete(target):
        return
    aside = Path(tempfile.mkdtemp(prefix=temp_prefix(), dir=target.parent))
    os.rename(target, aside / "old")
    os.rename(tmp, target)
    remove_path(aside)


@contextlib.contextmanager
def atomic_dir(target: Path, complete: Optional[Callable[[Path], bool]] = None):
    """Yield a temporary directory next to ``target``; put it in place on success.

    ``complete(path)`` says whether an existing ``target`` is a finished entry (default: it
    exists); a finished one is kept and the new one discarded (see ``publish_dir``).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(), dir=target.parent))
    try:
        yield tmp
        publish_dir(tmp, target, complete or (lambda p: p.exists()))
    finally:
        if tmp.exists():
            remove_path(tmp)


def _existing_cache() -> Optional[Path]:
    """The configured cache for reporting or clearing: None when it does not exist yet.

    Raises:
        LongattnError: it is a file or lies under one.
    """
    root = configured_cache()
    p = root
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    if p.exists() and not p.is_dir():
        raise LongattnError(f"cache directory {root} is unusable: "
                            + (f"{p} is a file" if p == root else f"it lies under {p}, which is a file")
                            + "; set LONGATTN_CACHE to a directory")
    return root if root.is_dir() else None


def cache_usage() -> dict:
    """Bytes under each top-level entry of the configured cache (converted, oracle, sources,
    kernels...); empty when it does not exist. Reads only: a read-only cache can be listed."""
    root = _existing_cache()
    out = {}
    for d in sorted(root.iterdir()) if root is not None else []:
        files = [d] if d.is_file() else [f for f in d.rglob("*") if f.is_file()]
        out[d.name] = sum(f.stat().st_size for f in files)
    return out


def clear_cache() -> int:
    """Delete everything under the configured cache dir; returns the bytes freed. Every
    entry is rebuilt on demand (conversions take tens of seconds per model, the kernels
    about half a minute).

    Raises:
        LongattnError: the cache cannot be written (checked before anything is deleted).
    """
    root = _existing_cache()
    if root is None:
        return 0
    why = cache_problem(root)
    if why is not None:
        raise LongattnError(f"cannot clear the cache: {why}")
    freed = sum(cache_usage().values())
    for d in root.iterdir():
        remove_path(d)
    return freed


class LockTimeout(Exception):
    """``held_lock`` waited ``timeout`` seconds; ``owner`` is what the holder recorded."""

    def __init__(self, owner: str):
        super().__init__(owner)
        self.owner = owner


@contextlib.contextmanager
def held_lock(path: Path, timeout: float, on_wait: Optional[Callable[[str], None]] = None):
    """Hold an exclusive lock on ``path`` (created if missing) for the ``with`` block.

    The kernel releases the lock when its holder exits, however it dies, so a killed process
    never blocks the next one; the file records the holder (``owner_tag``) for messages.
    ``on_wait(owner)`` is called once if another process holds it.

    Raises:
        LockTimeout: still held by another process after ``timeout`` seconds.
    """
    import fcntl
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline, told = time.monotonic() + timeout, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                if time.monotonic() >= deadline:
                    raise LockTimeout(owner) from None
                if not told and on_wait is not None:
                    on_wait(owner)
                    told = True
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, owner_tag().encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
