"""One entry point: a name or path -> LoadedCheckpoint (config, float32 weights, tokenizer).

A GGUF file is converted once (config read, tokenizer built from the file's own metadata)
into ``$LONGATTN_CACHE/converted/<key>/``; the key hashes the source file's content plus the
converter version, so a changed source file is re-converted and the same file at another path
is not. The entry holds no weights: its float32 weights are dequantized from the file itself
whenever a run needs them (a prepared-weights miss, ``--weights f32``), so no float32 copy is
ever written; runs in the default formats map their prepared weights (prepared.py) instead.
Nothing is written until the file has passed the structural checks (integrity.py; every
tensor the model needs, nothing else) and the run has read every weight value and checked it
(a prepared-weights build, or the float32 state dict; LoadedCheckpoint.commit_conversion);
the entry is then written into a temporary directory and renamed into place, so an
interrupted or failed conversion leaves nothing behind, and a second process converting the
same file keeps the entry the first put there (see paths.atomic_dir). The entry records the SHA-256 of its files; one that no longer matches
(damaged on disk) is converted again, with a warning, rather than used. A run holds the entry
(paths.hold_entry) while it reads it, and a bundled model's source assembled in the cache for
as long as the checkpoint lives (its weights are read from it whenever they are prepared), so
clearing the cache never takes a file from under a run.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from ..config import ModelConfig
from ..errors import LongattnError
from .bundled import BUNDLED, resolve_model
from .digest import content_digest, remember_digest
from .paths import atomic_dir, cache_root, hold_entry, remove_path, temp_prefix
from .tokenizer import checkpoint_tokenizer, load_tokenizer, wrap_tokenizer

CONVERTER_VERSION = "5"  # bump when the converted layout or config reading changes
CHECKSUM = "checksum.json"  # SHA-256 of the entry's files, written last


class LoadedCheckpoint:
    """A checkpoint's name, source path, config and tokenizer (transformers
    PreTrainedTokenizerFast, or None for weight-only dirs).

    ``weights()`` gives the float32 weights for one pass over them, each tensor read when it is
    looked up; ``state_dict`` (name -> float32 tensor) reads them all into memory on first use.
    A run whose prepared weights are cached (models.prepared) reads neither. ``weights_key``
    names those float32 weights by content (the source's digest and the converter version).

    Args:
        weights: makes the mapping that reads the source tensor by tensor
            (gguf_file.GGUFWeights, hf_dir.HFWeights).
        read_bar: the label of a progress bar on stderr while ``state_dict`` reads, or None.
    """

    def __init__(self, name: str, source: Path, config: ModelConfig, tokenizer: Any,
                 weights: Callable[[], Mapping] | None = None, weights_key: str | None = None,
                 read_bar: str | None = None):
        self.name, self.source, self.config, self.tokenizer = name, source, config, tokenizer
        self._weights, self.weights_key, self._read_bar = weights, weights_key, read_bar
        self._state_dict: dict | None = None
        # (files, digest) to record in the digest memo once the weights proved good, or None
        self.unremembered: tuple | None = None
        # writes the GGUF conversion this run made into the cache once the weights proved good
        # (every value read and checked), or None
        self.pending_entry: Callable[[], None] | None = None

    @property
    def state_dict(self) -> dict | None:
        if self._state_dict is None and self._weights is not None:
            self._state_dict = _read_all(self._weights(), self._read_bar)
            self.commit_conversion()
        return self._state_dict

    @state_dict.setter
    def state_dict(self, sd: dict | None) -> None:
        """Set the weights; ``None`` drops them (they are read again on next use)."""
        self._state_dict = sd

    def weights(self) -> Mapping:
        """The float32 weights for one pass over them (models.build_model): ``state_dict`` when
        it is read already, else a mapping that reads (a GGUF's: dequantizes) each tensor when
        it is looked up and keeps none, so a model built from it never holds the whole float32
        copy."""
        if self._state_dict is None and self._weights is not None:
            return self._weights()
        return self.state_dict

    def commit_conversion(self) -> None:
        """Write this run's conversion into the cache (its weights proved good); a no-op when
        it made none."""
        if self.pending_entry is not None:
            self.pending_entry()
            self.pending_entry = None


def _complete(entry: Path) -> bool:
    """A converted entry holds every file load_checkpoint reads (an older or damaged entry
    lacking one is replaced)."""
    return all((entry / f).exists() for f in ("config.json", "tokenizer", CHECKSUM))


def cache_key(digest: str) -> str:
    """Key of a source file's cache entries from its content digest and the converter
    version (not its path, so a second installation of the same packages reuses the entry)."""
    return hashlib.sha256(f"{digest}|{CONVERTER_VERSION}".encode()).hexdigest()[:16]


def _convert_gguf(src: Path, target: Path, digest: str) -> tuple:
    """Read ``src``'s header and build its tokenizer; its weights are read later, on demand.

    Returns ``(config, weights, tokenizer, commit)``: ``weights`` a GGUFWeights (structure
    checked: every tensor the model needs, of the header's shapes, nothing else) and
    ``commit()`` writing the converted entry ``target`` and recording the digest, which the
    caller runs once the weights proved good (every value read and checked), so a file whose
    values are damaged leaves nothing in the cache.
    """
    from ..models.transformer import check_weight_names
    from .gguf_file import open_gguf
    cfg, weights = open_gguf(src)
    check_weight_names(cfg, {k: weights.shape(k) for k in weights})
    tok = load_tokenizer(src.parent, gguf_file=src.name, what=src, gguf_arch=cfg.family)
    if cfg.family == "gemma3" and not getattr(tok, "chat_template", None):
        from .family_gaps import GEMMA3_CHAT_TEMPLATE
        tok.chat_template = GEMMA3_CHAT_TEMPLATE
    tok = wrap_tokenizer(tok, src)  # a first run tokenizes as later runs (from the written directory) do

    def commit() -> None:
        with atomic_dir(target, complete=_complete) as tmp:
            (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
            tok.save_pretrained(str(tmp / "tokenizer"))
            (tmp / "source.json").write_text(json.dumps({"source": str(src)}))
            (tmp / CHECKSUM).write_text(json.dumps({"sha256": content_digest(_entry_files(tmp), remember=False)}))
        remember_digest([src], digest)  # only now: the file proved a good GGUF
    return cfg, weights, tok, commit


def _read_all(weights: Mapping, bar: str | None) -> dict:
    """Every tensor of ``weights`` read into a dict, with a progress bar on stderr labelled
    ``bar`` (none when None)."""
    names = list(weights)
    if bar is not None:
        from tqdm import tqdm
        names = tqdm(names, desc=bar, unit="tensor", leave=True)
    return {k: weights[k] for k in names}


def _entry_files(entry: Path) -> list:
    """The files of a converted entry its checksum covers: config and tokenizer."""
    tok = sorted(p for p in (entry / "tokenizer").rglob("*") if p.is_file())
    return [entry / "config.json", *tok]


def entry_intact(entry: Path, files_of: Callable[[Path], list] = _entry_files) -> bool:
    """The entry's files (``files_of(entry)``) hash to the checksum written with them (hashed
    once per entry: the match is remembered under the files' sizes and mtimes). Entries
    written by older converters carry no checksum and are trusted."""
    try:
        want = json.loads((entry / CHECKSUM).read_text())["sha256"]
    except FileNotFoundError:
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False
    files = files_of(entry)
    got = content_digest(files, remember=False)
    if got == want:
        remember_digest(files, got)
    return got == want


def discard_entry(entry: Path) -> None:
    """Take a damaged entry out of place at once (a rename), then delete it."""
    aside = entry.parent / f"{temp_prefix()}damaged"
    os.rename(entry, aside)
    remove_path(aside)


def load_checkpoint(name_or_path: str, progress: bool = True, with_tokenizer: bool = True,
                    read_weights: bool = True) -> LoadedCheckpoint:
    """Load a bundled model name, a ``.gguf`` file or an HF directory.

    With ``read_weights=False`` the float32 weights are read on first use of ``state_dict``
    (a GGUF file is still converted and checked now).

    Raises LongattnError (one clear line) for a missing, truncated or unsupported checkpoint.
    """
    name, src, hold = _resolve_held(name_or_path)
    ck = _open_checkpoint(name, src, progress, with_tokenizer)
    if hold is not None:
        hold.keep_for(ck)
    if read_weights:
        ck.state_dict  # noqa: B018 -- read now, so a damaged file fails here
    return ck


def _resolve_held(name_or_path: str) -> tuple:
    """``(name, source, hold)``: resolve_model's answer, with a hold on the source where it lies
    in the cache (a bundled model's parts assembled there), else None."""
    name, src = resolve_model(name_or_path)
    if name_or_path not in BUNDLED or not src.is_relative_to(cache_root()):
        return name, src, None
    hold = hold_entry(src)
    if hold is None:  # the cache was cleared meanwhile: assembled again
        name, src = resolve_model(name_or_path)
        hold = hold_entry(src)
    return name, src, hold


def _conversion_usable(target: Path) -> bool:
    """``target`` is a complete, intact converted entry; a damaged one is taken out (with a
    warning)."""
    if not _complete(target):
        return False
    if entry_intact(target):
        return True
    warnings.warn(f"converted cache entry {target} is damaged (its checksum does not match); "
                  "converting again", stacklevel=4)
    discard_entry(target)
    return False


def _open_checkpoint(name: str, src: Path, progress: bool, with_tokenizer: bool) -> LoadedCheckpoint:
    if src.is_dir():
        from .hf_dir import HFWeights, hf_dir_config, hf_dir_weight_files
        cfg = hf_dir_config(src)
        files = hf_dir_weight_files(src)
        tok = None
        if with_tokenizer and any((src / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
            tok = checkpoint_tokenizer(src)
        # remembered only once the weights proved good (prepared.py): a refused run leaves no trace
        digest = content_digest([src / "config.json", *files], remember=False)
        ck = LoadedCheckpoint(name, src, cfg, tok, lambda: HFWeights(src, cfg), cache_key(digest))
        ck.unremembered = ([src / "config.json", *files], digest)
        return ck
    if src.suffix not in (".gguf", ".bin") and not _looks_like_gguf(src):
        raise LongattnError(f"{src} is neither a GGUF file nor an HF model directory")
    digest = content_digest([src], remember=False)
    bar = f"dequantizing {src.name}" if progress else None
    target = cache_root() / "converted" / cache_key(digest)
    hold = hold_entry(target)  # held while its config and tokenizer are read
    if hold is not None and not _conversion_usable(target):
        hold.close()
        hold = None
    if hold is None:
        cfg, weights, tok, commit = _convert_gguf(src, target, digest)
        ck = LoadedCheckpoint(name, src, cfg, tok if with_tokenizer else None, lambda: weights, target.name, bar)
        ck.pending_entry = commit
        return ck
    with hold:
        remember_digest([src], digest)
        try:
            cfg = ModelConfig.from_dict(json.loads((target / "config.json").read_text()))
        except Exception as e:
            raise LongattnError(f"converted cache entry {target} is damaged ({e}); delete it and retry") from None
        tok = None
        if with_tokenizer:
            tok = checkpoint_tokenizer(target / "tokenizer", what=f"the converted cache entry {target} "
                                       "(delete it and retry)")

    def weights():
        from .gguf_file import open_gguf
        return open_gguf(src)[1]
    return LoadedCheckpoint(name, src, cfg, tok, weights, target.name, bar)


def _looks_like_gguf(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
