"""Building a C++ extension into the cache so that no interruption can block a later run.

- One builder at a time per build directory: a kernel lock (``paths.held_lock``) that is
  released when its holder dies, however it dies; a waiting process says whom it waits for.
- The compiler runs in a child process in its own temporary directory (named for this
  process, so the next run removes it if this one is killed) with a time limit; only a
  finished library is renamed into place, so a half-built directory is never loaded and
  torch's own build lock (which a killed build leaves behind for ever) lives only inside
  that private temporary.
- A build that fails or runs out of time raises BuildError; callers fall back to PyTorch ops.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
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
    """In the compiler child: start a process group, and get SIGKILL when the parent dies."""
    os.setsid()
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


_CHILD = ("import json, sys\n"
          "from torch.utils.cpp_extension import load\n"
          "load(**json.loads(sys.argv[1]))\n")


def _compile(spec: ExtensionSpec, out: Path, timeout: float) -> None:
    args = dict(name=spec.name, sources=[str(s) for s in spec.sources], build_directory=str(out),
                extra_cflags=list(spec.cflags), extra_ldflags=list(spec.ldflags),
                is_python_module=False, verbose=False)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **spec.env)
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=_die_with_parent)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BuildError(f"building {spec.name} did not finish within {timeout:.0f} s "
                         "(set LONGATTN_BUILD_TIMEOUT to allow longer)") from None
    finally:
        if proc.poll() is None:  # timed out or interrupted: stop the compiler's whole group
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    if proc.returncode != 0 or not library_path(spec, out).exists():
        lines = [l for l in log.decode(errors="replace").splitlines() if l.strip()]
        why = next((l for l in reversed(lines) if "error" in l.lower()), lines[-1] if lines else "")
        raise BuildError(f"building {spec.name} failed (exit {proc.returncode}): {why.strip()[:300]}")
