"""Research variants of SCSA's selection, kept because tests compare them with the default path
and benchmarks measure them, off by default (``SCSAConfig``'s experimental block).

Modules: ``tree`` (the interval tree over an index's clusters) and ``tree_walk`` (its best-first
walk: ``SCSAConfig.hierarchical``, ``tree_fanout``, ``tree_order``), ``refine`` (the stop rule
re-decided after the read: ``SCSAConfig.refine``), ``float_store`` (the f16/f32 packings:
``SCSAConfig.packing``).
"""
