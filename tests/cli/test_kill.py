"""A process killed (SIGKILL) at a random point of a conversion or a kernel build leaves
nothing that blocks, breaks or litters the next run: that run succeeds and no temporary is
left. The kernel build is exercised on a one-function test extension built by the same
machinery as the real kernels (ops/build.py), so each build takes seconds, not a minute."""

from __future__ import annotations

import ctypes
import fcntl
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_helpers import stale_temporaries
from longattn.checkpoint import paths
from longattn.ops.build import BuildError, ExtensionSpec, ensure_built
from tiny_gguf import write_tiny_gguf

SEEDS = [0, 1, 2]


def _child(code: str, cache: Path, *args) -> subprocess.Popen:
    env = dict(os.environ, LONGATTN_CACHE=str(cache), LONGATTN_NATIVE="off",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def _kill_after_ready(p: subprocess.Popen, delay: float) -> bool:
    """Wait for the child's "ready" line, then SIGKILL it ``delay`` s later; True if it was
    still running when killed."""
    assert p.stdout.readline().strip() == "ready"
    time.sleep(delay)
    alive = p.poll() is None
    p.kill()
    p.wait()
    return alive


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("LONGATTN_CACHE", str(root))
    monkeypatch.setattr(paths, "_roots", {})  # the next run sweeps, as a new process would
    return root


# The child converts a first file before it says "ready" (so every lazy import is done) and
# writes each entry slowly (a pause before its checksum, the last file), so that most kill
# points land while a temporary entry is half-written, the case that used to leave junk behind.
CONVERT = ("import sys, time\n"
           "import longattn.checkpoint.load as load\n"
           "from longattn.checkpoint import load_checkpoint\n"
           "load_checkpoint(sys.argv[1], progress=False)\n"
           "digest = load.content_digest\n"
           "load.content_digest = lambda *a, **k: (time.sleep(0.4), digest(*a, **k))[1]\n"
           "print('ready', flush=True)\n"
           "for f in sys.argv[2:]:\n"
           "    load_checkpoint(f, progress=False)\n")


@pytest.mark.parametrize("seed", SEEDS)
def test_conversion_killed_at_random_point(cache, tmp_path, seed):
    from longattn.checkpoint.load import _complete, load_checkpoint
    files = [write_tiny_gguf(tmp_path / f"m{i}.gguf", seed=10 * seed + i) for i in range(4)]
    rng = random.Random(seed)
    _kill_after_ready(_child(CONVERT, cache, *files), rng.uniform(0.05, 1.5))
    print("left by the killed conversion:", stale_temporaries(cache))
    for f in files:  # the next run
        ck = load_checkpoint(str(f), progress=False)
        assert ck.config.num_layers == 2 and ck.tokenizer is not None
    assert not stale_temporaries(cache)
    entries = list((cache / "converted").iterdir())
    assert len(entries) == len(files) and all(_complete(e) for e in entries)


TEST_SOURCE = 'extern "C" int longattn_test_answer() { return 42; }\n'
BUILD = ("import sys\n"
         "from pathlib import Path\n"
         "from longattn.ops.build import ExtensionSpec, ensure_built\n"
         "print('ready', flush=True)\n"
         "ensure_built(ExtensionSpec('longattn_test_ext', (sys.argv[1],)), Path(sys.argv[2]))\n")


def _spec(tmp_path: Path) -> ExtensionSpec:
    src = tmp_path / "answer.cpp"
    src.write_text(TEST_SOURCE)
    return ExtensionSpec("longattn_test_ext", (str(src),))


def _lock_is_free(build_dir: Path) -> bool:
    lock = build_dir.parent / f"{build_dir.name}.lock"
    if not lock.exists():
        return True
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False


@pytest.mark.parametrize("seed", SEEDS)
def test_kernel_build_killed_at_random_point(cache, tmp_path, seed):
    spec = _spec(tmp_path)
    build_dir = cache / "kernels" / "test-ext"
    if seed == 0:  # what older builds left: torch's build lock inside an unfinished directory
        build_dir.mkdir(parents=True)
        (build_dir / "lock").write_text("")
    rng = random.Random(seed)
    _kill_after_ready(_child(BUILD, cache, spec.sources[0], build_dir), rng.uniform(0.0, 4.0))
    print("left by the killed build:", stale_temporaries(cache))
    paths.cache_root()  # the next run starts by sweeping what dead processes left
    so = ensure_built(spec, build_dir, timeout=120)
    assert ctypes.CDLL(str(so)).longattn_test_answer() == 42
    assert not stale_temporaries(cache) and _lock_is_free(build_dir)
    assert sorted(p.name for p in (cache / "kernels").iterdir()) == ["test-ext", "test-ext.lock"]


def test_kernel_build_out_of_time_falls_back_cleanly(cache, tmp_path):
    spec = _spec(tmp_path)
    build_dir = cache / "kernels" / "slow"
    with pytest.raises(BuildError, match="did not finish within 0 s"):
        ensure_built(spec, build_dir, timeout=0.2)
    assert not build_dir.exists() and not stale_temporaries(cache) and _lock_is_free(build_dir)


# A compiler whose compile step never ends: it records its pid, then waits (as a cc1plus on a
# large source does for minutes). Other calls (torch asks for its version) go to the real one.
ENDLESS_CXX = """#!/bin/sh
for a in "$@"; do
  if [ "$a" = "-c" ]; then echo $$ >> "$LONGATTN_TEST_COMPILERS"; exec sleep 600; fi
done
exec {real} "$@"
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _as_in_a_terminal() -> None:
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a runner in the background may have it ignored


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the compiler dies with its parent on Linux")
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM", "SIGINT"])
def test_killed_build_takes_its_compilers_with_it(cache, tmp_path, sig):
    """A build killed while ninja's compiler runs: the compiler (in a process group of ninja's,
    which a signal to the build's group does not reach) is gone within seconds, not minutes."""
    import shutil
    import signal
    real = shutil.which("c++") or shutil.which("g++")
    if real is None or shutil.which("ninja") is None:
        pytest.skip("needs a C++ compiler and ninja")
    fake = tmp_path / "bin" / "g++"  # a name torch's compiler check accepts as it is
    fake.parent.mkdir()
    fake.write_text(ENDLESS_CXX.format(real=real))
    fake.chmod(0o755)
    pids = tmp_path / "compilers"
    env = dict(os.environ, LONGATTN_CACHE=str(cache), CXX=str(fake), LONGATTN_TEST_COMPILERS=str(pids),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    build = subprocess.Popen([sys.executable, "-c", BUILD, _spec(tmp_path).sources[0], cache / "kernels" / "t"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             preexec_fn=_as_in_a_terminal)
    compiler = None
    try:
        deadline = time.monotonic() + 120
        while compiler is None and time.monotonic() < deadline and build.poll() is None:
            time.sleep(0.1)
            compiler = int(pids.read_text().split()[0]) if pids.exists() and pids.read_text().strip() else None
        assert compiler is not None and _running(compiler), "the build never reached its compiler"
        build.send_signal(getattr(signal, sig))
        build.wait(timeout=60)
        deadline = time.monotonic() + 20
        while _running(compiler) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(compiler), f"the compiler outlived the build killed by {sig}"
    finally:
        if build.poll() is None:
            build.kill()
            build.wait()
        if compiler is not None and _running(compiler):
            os.kill(compiler, signal.SIGKILL)


def test_waiting_for_a_live_builder_times_out_with_its_name(cache, tmp_path, capfd):
    build_dir = cache / "kernels" / "busy"
    with paths.held_lock(build_dir.parent / "busy.lock", timeout=1):
        with pytest.raises(BuildError, match=f"process {paths.owner_tag()} has been building"):
            ensure_built(_spec(tmp_path), build_dir, timeout=0.5)
    assert "waiting for process" in capfd.readouterr().err
    assert not build_dir.exists()


def test_two_processes_convert_the_same_file(cache, tmp_path):
    """Both finish; one entry stays (the second keeps the first's, which may be read)."""
    from longattn.checkpoint.load import _complete, entry_intact
    warm, f = (write_tiny_gguf(tmp_path / f"{n}.gguf", seed=s) for n, s in (("w", 1), ("m", 2)))
    both = [_child(CONVERT, cache, warm, f) for _ in range(2)]
    for p in both:
        assert p.stdout.readline().strip() == "ready"
    assert [p.wait(timeout=120) for p in both] == [0, 0]
    entries = list((cache / "converted").iterdir())
    assert len(entries) == 2 and all(_complete(e) and entry_intact(e) for e in entries)
    assert not stale_temporaries(cache)


# The child prepares int8 weights of each file, writing each entry slowly (a pause after the
# weights) so that most kill points land while a prepared entry is half-written.
PREPARE = ("import sys, time\n"
           "import torch\n"
           "from longattn.checkpoint import load_checkpoint\n"
           "from longattn.checkpoint.prepared import prepared_model\n"
           "def ck(f): return load_checkpoint(f, progress=False, read_weights=False)\n"
           "prepared_model(ck(sys.argv[1]), 'int8', progress=False)\n"
           "save = torch.save\n"
           "torch.save = lambda *a, **k: (save(*a, **k), time.sleep(0.4))\n"
           "print('ready', flush=True)\n"
           "for f in sys.argv[2:]:\n"
           "    prepared_model(ck(f), 'int8', progress=False)\n")


@pytest.mark.parametrize("seed", SEEDS)
def test_weight_preparation_killed_at_random_point(cache, tmp_path, seed):
    import torch
    from longattn.checkpoint import load_checkpoint
    from longattn.checkpoint.prepared import prepared_model
    from longattn.models import build_model
    warm = write_tiny_gguf(tmp_path / "w.gguf", seed=99)
    files = [write_tiny_gguf(tmp_path / f"m{i}.gguf", seed=10 * seed + i) for i in range(3)]
    rng = random.Random(seed)
    _kill_after_ready(_child(PREPARE, cache, warm, *files), rng.uniform(0.05, 1.5))
    print("left by the killed preparation:", stale_temporaries(cache))
    paths.cache_root()  # the next run sweeps what the dead process left
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    for f in files:
        ck = load_checkpoint(str(f), progress=False)
        want = build_model(ck.config, ck.state_dict, weights="int8")(ids)
        got = prepared_model(load_checkpoint(str(f), progress=False, read_weights=False), "int8", progress=False)
        assert torch.equal(got(ids), want)
    assert not stale_temporaries(cache)
    assert len(list((cache / "prepared").iterdir())) == len(files) + 1
