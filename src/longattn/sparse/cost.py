"""Predicted cost of one sparse layer call against the dense read it replaces.

``SCSAConfig.dense_when_cheaper``: at the end of calibration a layer whose sparse calls would
cost more than its dense read attends densely (exactly) instead. The model counts a call in
*dense row reads*: one float32 key and value row read for all G query heads of a KV head, what
the fused dense decode kernel does per cached token and KV head. Ratios of two codes' costs on
one host move less between hosts than their times do.

    sparse = FIXED + PER_CLUSTER * Hkv * M + PER_OPENED * opened rows + PER_EXACT * exact rows
             + PER_PROBED * probed rows
    dense  = DENSE_FIXED + Hkv * N

(opened, exact and probed rows summed over the KV heads; M clusters per head; probed rows are
every packed member row when SCSAConfig.probe_dims is on, else none). FIXED is the call's
Python and native set-up, PER_CLUSTER the summaries scored and ranked for every query head,
PER_OPENED a q8_0 row scored and summed (integer dots, dequantized values: more instructions
than a float32 row but a quarter of the bytes), PER_EXACT a float32 row gathered from the cache
(sink, outliers, suffix), DENSE_FIXED the dense op's own set-up. The constants are the
least-squares fit of ``benchmarks/scsa_cost.py`` (Qwen2.5-0.5B head shapes, 2 threads, AVX-512
forms, 2K-32K rows), rounded; the fit and its residuals are in
``benchmarks/results/scsa_cost.json``. The constants are the native flat q8_0 call's;
the PyTorch paths (other packings, hierarchical mode) cost more per call than they say, so the
rule sends fewer of those layers to their dense read than it could.
"""

from __future__ import annotations

FIXED = 4000.0
PER_CLUSTER = 6.5
PER_OPENED = 0.7
PER_EXACT = 1.45
DENSE_FIXED = 2750.0
# The probe's pass (SCSAConfig.probe_dims) per packed member row, fitted alone with the four
# constants above held (``scsa_cost.py --probes 16 64``, 2K-32K rows). The pass reads every key
# tile, so from DRAM (a model step) it costs more than this fit, made with the tiles in L3, says.
PER_PROBED = 0.33


def sparse_cost(num_kv_heads: int, clusters: int, opened_rows: float, exact_rows: float,
                probed_rows: float = 0.0) -> float:
    """A sparse call's predicted cost in dense row reads (rows summed over the KV heads)."""
    return FIXED + PER_CLUSTER * num_kv_heads * clusters + PER_OPENED * opened_rows + PER_EXACT * exact_rows \
        + PER_PROBED * probed_rows


def dense_cost(num_kv_heads: int, n: int) -> float:
    """The dense read of ``n`` cached rows in the same units."""
    return DENSE_FIXED + num_kv_heads * n
