"""Bad family configs through the CLI: one line on stderr, exit 2, no traceback."""

import json
from pathlib import Path

import pytest

from conftest import tiny_dir
from cli_helpers import assert_one_line_error, hf_dir as _hf_dir, run_cli


@pytest.mark.parametrize("change, needle", [
    ({"rope_parameters": {"rope_type": "ntk-by-parts", "factor": 2.0, "rope_theta": 1e4}},
     "rope_type 'ntk-by-parts' is not implemented"),
    ({"model_type": "mamba"}, "unsupported architecture 'mamba'"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4,
      "layer_types": ["sliding_attention", "full_attention"]}, "layer_types has 2 entries for 3 layers"),
    ({"model_type": "mistral", "sliding_window": 4, "layer_types": ["sliding_attention"] * 3},
     "layer_types, which transformers' mistral model does not read"),
])
def test_bad_family_config_is_one_line(tmp_path, change, needle):
    cfg = json.loads((Path(tiny_dir("llama")) / "config.json").read_text())
    cfg.update(change)
    d = _hf_dir(tmp_path / "bad", cfg)
    r = run_cli(["generate", "--model", str(d), "--max-new-tokens", "1"], tmp_path / "c")
    assert_one_line_error(r, needle)
