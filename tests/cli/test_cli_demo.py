"""`longattn demo` (what `make demo` runs) end to end on the default bundled model, kept small.

The demo once built generate's arguments by hand and broke when generate gained options; it
now parses them with generate's own parser, and this test runs both of its parts."""

import os
import subprocess
import sys

import pytest


@pytest.mark.real
def test_demo_generates_then_streams():
    env = {k: v for k, v in os.environ.items() if k != "LONGATTN_CACHE"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, "-m", "longattn.cli.main", "demo", "--threads", "1",
                        "--max-new-tokens", "4", "--stream-tokens", "300"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "4 new tokens" in r.stdout, r.stdout[-2000:]
    assert "window 256 + 4 sinks" in r.stdout and "full attention" in r.stdout, r.stdout[-2000:]
