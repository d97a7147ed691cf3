"""Running the CLI as a user would and checking the bad-input contract: exit 2, one line
`longattn: error: ...` on stderr (on a line of its own), no traceback, nothing in the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_cli(args, cache: Path, timeout=300, native: bool = False, **env):
    """Run `longattn ARGS` in a subprocess with ``cache`` as its LONGATTN_CACHE. The native
    kernels stay off unless ``native`` (their first build would cost most of the run)."""
    full = dict(os.environ, LONGATTN_CACHE=str(cache), HF_HUB_OFFLINE="1", **env)
    if not native:
        full["LONGATTN_NATIVE"] = "off"
    return subprocess.run([sys.executable, "-m", "longattn.cli.main", *map(str, args)],
                          capture_output=True, text=True, env=full, timeout=timeout)


def error_lines(stderr: str) -> list:
    """The non-empty lines of ``stderr``, split at newlines only (a progress bar's carriage
    returns stay inside its line, so an error glued onto one does not start a line)."""
    return [l for l in stderr.split("\n") if l.strip()]


def assert_one_line_error(r, needle: str, code: int = 2):
    """``r`` (a CompletedProcess, or anything with returncode and stderr) ended in exactly one
    error line containing ``needle`` (case-insensitive), with exit ``code`` and no traceback.
    Progress-bar lines (carriage returns only) may precede it."""
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    lines = [l for l in error_lines(r.stderr) if l.replace("\r", "").strip() and not _bar_only(l)]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("longattn: error:"), lines[0]
    assert needle.lower() in lines[0].lower(), lines[0]


def _bar_only(line: str) -> bool:
    # a tqdm line: redrawn with carriage returns and ending cleared (or at the bar itself)
    return "\r" in line and "longattn:" not in line


def cache_listing(cache: Path) -> list:
    """Every path under ``cache`` (relative), sorted: compare before and after a run."""
    if not cache.exists():
        return []
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))


def cache_is_clean(cache: Path) -> bool:
    if not cache.exists():
        return True
    junk = [p for p in cache.rglob("*") if p.is_file() or p.name.startswith(".tmp-")]
    return not junk


def stale_temporaries(cache: Path) -> list:
    """Temporaries (``.tmp-*``) anywhere under ``cache``."""
    return [] if not cache.exists() else [p for p in cache.rglob(".tmp-*")]


def hf_dir(tmp: Path, cfg, weights: dict | None = None) -> Path:
    """An HF directory with ``cfg`` as its config.json (a dict, or text written as is) and
    ``weights`` (default: one placeholder tensor) as model.safetensors."""
    from safetensors.torch import save_file
    import torch
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    save_file(weights or {"x": torch.zeros(1)}, str(tmp / "model.safetensors"))
    return tmp
