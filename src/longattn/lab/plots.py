"""What every experiment command writes: a table on stdout, a JSON file and a PNG.

Experiments return plain dicts (JSON-able); the commands print them with ``format_table``
and save them with ``write_json`` / ``save_figure`` under ``--out`` (``results/<command>/``
by default). Matplotlib runs headless (Agg) and is imported only when a figure is drawn.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Iterable, Optional, Sequence

from ..errors import LongattnError


def int_list(text: str) -> list:
    """argparse type: ``"64,128,256"`` -> ``[64, 128, 256]`` (non-negative ints, any order).

    Raises ``argparse.ArgumentTypeError`` so argparse reports a bad value as a usage error.
    """
    import argparse
    try:
        vals = [int(v) for v in re.split(r"[,\s]+", str(text).strip()) if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one integer")
    if any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"values must be non-negative, got {text!r}")
    return vals


def str_list(text: str) -> list:
    """argparse type: ``"a,b"`` -> ``["a", "b"]``."""
    import argparse
    vals = [v for v in re.split(r"[,\s]+", str(text).strip()) if v]
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one name")
    return vals


def slug(name: str) -> str:
    """A file-name-safe form of a model name or path (``/a/b/model.gguf`` -> ``model``)."""
    base = Path(str(name)).name or str(name)
    base = re.sub(r"\.(gguf|bin)$", "", base)
    return re.sub(r"[^A-Za-z0-9._-]+", "_", base) or "model"


def out_dir(path) -> Path:
    """The output directory, checked but not created (writers create it), so a run that
    fails before its results exist leaves nothing on disk."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise LongattnError(f"--out {p} exists and is not a directory")
    return p


def _clean(obj):
    """Replace non-finite floats (not valid JSON) with None, recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def json_ready(obj):
    """``obj`` with inf/nan as None so ``json.dumps(..., allow_nan=False)`` succeeds."""
    return _clean(obj)


def write_json(path, obj) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_ready(obj), indent=1, allow_nan=False) + "\n")
    return path


def new_figure(width: float = 6.4, height: float = 4.2):
    """A (figure, axes) pair from the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(width, height), dpi=110)
    return fig, ax


def save_figure(fig, path) -> Path:
    import matplotlib.pyplot as plt
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def format_table(headers: Sequence[str], rows: Iterable[Sequence], floatfmt: str = ".4f") -> str:
    """Right-aligned plain-text table; floats with ``floatfmt``, None as ``-``."""
    def cell(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return format(v, floatfmt) if math.isfinite(v) else str(v)
        return str(v)
    body = [[cell(v) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def progress_bar(total: int, desc: str, disable: bool = False, unit: str = "it"):
    """A tqdm bar on stderr (works as a no-op when disabled)."""
    import sys
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=disable,
                dynamic_ncols=True, leave=False)


def written(paths: Sequence[Optional[Path]]) -> str:
    return "wrote " + ", ".join(str(p) for p in paths if p is not None)
