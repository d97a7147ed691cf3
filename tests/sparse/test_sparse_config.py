"""SCSA settings and shapes a user can get wrong end in one clear LongattnError."""

import dataclasses
import json

import pytest
import torch

from longattn.errors import LongattnError
from longattn.sparse import SCSAConfig, SCSALayer


@pytest.mark.parametrize("kwargs, needle", [
    (dict(rank=9), "rank must be in 0..8"),
    (dict(rank=-1), "rank must be in 0..8"),
    (dict(packing="q4"), "packing must be one of"),
    (dict(cluster_size=0), "cluster_size"),
    (dict(block_size=1000, rebuild_interval=512), "multiple of rebuild_interval"),
    (dict(block_size=64, cluster_size=128, rebuild_interval=64), "block_size (64) must be >= cluster_size"),
    (dict(power_iterations=0), "power_iterations"),
    (dict(tau_grid=(0.1, 0.05)), "tau_grid"),
    (dict(tau_grid=()), "tau_grid"),
    (dict(tau_default=1.5), "tau_default"),
    (dict(tolerance=0.0), "tolerance"),
    (dict(sink=-1), "sink"),
    (dict(min_context=-5), "min_context"),
    (dict(tree_fanout=1), "tree_fanout"),
    (dict(tree_order="time"), "tree_order"),
    (dict(calib_metric="max"), "calib_metric must be one of head, group"),
    (dict(outliers=-1), "outliers must be >= 0"),
    (dict(refine=-1), "refine must be >= 0"),
    (dict(refine=1, hierarchical=True), "refine applies to flat selection"),
    (dict(probe_dims=-1), "probe_dims must be >= 0"),
    (dict(probe_keys=0), "probe_keys >= 1"),
    (dict(probe_dims=8, hierarchical=True), "the probe applies to flat selection"),
])
def test_config_rejects_bad_settings(kwargs, needle):
    with pytest.raises(LongattnError) as e:
        SCSAConfig(**kwargs)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("heads, kv, dim, needle", [
    (14, 3, 64, "multiple of num_kv_heads"),
    (0, 1, 64, "multiple of num_kv_heads"),
    (4, 2, 60, "head_dim must be a multiple of 8"),
    (4, 2, 1024, "head_dim must be a multiple of 8 in 8..512"),
    (4, 2, 0, "head_dim"),
])
def test_layer_rejects_bad_shapes(heads, kv, dim, needle):
    with pytest.raises(LongattnError) as e:
        SCSALayer(SCSAConfig(), num_heads=heads, num_kv_heads=kv, head_dim=dim)
    assert needle in str(e.value)


def test_layer_rejects_a_non_config():
    with pytest.raises(LongattnError, match="SCSAConfig"):
        SCSALayer({"rank": 2}, 2, 1, 8)


def test_config_is_frozen_and_replace_revalidates():
    """A config is data: it cannot be edited in place (a policy holding it stays what it was
    built as), and a changed copy is validated like a new one."""
    cfg = SCSAConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rank = 9
    with pytest.raises(LongattnError, match="rank must be in 0..8"):
        dataclasses.replace(cfg, rank=9)


def test_layer_accepts_valid_edge_shapes():
    SCSALayer(SCSAConfig(rank=8), num_heads=1, num_kv_heads=1, head_dim=512)
    SCSALayer(SCSAConfig(rank=0), num_heads=8, num_kv_heads=8, head_dim=8)


def test_attend_rejects_mismatched_tensors():
    layer = SCSALayer(SCSAConfig(), num_heads=4, num_kv_heads=2, head_dim=16)
    q = torch.zeros(1, 4, 1, 16)
    k = torch.zeros(1, 2, 10, 16)
    with pytest.raises(LongattnError, match="decode-only"):
        layer.attend(torch.zeros(1, 4, 2, 16), k, k, 0.25)
    with pytest.raises(LongattnError, match="expected"):
        layer.attend(torch.zeros(1, 3, 1, 16), k, k, 0.25)
    with pytest.raises(LongattnError, match="must both be"):
        layer.attend(q, k, torch.zeros(1, 2, 9, 16), 0.25)
    with pytest.raises(LongattnError, match="must both be"):
        layer.attend(q, torch.zeros(1, 1, 10, 16), torch.zeros(1, 1, 10, 16), 0.25)
    with pytest.raises(LongattnError, match="empty"):
        layer.attend(q, k[:, :, :0], k[:, :, :0], 0.25)


def test_tau_files_fail_clearly_and_change_nothing(tmp_path):
    layer = SCSALayer(SCSAConfig(), num_heads=4, num_kv_heads=2, head_dim=16, layer_index=3)
    with pytest.raises(LongattnError, match="does not exist"):
        layer.load_taus(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(LongattnError, match="not readable JSON"):
        layer.load_taus(bad)
    with pytest.raises(LongattnError, match="not readable JSON"):
        layer.save_taus(bad)
    assert bad.read_text() == "{not json"
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"0:0": 0.1, "0:1": 0.2}))
    with pytest.raises(LongattnError, match="no taus for layer 3"):
        layer.load_taus(other)
    with pytest.raises(LongattnError, match="set_taus"):
        layer.set_taus([0.1, 0.2, 0.3])
    with pytest.raises(LongattnError, match="set_taus"):
        layer.set_taus([0.1, 2.0])


def test_taus_round_trip_and_merge(tmp_path):
    path = tmp_path / "taus.json"
    a = SCSALayer(SCSAConfig(), num_heads=4, num_kv_heads=2, head_dim=16, layer_index=0)
    b = SCSALayer(SCSAConfig(), num_heads=4, num_kv_heads=2, head_dim=16, layer_index=1)
    a.set_taus([0.01, 0.02])
    b.set_taus([0.04, 0.08])
    a.save_taus(path)
    b.save_taus(path)
    data = json.loads(path.read_text())
    assert set(data) == {"0:0", "0:1", "1:0", "1:1"}
    c = SCSALayer(SCSAConfig(), num_heads=4, num_kv_heads=2, head_dim=16, layer_index=1)
    assert not c.calibrated
    c.load_taus(path)
    assert c.calibrated
    assert torch.equal(c.taus, torch.tensor([0.04, 0.08]))
    # None = the head attends exactly; it round-trips as JSON null
    a.set_taus([None, 0.02])
    assert a.exact_heads.tolist() == [True, False] and a.tau_values() == [None, 0.019999999552965164]
    a.save_taus(path)
    assert json.loads(path.read_text())["0:0"] is None
    d = SCSALayer(SCSAConfig(), num_heads=4, num_kv_heads=2, head_dim=16, layer_index=0)
    d.load_taus(path)
    assert d.exact_heads.tolist() == [True, False] and d.calibrated


def test_unwritable_tau_file_fails_clearly(tmp_path):
    layer = SCSALayer(SCSAConfig(), num_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(LongattnError, match="cannot write taus"):
        layer.save_taus(tmp_path / "no" / "such" / "dir" / "t.json")
    with pytest.raises(LongattnError, match="set_taus"):
        layer.set_taus([float("nan"), 0.1])
