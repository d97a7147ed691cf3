"""Prepared weights: a quantized model's tensors written once to the cache, memory-mapped after.

The first run with a weight recipe (``auto``, int8, int4, int5, bf16) reads the float32 weights
(a GGUF's tensor by tensor: one float32 tensor is held at a time, not the model's), builds the
quantized model (int4 and int5 take a GGUF's own 4- and 5-bit groups where it stores them) and
writes its state to ``$LONGATTN_CACHE/prepared/<key>/model.pt``, with the recipe it was built
with in ``recipe.json`` (what ``auto`` resolved to); every
later run maps that file and builds the model around it (models.prepared): no float32 copy,
no quantization, and the pages are the page cache's, shared by every process using the model.
The key hashes the float32 weights' content key (the source's digest and the converter
version), the weight recipe and the layout version, so a changed source file or another
format gets its own entry. The layout does not depend on the CPU (the kernels read the plain
int8 rows and the groups), so one entry serves every machine sharing the cache.

Entries are written like conversions (paths.atomic_dir, with a checksum written last): a
killed first run leaves nothing in place, and a full disk ends in one line naming the cache
(paths.CacheWriteError). The checksum holds the CRC-32s of the entry's files in 8 MiB pieces
(digest.chunk_crcs) and is checked on every load, so a byte changed in place, whatever its
file's size and mtime, is caught: the entry is rebuilt with a warning. The check reads the
pages the model maps anyway; with them cached it costs about 30 ms for SmolLM2's 95 MB on two
cores. A process holds its entry (paths.hold_entry) as long as its model lives, so clearing
the cache leaves the entry to it.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Mapping
from pathlib import Path

from ..errors import LongattnError
from .digest import chunk_crcs, remember_digest
from .load import CHECKSUM, LoadedCheckpoint, discard_entry
from .paths import atomic_dir, cache_root, hold_entry

# bump when the saved layout (module names, packing), its source, auto's rule or the checksum changes
PREPARED_VERSION = "5"
MODEL_FILE = "model.pt"


def prepared_key(weights_key: str, recipe: str) -> str:
    """Cache key of one checkpoint's weights in one format."""
    return hashlib.sha256(f"{weights_key}|{recipe}|{PREPARED_VERSION}".encode()).hexdigest()[:16]


RECIPE_FILE = "recipe.json"  # the recipe the state was built with (what ``auto`` resolved to)


def _files(entry: Path) -> list:
    return [entry / MODEL_FILE, entry / RECIPE_FILE]


def _complete(entry: Path) -> bool:
    return all((entry / f).exists() for f in (MODEL_FILE, RECIPE_FILE, CHECKSUM))


def _checksums(entry: Path) -> dict:
    """``{file name: CRC-32s of its pieces}`` of the entry's files (digest.chunk_crcs)."""
    return {f.name: chunk_crcs(f) for f in _files(entry)}


def _intact(entry: Path) -> bool:
    """The entry's files hold what was written: they hash to the checksum written with them."""
    try:
        return _checksums(entry) == json.loads((entry / CHECKSUM).read_text())["crc32"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _weights_proven(ck: LoadedCheckpoint) -> None:
    """Record what waited on the source's weights making a model: the source's digest in the
    memo, and the conversion this run made (LoadedCheckpoint.commit_conversion)."""
    ck.commit_conversion()
    if ck.unremembered is not None:
        remember_digest(*ck.unremembered)
        ck.unremembered = None


class _Counted(Mapping):
    """``weights`` moving a progress bar on at each tensor read."""

    def __init__(self, weights: Mapping, bar):
        self.weights, self.bar = weights, bar

    def __getitem__(self, key):
        t = self.weights[key]
        self.bar.update(1)
        return t

    def __iter__(self):
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


def _progress(weights: Mapping, desc: str, progress: bool) -> tuple:
    """``(weights, done)``: with ``progress``, a bar on stderr counting the tensors read,
    and ``done(note)`` to show the step after reading (``None`` closes the bar)."""
    if not progress:
        return weights, lambda note: None
    from tqdm import tqdm
    bar = tqdm(total=len(weights), desc=desc, unit="tensor", leave=True)

    def done(note):
        if note is None:
            bar.close()
        else:
            bar.set_postfix_str(note)
    return _Counted(weights, bar), done


def _stored_groups(ck: LoadedCheckpoint) -> dict:
    """The int4 and int5 groups a GGUF source stores (gguf_file.read_stored_groups); none for
    HF dirs."""
    if ck.source.is_dir():
        return {}
    from .gguf_file import read_stored_groups
    return read_stored_groups(ck.source)


def _matrices(weights: Mapping) -> list:
    """Names of the 2-D tensors of ``weights``, from the headers where it reads a file."""
    from .lazy_weights import LazyWeights
    shape = weights.shape if isinstance(weights, LazyWeights) else (lambda k: weights[k].shape)
    return [k for k in weights if len(shape(k)) == 2]


def resolve_recipe(ck: LoadedCheckpoint, recipe: str, weights: Mapping | None = None) -> tuple:
    """``(fmt, kinds, stored)`` to build ``recipe`` from (build_model's arguments): ``auto``
    becomes its concrete recipe for this checkpoint (models.weights.auto_recipe); int4 and
    int5 take the checkpoint's own groups where it stores them. ``weights``: ``ck.weights()``
    where the caller has it."""
    from ..models.weights import AUTO, QUANTIZED, auto_recipe, parse_recipe
    fmt, kinds = parse_recipe(recipe)
    grouped = {fmt, *(f for _, f in kinds)} & {AUTO, "int4", "int5"}
    stored = _stored_groups(ck) if grouped else {}
    if fmt == AUTO:
        matrices = _matrices(ck.weights() if weights is None else weights)
        fmt, kinds = parse_recipe(auto_recipe(matrices, {k: f for k, (f, _) in stored.items()}))
    return fmt, kinds, (stored if fmt in QUANTIZED else {})


def prepared_model(ck: LoadedCheckpoint, recipe: str, progress: bool = True):
    """The model of ``ck`` with ``recipe`` weights (models.weights), from the prepared cache.

    f32 (and any checkpoint without a content key) is built from the float32 weights as
    before. Otherwise the entry is mapped when present and intact, else built once (a
    progress line on stderr) and written. The model gives the same outputs either way.
    ``auto`` is keyed as written; its entry records the recipe it resolved to (``recipe.json``).
    """
    import torch

    from ..models import build_model
    from ..models.prepared import PREPARED_FORMATS
    from ..models.weights import AUTO, parse_recipe, recipe_name
    fmt, kinds = parse_recipe(recipe)
    if (fmt not in PREPARED_FORMATS and fmt != AUTO) or ck.weights_key is None:
        weights = ck.weights()
        fmt, kinds, stored = resolve_recipe(ck, recipe, weights)
        # a bar while the source is read (not for weights in memory already)
        weights, done = _progress(weights, f"reading {ck.name} in {fmt}", progress and not isinstance(weights, dict))
        model = build_model(ck.config, weights, weights=fmt, kinds=kinds, stored=stored)
        done(None)
        ck.commit_conversion()
        return model
    canonical = AUTO if fmt == AUTO else recipe_name(fmt, kinds)
    entry = cache_root() / "prepared" / prepared_key(ck.weights_key, canonical)
    model = _mapped(ck, entry)
    if model is not None:
        _weights_proven(ck)
        return model
    # read tensor by tensor (a GGUF: each dequantized, quantized and dropped before the next)
    weights = ck.weights()
    fmt, kinds, stored = resolve_recipe(ck, canonical, weights)
    weights, done = _progress(weights, f"preparing {canonical} weights of {ck.name} (once)", progress)
    model = build_model(ck.config, weights, weights=fmt, kinds=kinds, stored=stored)
    del weights, stored
    ck.state_dict = None  # a float32 copy read before is not needed any more
    done("write")
    with atomic_dir(entry, complete=_complete) as tmp:
        # through a Python file: a full disk raises OSError(ENOSPC), which atomic_dir reports
        # (torch's own file writer says only "unexpected pos")
        with open(tmp / MODEL_FILE, "wb") as f:
            torch.save(model.state_dict(), f)
        (tmp / RECIPE_FILE).write_text(json.dumps({"recipe": model.weights, "source": str(ck.source)}))
        (tmp / CHECKSUM).write_text(json.dumps({"crc32": _checksums(tmp)}))
    done(None)
    _weights_proven(ck)
    return model


def _mapped(ck: LoadedCheckpoint, entry: Path):
    """The model of ``ck`` mapped from the prepared ``entry``, which it holds while it lives
    (paths.hold_entry); None when there is no entry, or a damaged one (taken out, with a
    warning).

    Raises:
        LongattnError: an intact entry that this torch cannot read, or without its recipe.
    """
    import torch

    from ..models.prepared import from_prepared
    hold = hold_entry(entry)
    if hold is None:
        return None
    try:
        if not _complete(entry):
            hold.close()
            return None
        if not _intact(entry):
            warnings.warn(f"prepared weights {entry} are damaged (checksum mismatch); preparing again",
                          stacklevel=3)
            discard_entry(entry)
            hold.close()
            return None
        try:
            state = torch.load(entry / MODEL_FILE, mmap=True, weights_only=True)
        except Exception as e:  # unreadable despite its checksum: a torch that cannot read it
            raise LongattnError(f"prepared weights {entry} cannot be read ({e}); "
                                "run `longattn models --clear-cache` and retry") from None
        try:
            built = json.loads((entry / RECIPE_FILE).read_text())["recipe"]
        except (OSError, ValueError, KeyError):
            raise LongattnError(f"prepared weights {entry} lack their recipe; "
                                "run `longattn models --clear-cache` and retry") from None
        model = from_prepared(ck.config, state, built)
    except BaseException:
        hold.close()
        raise
    hold.keep_for(model)
    return model
