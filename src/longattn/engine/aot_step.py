"""The static decode step built ahead of time: one AOTInductor package per step structure, cached.

``torch.compile`` traces the step in every new process (dynamo, ~15 s warm, 1.5-2 minutes
cold). Here the step is exported once (``torch.export``, the KV buffers as inputs, the
full-attention buffers' length a symbol), compiled by AOTInductor into a shared library without
the weights, and written to
``$LONGATTN_CACHE/steps/<key>/step.pt2``; later processes load it in milliseconds and hand it
the model's own weight tensors (``load_constants(user_managed=True)``: no copy, so prepared
weights stay memory-mapped).

The package depends on the model's structure, not its weight values, so the key hashes what
the generated code depends on: the config, the weight format, each layer's attention, the batch,
which layers share a buffer and which buffers are rings, the attention kernel, torch's version, the native kernels' build, the CPU's
vector capability (inductor vectorizes for it) and the thread count (written into its loops).
Another source file of the same model in the same format reuses the package (its weights come
from the prepared-weights cache, which is keyed by the source); another format, policy, shape,
machine or kernel build gets its own. Entries are written atomically with a checksum
(``paths.atomic_dir``): a killed build leaves nothing in place, and a damaged entry is rebuilt
with a warning.

Torch's own temporaries stay inside the cache and last no longer than the call that makes them:
a build's inductor cache (some 300 MB, the precompiled header mostly; the package holds all a
later process needs) and a load's extracted package (the C++ loader unpacks it into
``$TMPDIR/aotinductor_*`` and removes that only in its destructor, which a process ending with
``os._exit`` never runs) each go to a private ``steps/.tmp-*`` directory, removed as soon as the
library is built or mapped, and swept by the next run when a killed process leaves one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

from ..checkpoint.digest import content_digest
from ..checkpoint.load import CHECKSUM, discard_entry, entry_intact
from ..checkpoint.paths import atomic_dir, cache_root, hold_entry, remove_path, temp_prefix
from ..errors import LongattnError
from ..ops import native

class AOTBuildError(LongattnError):
    """The ahead-of-time step could not be built here (export or the C++ build failed);
    ``reason`` says why in a few words."""

    def __init__(self, reason: str):
        super().__init__(f"the ahead-of-time decode step could not be built ({reason}); "
                         "decode with the eager step (--compile none)")
        self.reason = reason


AOT_VERSION = "1"  # bump when the exported step's inputs, outputs or structure change
STEP_FILE = "step.pt2"


def step_key(decoder) -> str:
    """Cache key of ``decoder``'s step (see the module docstring for what it covers)."""
    model = decoder.model
    layers = [(lp.kind, lp.window, lp.sinks) for lp in decoder.policy.layers]
    kv = decoder.kv  # which layers share a buffer, and which buffers are rings (of what size)
    parts = {"version": AOT_VERSION, "config": dataclasses.asdict(model.config), "weights": model.weights,
             "dtype": str(model.activation_dtype), "layers": layers, "batch": decoder.batch,
             "groups": [kv.group_rings, kv.members], "attention": decoder.attention, "torch": torch.__version__,
             "kernels": native.build_tag(), "cpu": torch.backends.cpu.get_cpu_capability(),
             # inductor writes the thread count into its parallel loops
             "threads": torch.get_num_threads()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


class _ExportedStep(torch.nn.Module):
    """``forward(tokens [B], pos [B, 1], *kg, *vg, *posg) -> (logits [B, V], k_0, v_0, k_1, ...)``:
    the decoder's step with its KV buffers passed in (a package's inputs, not baked-in
    constants) and each group's stacked new keys and values returned."""

    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder
        self.model = decoder.model  # its parameters and buffers are the package's constants

    def forward(self, tokens, pos, *buffers):
        kv, g = self.decoder.kv, len(self.decoder.kv.kg)
        saved = kv.kg, kv.vg, kv.posg
        kv.kg, kv.vg, kv.posg = list(buffers[:g]), list(buffers[g:2 * g]), list(buffers[2 * g:])
        try:
            logits, pending = self.decoder._step_eager(tokens, pos)
        finally:
            kv.kg, kv.vg, kv.posg = saved
            kv.pending.clear()
        return (logits, *[t for pair in pending for t in pair])


@contextlib.contextmanager
def _quiet():
    """Hide torch's own deprecation notices from export and package loading (not the user's
    concern)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def _resolve(model, fqn: str):
    """The object the exported name ``fqn`` ("model.<attribute path>") names in ``model``:
    parameters, buffers and plain tensor attributes (export lifts those as constants)."""
    obj = model
    for part in fqn.split(".")[1:]:
        obj = getattr(obj, part, None)
    return obj


def _files(entry: Path) -> list:
    return [entry / STEP_FILE]


def _complete(entry: Path) -> bool:
    return (entry / STEP_FILE).exists() and (entry / CHECKSUM).exists()


def _inputs(kv, tokens: torch.Tensor, pos: torch.Tensor) -> list:
    """The package's inputs, in _ExportedStep.forward's order."""
    return [tokens, pos, *kv.kg, *kv.vg, *kv.posg]


def _example_inputs(decoder) -> tuple:
    return tuple(_inputs(decoder.kv, torch.zeros(decoder.batch, dtype=torch.int64),
                         torch.full((decoder.batch, 1), -1, dtype=torch.int64)))


def _dynamic_shapes(decoder) -> list:
    """The full-attention buffers' slot count is a symbol (ring buffers keep their fixed size),
    so one package serves every ``max_len``."""
    slots = torch.export.Dim("slots", min=2, max=1 << 24)
    full = [ring is None for ring in decoder.kv.group_rings]
    return [None, None, tuple([{3: slots} if f else None for f in full] * 2 + [{1: slots} if f else None for f in full])]


_ENV_LOCK = threading.RLock()  # one build or load at a time rewrites the process environment


@contextlib.contextmanager
def _scratch_env(**names):
    """Point each environment variable of ``names`` at its own subdirectory (the value) of one
    private temporary under the cache's ``steps/`` for the ``with`` block, then restore them and
    delete the temporary with whatever torch left in it. Python's own temporary directory is
    settled first, so the module ``tempfile`` never adopts the temporary."""
    tempfile.gettempdir()
    root = cache_root() / "steps"
    root.mkdir(parents=True, exist_ok=True)
    with _ENV_LOCK:
        tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(), dir=root))
        saved = {k: os.environ.get(k) for k in names}
        try:
            for k, sub in names.items():
                (tmp / sub).mkdir(exist_ok=True)
                os.environ[k] = str(tmp / sub)
            yield tmp
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            remove_path(tmp)


@contextlib.contextmanager
def _private_inductor_cache():
    """Inductor's cache and the compiler's temporaries for one build, deleted after it; the
    inductor memos that remember the cache's directory are cleared on the way in and out."""
    from torch._inductor.utils import clear_caches
    with _scratch_env(TORCHINDUCTOR_CACHE_DIR="inductor", TMPDIR="tmp"):
        clear_caches()
        try:
            yield
        finally:
            clear_caches()


def _open_package(path: Path):
    """The C++ loader of the package at ``path``, its library loaded. The package is unpacked
    into a private temporary that is deleted as soon as the loader has mapped the library (a
    mapping outlives its file), so no exit path leaves the unpacked copy behind."""
    with _scratch_env(TMPDIR="tmp"):
        # The C++ loader itself: torch._inductor.aoti_load_package imports inductor (~0.9 s) and
        # probes the CPU's vector ISA by compiling test programs (~1.2 s) only to warn on a
        # mismatch, which the key already rules out. Arguments: the package's model name, not
        # single-threaded, one runner, the CPU.
        return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)


def _build(module: torch.nn.Module, example_inputs: tuple, dynamic_shapes, entry: Path, progress: bool,
           what: str = "decode step", per: str = "model, format, policy and machine") -> None:
    """Export ``module`` on ``example_inputs`` and compile it into the package at ``entry``."""
    if progress:
        print(f"-- building the ahead-of-time {what} (once per {per}; about a minute)", file=sys.stderr, flush=True)
    import torch._inductor  # only a build needs inductor (loading does not import it)
    import torch.export
    t0 = time.perf_counter()
    try:
        with torch.no_grad(), _quiet(), _private_inductor_cache():
            ep = torch.export.export(module, example_inputs, dynamic_shapes=dynamic_shapes, strict=False)
            with atomic_dir(entry, complete=_complete) as tmp:
                torch._inductor.aoti_compile_and_package(
                    ep, package_path=str(tmp / STEP_FILE),
                    # the weights stay out of the library: each process passes the model's own tensors
                    inductor_configs={"aot_inductor.package_constants_in_so": False})
                (tmp / CHECKSUM).write_text(json.dumps({"sha256": content_digest(_files(tmp), remember=False)}))
    except Exception as e:  # export or the C++ build failed: say so in one line, leave nothing
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise AOTBuildError(f"{type(e).__name__}: {first[:200]}") from None
    if progress:
        print(f"-- built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


def load_package(model: torch.nn.Module, key: str, build, progress: bool = True):
    """The C++ loader of the cached package ``key``, built first by ``build(entry, progress)``
    where it is missing or damaged, with ``model``'s own tensors bound as its constants
    (user-managed: no copy; they must outlive the loader).

    The exported module must hold ``model`` as its attribute ``model``: the package names its
    constants "model.<attribute path>"."""
    if not native.available():
        raise LongattnError("the ahead-of-time step calls longattn's native kernels, which are not "
                            "built here (or --reference is set); use --compile or the eager path")
    entry = cache_root() / "steps" / key
    if _complete(entry) and not entry_intact(entry, _files):
        warnings.warn(f"ahead-of-time step {entry} is damaged (checksum mismatch); building it again",
                      stacklevel=3)
        discard_entry(entry)
    if not _complete(entry):
        build(entry, progress)
    hold = hold_entry(entry)
    if hold is None:  # a --clear-cache took it out since: build it again
        build(entry, progress)
        hold = hold_entry(entry)
    with hold or contextlib.nullcontext():  # clear-cache keeps it while the library is mapped
        loader = _open_package(entry / STEP_FILE)
    tensors = {f: _resolve(model, f) for f in loader.get_constant_fqns()}
    missing = [f for f, t in tensors.items() if not isinstance(t, torch.Tensor)]
    if missing:
        raise LongattnError(f"the ahead-of-time step {entry} expects tensors the model lacks: {missing[:3]}")
    # user-managed: the package reads the model's tensors in place (they must outlive it);
    # then: not the inactive buffer, check that every constant is set, no copy to a device
    loader.load_constants({f: t.detach() for f, t in tensors.items()}, False, True, True, False)
    return loader


class AOTStep:
    """A loaded package bound to ``decoder``'s model: ``self(tokens, pos) -> (logits [B, V],
    per group the stacked (k, v) of the step)``, like ``StaticDecoder._step_eager``.

    Args:
        decoder: a StaticDecoder (its buffers decide the shapes; window and dense layers only).
        key: ``step_key(decoder)`` where the caller has it already.
        progress: print a line on stderr while a package is built.
    """

    def __init__(self, decoder, key: str | None = None, progress: bool = True):
        self.decoder = decoder
        self.key = step_key(decoder) if key is None else key
        self.path = cache_root() / "steps" / self.key / STEP_FILE
        self.loader = load_package(decoder.model, self.key, lambda entry, progress: _build(
            _ExportedStep(decoder), _example_inputs(decoder), _dynamic_shapes(decoder), entry, progress), progress)

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor):
        kv = self.decoder.kv
        # the inputs and outputs are flat already: no pytree specs to parse on every call
        out = self.loader.boxed_run(_inputs(kv, tokens, pos))
        return out[0], [(out[1 + 2 * g], out[2 + 2 * g]) for g in range(len(kv.kg))]
