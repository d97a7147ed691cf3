"""``--reference`` runs every op through PyTorch's reference path: no native kernel is built
or loaded, and the run says so."""

from __future__ import annotations

import json

from cli_helpers import run_cli
from tiny_gguf import write_tiny_gguf


def test_reference_flag_builds_and_loads_no_native_kernel(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    r = run_cli(["generate", "--model", gguf, "--prompt", "the cat", "--max-new-tokens", 3, "--reference", "--json"],
                cache, native=True)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["kernels"] == "reference" and out["new_tokens"] >= 1
    assert not (cache / "kernels").exists()  # nothing was built
