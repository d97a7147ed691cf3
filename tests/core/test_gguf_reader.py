"""The GGUF reader longattn opens files with (gguf's GGUFReader over a plain view of the map)
reads the same fields and tensors as gguf's own, and its dequantization gives gguf's values
bit for bit."""

import gguf
import numpy as np
import pytest

from longattn.checkpoint import gguf_file
from longattn.checkpoint.gguf_file import _open
from tiny_gguf import write_tiny_gguf


def _same(a, b) -> None:
    assert list(a.fields) == list(b.fields)
    for key in a.fields:
        fa, fb = a.fields[key], b.fields[key]
        assert (fa.types, fa.data, fa.offset) == (fb.types, fb.data, fb.offset), key
        assert len(fa.parts) == len(fb.parts), key
        for x, y in zip(fa.parts, fb.parts):
            assert x.dtype == y.dtype and np.array_equal(x, y), key
        assert fa.contents() == fb.contents(), key
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert ta.tensor_type == tb.tensor_type and list(ta.shape) == list(tb.shape)
        assert (ta.data_offset, ta.n_bytes, ta.n_elements) == (tb.data_offset, tb.n_bytes, tb.n_elements)
        assert ta.data.dtype == tb.data.dtype and ta.data.shape == tb.data.shape
        assert np.array_equal(ta.data, tb.data), ta.name


def test_reads_what_gguf_reads(tmp_path):
    for i, kw in enumerate([{}, {"mlp_type": "Q4_0", "attn_type": "Q4_1"}]):
        path = write_tiny_gguf(tmp_path / f"t{i}.gguf", **kw)
        _same(_open(path), gguf.GGUFReader(str(path)))


@pytest.mark.real
def test_bundled_file_reads_what_gguf_reads():
    from longattn.checkpoint.bundled import DEFAULT_MODEL, resolve_model
    _, path = resolve_model(DEFAULT_MODEL)
    _same(_open(path), gguf.GGUFReader(str(path)))


def _dequantizes_as_gguf(reader, one_per_type: bool = False) -> set:
    """Compare every block-quantized tensor (or the smallest of each type) with gguf's decoding."""
    from gguf import GGMLQuantizationType as T
    seen = set()
    for t in sorted(reader.tensors, key=lambda t: int(t.n_elements)):
        if t.tensor_type in (T.F32, T.F16, T.BF16) or (one_per_type and t.tensor_type.name in seen):
            continue
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        got = gguf_file.dequantize(t.data, t.tensor_type)
        assert got.dtype == np.float32 and np.array_equal(got, want), t.name
        seen.add(t.tensor_type.name)
    return seen


def test_dequantize_is_ggufs_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_file, "DEQUANTIZE_CHUNK", 64)  # several chunks per tiny tensor
    seen = set()
    for i, kw in enumerate([{}, {"mlp_type": "Q4_0", "attn_type": "Q4_1"}]):
        seen |= _dequantizes_as_gguf(_open(write_tiny_gguf(tmp_path / f"t{i}.gguf", **kw)))
    assert {"Q8_0", "Q4_0", "Q4_1"} <= seen, seen


@pytest.mark.real
def test_bundled_files_dequantize_as_gguf():
    """The smallest tensor of each block type the bundled models store (Q4_1, Q5_0, Q4_K, Q6_K, Q8_0)."""
    from longattn.checkpoint.bundled import BUNDLED, resolve_model
    seen = set()
    for name in BUNDLED:
        seen |= _dequantizes_as_gguf(_open(resolve_model(name)[1]), one_per_type=True)
    assert {"Q4_1", "Q5_0", "Q4_K", "Q6_K", "Q8_0"} <= seen, seen
