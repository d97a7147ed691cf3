"""Public-domain books shipped with longattn (provenance in books/PROVENANCE.json).

Taken byte for byte from public Git repositories (repository, path, commit and SHA-256 per
file in PROVENANCE.json).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from ..errors import LongattnError

BOOKS_DIR = Path(__file__).parent / "books"
DEFAULT_BOOK = "nltk_melville-moby_dick.txt"


@lru_cache(maxsize=1)
def provenance() -> dict:
    return json.loads((BOOKS_DIR / "PROVENANCE.json").read_text())


def book_names() -> list:
    return sorted(provenance())


def book_path(name: str) -> Path:
    p = BOOKS_DIR / name
    if not p.exists():
        raise LongattnError(f"unknown book '{name}'; shipped books: {', '.join(book_names())}")
    return p


def book_body(name: str = DEFAULT_BOOK) -> str:
    """The book's text without the Project Gutenberg header and footer (when marked)."""
    raw = book_path(name).read_bytes()
    meta = provenance().get(name, {})
    start = (meta.get("header_marker") or {}).get("byte_offset_body_start") or 0
    end = (meta.get("footer_marker") or {}).get("byte_offset_footer_line_start") or len(raw)
    return raw[start:end].decode("utf-8", errors="ignore")


def all_books_text() -> str:
    """Every shipped book body, concatenated in name order (for long streams)."""
    return "\n\n".join(book_body(n) for n in book_names())
