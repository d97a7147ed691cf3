"""One entry point: a name or path -> LoadedCheckpoint (config, float32 weights, tokenizer).

GGUF files are converted once (dequantized, renamed, tokenizer built from the file's own
metadata) into ``$LONGATTN_CACHE/converted/<key>/``; the key hashes the source file's
content plus the converter version, so a changed source file is re-converted and the
same file at another path is not. Nothing is written until the file has passed the
structural and value checks (integrity.py) and a model has been built from the converted
weights once; the entry is then written into a temporary directory and renamed into place,
so an interrupted or failed conversion leaves nothing behind, and a second process
converting the same file keeps the entry the first put there (see paths.atomic_dir).
The entry records the SHA-256 of its files; one that no longer matches (damaged on disk)
is converted again, with a warning, rather than used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ModelConfig
from ..errors import LongattnError
from .bundled import resolve_model
from .digest import content_digest, remember_digest
from .paths import atomic_dir, cache_root, remove_path, temp_prefix

CONVERTER_VERSION = "3"  # bump when the converted layout or config reading changes
CHECKSUM = "checksum.json"  # SHA-256 of the entry's files, written last


@dataclass
class LoadedCheckpoint:
    name: str
    source: Path
    config: ModelConfig
    state_dict: dict
    tokenizer: Any  # transformers PreTrainedTokenizerFast, or None for weight-only dirs


def _quiet_transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="transformers")


def load_tokenizer(path: Path, gguf_file: str | None = None, what: str | None = None):
    """transformers' tokenizer of an HF directory (or of ``gguf_file`` in it).

    Raises:
        LongattnError: the tokenizer files are damaged (one line naming ``what``, default
            the directory or file).
    """
    _quiet_transformers()
    from transformers import AutoTokenizer
    try:
        if gguf_file is not None:
            return AutoTokenizer.from_pretrained(str(path), gguf_file=gguf_file)
        return AutoTokenizer.from_pretrained(str(path))
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception as e:  # tokenizers and transformers raise many types for a damaged file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise LongattnError(f"cannot read the tokenizer of {what or Path(path) / (gguf_file or '')}: "
                            f"{first}; the tokenizer files are damaged") from None


def _complete(entry: Path) -> bool:
    """A converted entry holds every file load_checkpoint reads (an older or damaged entry
    lacking one is replaced)."""
    return all((entry / f).exists() for f in ("model.safetensors", "config.json", "tokenizer"))


def cache_key(digest: str) -> str:
    """Key of a source file's cache entries from its content digest and the converter
    version (not its path, so a second installation of the same packages reuses the entry)."""
    return hashlib.sha256(f"{digest}|{CONVERTER_VERSION}".encode()).hexdigest()[:16]


def _convert_gguf(src: Path, target: Path, progress: bool) -> None:
    from safetensors.torch import save_file
    from .gguf_file import load_gguf
    bar = None
    if progress:
        from tqdm import tqdm

        def bar(items, total=None):
            return tqdm(items, total=total, desc=f"converting {src.name}", unit="tensor", leave=True)
    from ..models import build_model
    cfg, sd = load_gguf(src, progress=bar)
    build_model(cfg, sd, fuse=False)  # proves the weights make the model before anything is kept
    tok = load_tokenizer(src.parent, gguf_file=src.name, what=src)
    if cfg.family == "gemma3" and not getattr(tok, "chat_template", None):
        from .family_gaps import GEMMA3_CHAT_TEMPLATE
        tok.chat_template = GEMMA3_CHAT_TEMPLATE
    with atomic_dir(target, complete=_complete) as tmp:
        save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        tok.save_pretrained(str(tmp / "tokenizer"))
        (tmp / "source.json").write_text(json.dumps({"source": str(src)}))
        (tmp / CHECKSUM).write_text(json.dumps({"sha256": content_digest(_entry_files(tmp), remember=False)}))


def _entry_files(entry: Path) -> list:
    """The files of a converted entry its checksum covers: weights, config, tokenizer."""
    tok = sorted(p for p in (entry / "tokenizer").rglob("*") if p.is_file())
    return [entry / "model.safetensors", entry / "config.json", *tok]


def _intact(entry: Path) -> bool:
    """The entry's files hash to the checksum written with them (hashed once per entry:
    the match is remembered under the files' sizes and mtimes). Entries written by older
    converters carry no checksum and are trusted."""
    try:
        want = json.loads((entry / CHECKSUM).read_text())["sha256"]
    except FileNotFoundError:
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False
    files = _entry_files(entry)
    got = content_digest(files, remember=False)
    if got == want:
        remember_digest(files, got)
    return got == want


def _discard(entry: Path) -> None:
    """Take a damaged entry out of place at once (a rename), then delete it."""
    aside = entry.parent / f"{temp_prefix()}damaged"
    os.rename(entry, aside)
    remove_path(aside)


def load_checkpoint(name_or_path: str, progress: bool = True, with_tokenizer: bool = True
                    ) -> LoadedCheckpoint:
    """Load a bundled model name, a ``.gguf`` file or an HF directory.

    Raises LongattnError (one clear line) for a missing, truncated or unsupported checkpoint.
    """
    name, src = resolve_model(name_or_path)
    if src.is_dir():
        from .hf_dir import load_hf_dir
        cfg, sd = load_hf_dir(src)
        tok = None
        if with_tokenizer and any((src / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
            tok = load_tokenizer(src)
        return LoadedCheckpoint(name, src, cfg, sd, tok)
    if src.suffix not in (".gguf", ".bin") and not _looks_like_gguf(src):
        raise LongattnError(f"{src} is neither a GGUF file nor an HF model directory")
    digest = content_digest([src], remember=False)
    target = cache_root() / "converted" / cache_key(digest)
    if _complete(target) and not _intact(target):
        warnings.warn(f"converted cache entry {target} is damaged (its checksum does not match); "
                      "converting again", stacklevel=2)
        _discard(target)
    if not _complete(target):
        _convert_gguf(src, target, progress)
    remember_digest([src], digest)  # only now: the file proved a good GGUF
    from safetensors.torch import load_file
    try:
        cfg = ModelConfig.from_dict(json.loads((target / "config.json").read_text()))
        sd = load_file(str(target / "model.safetensors"))
    except Exception as e:
        raise LongattnError(f"converted cache entry {target} is damaged ({e}); delete it and retry") from None
    tok = None
    if with_tokenizer:
        tok = load_tokenizer(target / "tokenizer", what=f"the converted cache entry {target} "
                             "(delete it and retry)")
    return LoadedCheckpoint(name, src, cfg, sd, tok)


def _looks_like_gguf(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
