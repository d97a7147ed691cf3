"""A checkpoint's tokenizer: encode and decode through the `tokenizers` library, the rest
through transformers, loaded only when something needs it.

transformers' AutoTokenizer costs 0.6-1.3 s to import and up to 2.9 s to build (Gemma 3's
262K-entry vocabulary) on every run, while encoding and decoding are the `tokenizers`
library's own calls on the same ``tokenizer.json`` (0.07-0.6 s to load). ``CheckpointTokenizer``
makes exactly those calls for ``tok(text)`` and ``tok.decode(ids, skip_special_tokens=...)``
and hands every other attribute (chat templates, special-token ids, ``save_pretrained``) to
transformers' tokenizer of the same directory, built on first use. Directories whose
``tokenizer_config.json`` asks transformers for something more (cleaning up spaces after
decoding, adding BOS or EOS itself) get transformers' tokenizer alone.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

from ..errors import LongattnError

# tokenizer_config.json settings with which transformers' encode or decode is more than the
# `tokenizers` call (a set value sends the directory to transformers' tokenizer)
_TRANSFORMERS_ONLY = ("clean_up_tokenization_spaces", "add_bos_token", "add_eos_token")


def quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="transformers")


def release_freed_heap() -> None:
    """Hand the heap pages freed so far back to the system (glibc's ``malloc_trim``; a no-op
    on other C libraries). Parsing a large ``tokenizer.json`` frees most of what it allocated,
    but glibc keeps it: Gemma 3's 33 MB file leaves 290 MiB resident, 97 MiB once trimmed."""
    try:
        import ctypes
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _damaged(what, e: Exception) -> LongattnError:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return LongattnError(f"cannot read the tokenizer of {what}: {first}; the tokenizer files are damaged")


# The tokenizer class AutoTokenizer picks for a GGUF of each architecture longattn runs
# (tests/core/test_gguf_llamacpp.py and test_tokenizer.py check it saves the same files).
# Naming it skips the full metadata parse AutoTokenizer makes only to learn the model type:
# 6-10 s of a first run on a 150K-262K-token vocabulary.
GGUF_TOKENIZER_CLASS = {"llama": "TokenizersBackend", "qwen2": "Qwen2Tokenizer",
                        "qwen3": "Qwen2Tokenizer", "phi3": "TokenizersBackend",
                        "gemma2": "GemmaTokenizer", "gemma3": "GemmaTokenizer"}


def load_tokenizer(path: Path, gguf_file: str | None = None, what: str | None = None,
                   gguf_arch: str | None = None):
    """transformers' tokenizer of an HF directory (or of ``gguf_file`` in it, whose
    ``general.architecture`` is ``gguf_arch`` where the caller has read it).

    Raises:
        LongattnError: the tokenizer files are damaged (one line naming ``what``, default
            the directory or file).
    """
    quiet_transformers()
    try:
        if gguf_file is not None and gguf_arch in GGUF_TOKENIZER_CLASS:
            import transformers
            cls = getattr(transformers, GGUF_TOKENIZER_CLASS[gguf_arch])
            return cls.from_pretrained(str(path), gguf_file=gguf_file)
        from transformers import AutoTokenizer
        if gguf_file is not None:
            return AutoTokenizer.from_pretrained(str(path), gguf_file=gguf_file)
        return AutoTokenizer.from_pretrained(str(path))
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception as e:  # tokenizers and transformers raise many types for a damaged file
        raise _damaged(what or Path(path) / (gguf_file or ""), e) from None


class CheckpointTokenizer:
    """``tok(text)["input_ids"]`` and ``tok.decode(ids, skip_special_tokens=...)`` by the
    `tokenizers` library; any other attribute from transformers' tokenizer (``hf``)."""

    def __init__(self, path: Path | None, fast, what, hf=None):
        self._path, self._fast, self._what, self._hf = (None if path is None else Path(path)), fast, what, hf

    @property
    def hf(self):
        """transformers' tokenizer of the same directory (built on first use)."""
        if self._hf is None:
            self._hf = load_tokenizer(self._path, what=self._what)
        return self._hf

    def __call__(self, text, **kwargs):
        """``{"input_ids": [int]}`` of ``text`` with the tokenizer's special tokens added."""
        if kwargs or not isinstance(text, str):
            return self.hf(text, **kwargs)
        # encode_batch releases the GIL while it works (encode does not), so a server's other
        # threads -- its event loop above all -- keep running beside a megabyte prompt
        return {"input_ids": self._fast.encode_batch([text])[0].ids}

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if kwargs:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return self._fast.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return len(self.hf)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf, name)


def wrap_tokenizer(hf, what):
    """transformers' tokenizer ``hf`` built from a GGUF's metadata (before the converted directory
    exists) behind CheckpointTokenizer's encode and decode, so a model's first run tokenizes by the
    same calls as every later one (the `tokenizers` library, which releases the GIL); ``hf`` as it
    is where it has no such backend or asks transformers to clean up spaces or add EOS itself."""
    fast = getattr(hf, "backend_tokenizer", None)
    settings = getattr(hf, "init_kwargs", None) or {}
    if fast is None or any(settings.get(k) for k in ("clean_up_tokenization_spaces", "add_eos_token")):
        return hf
    return CheckpointTokenizer(None, fast, what, hf=hf)


def checkpoint_tokenizer(path: Path, what: str | None = None):
    """The tokenizer of the directory ``path``: a CheckpointTokenizer where its tokenizer.json
    is all transformers would use, else transformers' own.

    Raises:
        LongattnError: the tokenizer files are damaged (one line naming ``what``).
    """
    path = Path(path)
    what = what or path
    config = path / "tokenizer_config.json"
    if not (path / "tokenizer.json").exists() or not config.exists():
        return load_tokenizer(path, what=what)
    try:
        settings = json.loads(config.read_text(encoding="utf-8"))
        if not isinstance(settings, dict):
            raise ValueError("tokenizer_config.json is not a JSON object")
        from tokenizers import Tokenizer
        fast = Tokenizer.from_file(str(path / "tokenizer.json"))
        release_freed_heap()
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception as e:  # a damaged file: the JSON or the tokenizer's own parser says why
        raise _damaged(what, e) from None
    if any(settings.get(k) for k in _TRANSFORMERS_ONLY):
        return load_tokenizer(path, what=what)
    return CheckpointTokenizer(path, fast, what)
