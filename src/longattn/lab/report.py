"""Markdown reports: each lab command's table as a page, and one page gathering a sweep directory.

A command writes ``stem.json``, ``stem.png`` and ``stem.md`` side by side; ``gather_report``
walks a directory for such ``.md`` pages (those with a JSON sibling) and writes one page that
holds them all, each with its plot, in path order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..errors import LongattnError

REPORT_NAME = "report.md"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A GitHub-flavoured Markdown table; numbers right-aligned, floats with 4 decimals."""
    def cell(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4f}"
        return str(v).replace("|", "\\|")
    right = [bool(rows) and all(isinstance(r[i], (int, float)) for r in rows) for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_markdown(path, title: str, notes: Sequence[str], headers, rows, png=None) -> Path:
    """``path``: ``# title``, the notes as a list, the table, and ``png`` (a sibling file) if given."""
    path = Path(path)
    parts = [f"# {title}", "", *[f"- {n}" for n in notes], "", markdown_table(headers, rows), ""]
    if png is not None:
        parts += [f"![{title}]({Path(png).name})", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))
    return path


def gather_report(directory, output=None) -> Path:
    """Write one Markdown page (default ``directory/report.md``) holding every command page
    under ``directory``; headings move down one level and image links are made relative to
    the page."""
    root = Path(directory)
    if not root.is_dir():
        raise LongattnError(f"{root} is not a directory")
    out = Path(output) if output is not None else root / REPORT_NAME
    if out.exists() and not out.is_file():  # a FIFO would wait for a reader, a device swallow the page
        raise LongattnError(f"{out} exists and is not a regular file; name a file to write the report to")
    # regular files only: a FIFO among the results would wait for a writer for ever
    pages = sorted(p for p in root.rglob("*.md")
                   if p.is_file() and p.with_suffix(".json").is_file() and p.resolve() != out.resolve())
    if not pages:
        raise LongattnError(f"no lab results (.md beside .json) under {root}; run a lab command with --out there")
    import os
    parts = [f"# Lab report: {root.name or root}", ""]
    parts += [f"- [{p.relative_to(root)}](#{_anchor(p, root)})" for p in pages] + [""]
    for p in pages:
        parts.append(f'<a id="{_anchor(p, root)}"></a>')
        rel = os.path.relpath(p.parent, out.parent)
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise LongattnError(f"{p} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                                "it is not a lab command's page: move it out of the directory") from None
        for line in text.splitlines():
            if line.startswith("#"):
                line = "#" + line
            elif line.startswith("![") and "](" in line:
                alt, target = line[:-1].split("](", 1)
                line = f"{alt}]({Path(rel, target).as_posix()})"
            parts.append(line)
        parts.append("")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts))
    return out


def _anchor(page: Path, root: Path) -> str:
    return str(page.relative_to(root).with_suffix("")).replace("/", "-").replace(".", "-").lower()
