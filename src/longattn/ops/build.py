"""Building a C++ extension into the cache so that no interruption can block a later run.

- One builder at a time per build directory: a kernel lock (``paths.held_lock``) that is
  released when its holder dies, however it dies; a waiting process says whom it waits for.
- The compiler runs in a child process in its own temporary directory (named for this
  process, so the next run removes it if this one is killed) with a time limit; only a
  finished library is renamed into place, so a half-built directory is never loaded and
  torch's own build lock (which a killed build leaves behind for ever) lives only inside
  that private temporary.
- The build's processes end with it, however this process ends. The child leads a process
  group of its own (ninja runs in it) and asks the kernel for SIGTERM when its parent dies
  (``PR_SET_PDEATHSIG``: Linux, and a kill -9 included); on SIGTERM it passes the signal to
  its group and exits. ninja, so signalled, stops the compilers it started (each in a process
  group of ninja's, out of reach of a signal to ours) and waits for them. Ctrl-C, a time
  limit or an exception here sends the same SIGTERM, and SIGKILL to whatever of the group
  outlives a grace period.
- A build that fails or runs out of time raises BuildError; callers fall back to PyTorch ops.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.paths import LockTimeout, atomic_dir, held_lock

DEFAULT_TIMEOUT_S = 900.0  # a cold build on a loaded two-core machine takes a few minutes
PR_SET_PDEATHSIG = 1


class BuildError(Exception):
    """The extension could not be built (message: why, in one line)."""


@dataclass(frozen=True)
class ExtensionSpec:
    """What to compile: the library ``<name>.so`` from ``sources`` with these flags."""
    name: str
    sources: tuple
    cflags: tuple = ()
    ldflags: tuple = ()
    announce: str = ""  # printed to stderr when a build starts
    env: dict = field(default_factory=dict)  # extra environment for the compiler child


def build_timeout() -> float:
    """Seconds a build may take: ``$LONGATTN_BUILD_TIMEOUT`` or DEFAULT_TIMEOUT_S."""
    try:
        return float(os.environ.get("LONGATTN_BUILD_TIMEOUT") or DEFAULT_TIMEOUT_S)
    except ValueError:
        return DEFAULT_TIMEOUT_S


def library_path(spec: ExtensionSpec, build_dir: Path) -> Path:
    return build_dir / f"{spec.name}.so"


def ensure_built(spec: ExtensionSpec, build_dir: Path, timeout: float | None = None) -> Path:
    """Path of ``build_dir/<name>.so``, building it first when missing.

    Raises:
        BuildError: the build failed, or it (or another process's) did not finish in time.
    """
    so = library_path(spec, build_dir)
    if so.exists():
        return so
    timeout = build_timeout() if timeout is None else timeout

    def waiting(owner: str) -> None:
        print(f"longattn: waiting for process {owner} to finish building {spec.name}",
              file=sys.stderr, flush=True)
    try:
        with held_lock(build_dir.parent / f"{build_dir.name}.lock", timeout, on_wait=waiting):
            if so.exists():  # built by the process we waited for
                return so
            if spec.announce:
                print(f"longattn: {spec.announce}", file=sys.stderr, flush=True)
            with atomic_dir(build_dir, complete=lambda d: library_path(spec, d).exists()) as tmp:
                _compile(spec, tmp, timeout)
    except LockTimeout as e:
        raise BuildError(f"process {e.owner} has been building {spec.name} for over "
                         f"{timeout:.0f} s") from None
    return so


def _die_with_parent() -> None:
    """In the build child, before it runs: lead a new process group, and get SIGTERM when
    the parent dies (Linux; elsewhere only the parent's own cleanup in ``run_in_group`` stops it)."""
    os.setsid()
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


# Run first in the build child, before the slow imports: SIGTERM (the parent's, or the one
# PR_SET_PDEATHSIG sends when the parent dies) is passed to the whole group, ninja included,
# and ends the child. A parent that died before the request was made is caught by its pid.
CHILD_PRELUDE = ("import os, signal, sys\n"
                 "def _end(signum, frame):\n"
                 "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                 "    os.killpg(0, signal.SIGTERM)\n"
                 "    os._exit(128 + signum)\n"
                 "signal.signal(signal.SIGTERM, _end)\n"
                 "if os.getppid() != int(os.environ['LONGATTN_BUILD_PARENT']):\n"
                 "    _end(signal.SIGTERM, None)\n")
_CHILD = CHILD_PRELUDE + ("import json\n"
                          "from torch.utils.cpp_extension import load\n"
                          "load(**json.loads(sys.argv[1]))\n")
STOP_GRACE_S = 10.0  # after SIGTERM, how long ninja may take to stop its compilers


def run_in_group(argv: list, env: dict, timeout: float) -> tuple:
    """Run ``argv`` (a Python child that starts with CHILD_PRELUDE) as the leader of its own
    process group; ``(returncode, output)``, stdout and stderr together.

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout`` seconds; the group was stopped.
    """
    proc = subprocess.Popen(argv, env=dict(env, LONGATTN_BUILD_PARENT=str(os.getpid())),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    try:
        log, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:  # timed out, interrupted or failed here: stop the whole group
            stop_group(proc)
    return proc.returncode, log


def stop_group(proc: subprocess.Popen) -> None:
    """Stop ``proc``'s process group and reap ``proc``: SIGTERM (ninja stops its compilers on
    it, and exits once they have), then SIGKILL to whatever of the group is still there after
    STOP_GRACE_S. ninja is given the grace rather than killed at once: killed, it would leave
    its compilers, which sit in process groups of their own, running."""
    deadline = time.monotonic() + STOP_GRACE_S
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)
    while time.monotonic() < deadline and _group_alive(proc.pid):
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a member that is no longer ours to signal: not ours to wait for
        return False


def _compile(spec: ExtensionSpec, out: Path, timeout: float) -> None:
    args = dict(name=spec.name, sources=[str(s) for s in spec.sources], build_directory=str(out),
                extra_cflags=list(spec.cflags), extra_ldflags=list(spec.ldflags),
                is_python_module=False, verbose=False)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **spec.env)
    try:
        code, log = run_in_group([sys.executable, "-c", _CHILD, json.dumps(args)], env, timeout)
    except subprocess.TimeoutExpired:
        raise BuildError(f"building {spec.name} did not finish within {timeout:.0f} s "
                         "(set LONGATTN_BUILD_TIMEOUT to allow longer)") from None
    if code != 0 or not library_path(spec, out).exists():
        lines = [l for l in log.decode(errors="replace").splitlines() if l.strip()]
        why = next((l for l in reversed(lines) if "error" in l.lower()), lines[-1] if lines else "")
        raise BuildError(f"building {spec.name} failed (exit {code}): {why.strip()[:300]}")
