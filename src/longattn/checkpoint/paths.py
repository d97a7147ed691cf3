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
  when there is none;
- a write that fails for want of room or permission (a full disk, a quota, a read-only or
  foreign directory) ends in one CacheWriteError naming the cache directory, its free space
  and ``LONGATTN_CACHE``, with the temporary removed;
- a process reading an entry holds a shared lock on it (``hold_entry``) for as long as it uses
  the entry's files, and ``clear_cache`` leaves such entries, and temporaries of live
  processes, in place: clearing never pulls a file from under a running process.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import socket
import stat
import tempfile
import time
import warnings
import weakref
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


class CacheWriteError(LongattnError, OSError):
    """Writing into the cache failed for want of room or permission (``errno`` says which);
    the message names the cache directory and what to do. An OSError too, so callers that
    fall back on a failed write (the native kernels' build) still do."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.errno = code


# Why a write into the cache can fail that the user, not longattn, has to change.
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EROFS, errno.EACCES)


def _write_errno(e: BaseException) -> Optional[int]:
    """The errno of a failed write: an OSError's, or the ``(os error N)`` that libraries written
    in Rust (tokenizers) put in their message."""
    if isinstance(e, OSError):
        return e.errno
    m = re.search(r"\(os error (\d+)\)", str(e))
    return int(m.group(1)) if m else None


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _write_failure(target: Path, code: int) -> str:
    """One line: what could not be written where, and how to give the cache room."""
    root = next((r for r in (configured_cache(), *_roots.values()) if target.is_relative_to(r)), target.parent)
    what, why = target.relative_to(root), os.strerror(code)
    if code in _NO_ROOM:
        try:
            free = _size(shutil.disk_usage(root).free)
        except OSError:
            free = "unknown"
        return (f"cannot write {what} into the cache directory {root}: {why} ({free} free there); "
                "free some space, or set LONGATTN_CACHE to a directory with room")
    return (f"cannot write {what} into the cache directory {root}: {why}; "
            "set LONGATTN_CACHE to a writable directory")


def _elsewhere(e: BaseException, target: Path) -> bool:
    """``e`` names a file outside ``target``'s directory (a source read while writing it)."""
    name = getattr(e, "filename", None)
    return isinstance(name, (str, os.PathLike)) and \
        not Path(os.path.abspath(name)).is_relative_to(os.path.abspath(target.parent))


@contextlib.contextmanager
def _cache_write(target: Path):
    """Turn a failed write into ``target`` for want of room or permission into one
    CacheWriteError; any other error passes unchanged."""
    try:
        yield
    except LongattnError:
        raise
    except Exception as e:
        code = _write_errno(e)
        if code not in _NO_ROOM + _NOT_WRITABLE or _elsewhere(e, target):
            raise
        raise CacheWriteError(_write_failure(target, code), code) from None


def _temporary(parent: Path, make: Callable[[Path], Path]) -> Path:
    """``make(parent)``: a new temporary in ``parent``, which is created first."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return make(parent)
    except FileNotFoundError:  # clear_cache removed ``parent`` (empty) in between: once more
        parent.mkdir(parents=True, exist_ok=True)
        return make(parent)


def _temp_file(parent: Path) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(), dir=parent)
    os.close(fd)
    return Path(tmp)


def _temp_dir(parent: Path) -> Path:
    return Path(tempfile.mkdtemp(prefix=temp_prefix(), dir=parent))


@contextlib.contextmanager
def atomic_write_path(target: Path):
    """Yield a temporary path next to ``target``; rename it into place only on success.

    Raises:
        CacheWriteError: no room or no permission to write (the temporary is removed).
    """
    with _cache_write(target):
        tmp = _temporary(target.parent, _temp_file)
        try:
            yield tmp
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

    Raises:
        CacheWriteError: no room or no permission to write (the temporary is removed).
    """
    with _cache_write(target):
        tmp = _temporary(target.parent, _temp_dir)
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


class EntryHold:
    """A shared lock on one cache entry (a directory or a file), held while this process uses
    the entry's files: ``clear_cache`` leaves a held entry in place. Released by ``close()``,
    when ``keep_for``'s user is collected, or when the process ends, however it ends."""

    def __init__(self, fd: Optional[int]):
        # closes once, whichever comes first; None: an entry that could not be opened to lock
        self._closer = None if fd is None else weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        if self._closer is not None:
            self._closer()

    def keep_for(self, user) -> None:
        """Hold the entry as long as ``user`` lives (a model mapping the entry's files, a
        checkpoint that reads its source lazily)."""
        weakref.finalize(user, self.close)

    def __enter__(self) -> "EntryHold":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def hold_entry(entry: Path) -> Optional[EntryHold]:
    """A shared lock on the cache entry ``entry``, or None when there is none there (missing,
    or taken out by ``clear_cache`` while the lock was awaited). On a filesystem without
    locks the hold guards nothing, and the entry is used as it is."""
    import fcntl
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:  # there but not ours to open: its readers say why
        return EntryHold(None) if os.path.lexists(entry) else None
    hold = EntryHold(fd)
    with contextlib.suppress(OSError):  # waits only while clear_cache moves the entry aside
        fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        now = os.stat(entry)
    except FileNotFoundError:
        now = None
    held = os.fstat(fd)
    if now is None or (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
        hold.close()  # what we locked was taken out (and perhaps replaced) meanwhile
        return hold_entry(entry) if now is not None else None
    return hold


def _take_out(entry: Path, into: Path) -> bool:
    """Move the cache entry ``entry`` to ``into`` unless a live process uses it: a temporary
    it is writing, or an entry it holds (``hold_entry``). Returns whether it was kept."""
    import fcntl
    if entry.name.startswith(TMP_PREFIX) and not _stale(entry):
        return True
    try:  # no links followed, no FIFO waited on
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        fd = None  # a link or an unreadable file: nothing can hold it
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            except OSError:
                pass  # a filesystem without locks: removed as before
        with contextlib.suppress(FileNotFoundError):  # gone already: another clear
            os.rename(entry, into)
        return False
    finally:
        if fd is not None:
            os.close(fd)  # a reader waiting on the entry finds it gone (hold_entry)


def _bytes_under(p: Path) -> int:
    files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
    return sum(f.lstat().st_size for f in files)


def clear_cache() -> tuple:
    """Delete what the configured cache holds but the entries running processes use;
    returns ``(bytes freed, kept)``, ``kept`` naming those left (relative to the cache dir).

    An entry a process reads (``hold_entry``) or writes (a temporary of a live process) is
    kept: removing it would break that run, and a file still mapped frees no space anyway.
    Everything removed is rebuilt on demand (conversions take tens of seconds per model, the
    kernels about half a minute).

    Raises:
        LongattnError: the cache cannot be written (checked before anything is deleted).
    """
    root = _existing_cache()
    if root is None:
        return 0, []
    why = cache_problem(root)
    if why is not None:
        raise LongattnError(f"cannot clear the cache: {why}")
    aside = _temp_dir(root)  # entries are moved here at once, then deleted
    kept, n = [], 0
    try:
        for top in sorted(root.iterdir()):
            if top == aside:
                continue
            # each top-level directory (converted, prepared, sources...) holds entries
            holds = top.is_dir() and not top.is_symlink() and not top.name.startswith(TMP_PREFIX)
            try:
                entries = sorted(top.iterdir()) if holds else [top]
            except FileNotFoundError:  # taken out by another clear
                continue
            for entry in entries:
                n += 1
                if _take_out(entry, aside / str(n)):
                    kept.append(str(entry.relative_to(root)))
            if holds:
                with contextlib.suppress(OSError):  # stays while it keeps an entry
                    top.rmdir()
        freed = _bytes_under(aside)
    finally:
        remove_path(aside)
    return freed, kept


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
