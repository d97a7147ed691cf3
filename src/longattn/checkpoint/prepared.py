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
killed first run leaves nothing in place, and a damaged entry is rebuilt with a warning.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Mapping
from pathlib import Path

from ..errors import LongattnError
from .digest import content_digest, remember_digest
from .load import CHECKSUM, LoadedCheckpoint, discard_entry, entry_intact
from .paths import atomic_dir, cache_root

PREPARED_VERSION = "4"  # bump when the saved layout (module names, packing), its source or auto's rule changes
MODEL_FILE = "model.pt"


def prepared_key(weights_key: str, recipe: str) -> str:
    """Cache key of one checkpoint's weights in one format."""
    return hashlib.sha256(f"{weights_key}|{recipe}|{PREPARED_VERSION}".encode()).hexdigest()[:16]


RECIPE_FILE = "recipe.json"  # the recipe the state was built with (what ``auto`` resolved to)


def _files(entry: Path) -> list:
    return [entry / MODEL_FILE, entry / RECIPE_FILE]


def _complete(entry: Path) -> bool:
    return all((entry / f).exists() for f in (MODEL_FILE, RECIPE_FILE, CHECKSUM))


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
    from ..models.prepared import PREPARED_FORMATS, from_prepared
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
    if _complete(entry) and not entry_intact(entry, _files):
        warnings.warn(f"prepared weights {entry} are damaged (checksum mismatch); preparing again",
                      stacklevel=2)
        discard_entry(entry)
    if _complete(entry):
        try:
            state = torch.load(entry / MODEL_FILE, mmap=True, weights_only=True)
        except Exception as e:  # unreadable despite its checksum: a torch that cannot read it
            raise LongattnError(f"prepared weights {entry} cannot be read ({e}); "
                                "run `longattn cache clear` and retry") from None
        try:
            built = json.loads((entry / RECIPE_FILE).read_text())["recipe"]
        except (OSError, ValueError, KeyError):
            raise LongattnError(f"prepared weights {entry} lack their recipe; "
                                "run `longattn cache clear` and retry") from None
        model = from_prepared(ck.config, state, built)
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
        torch.save(model.state_dict(), tmp / MODEL_FILE)
        (tmp / RECIPE_FILE).write_text(json.dumps({"recipe": model.weights, "source": str(ck.source)}))
        digest = content_digest(_files(tmp), remember=False)
        (tmp / CHECKSUM).write_text(json.dumps({"sha256": digest}))
    done(None)
    _weights_proven(ck)
    try:  # the file just written needs no second hash (unless another process's entry won)
        if json.loads((entry / CHECKSUM).read_text())["sha256"] == digest:
            remember_digest(_files(entry), digest)
    except (OSError, ValueError, KeyError):
        pass
    return model
