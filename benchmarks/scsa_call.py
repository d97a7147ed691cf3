"""One SCSA layer call vs one dense decode-attention call, Qwen2.5-0.5B head shapes.

Arms, alternated per repeat on the same synthetic clustered cache (14 query / 2 KV heads,
head_dim 64, float32; sparse.synthetic):
  * scsa-native: SCSALayer.attend with the C++ call (SCSAConfig.native, the default); where the
    CPU has AVX-512 VNNI, as two arms: scsa-native-avx2 and scsa-native-avx512 (the forms of
    its opened-cluster phase, bit-identical outputs; native.avx512);
  * scsa-torch:  the same layer on the PyTorch ops (native=False), same decisions;
  * fused-dense: longattn's fused C++ dense decode kernel over every row (the eager
    Session's and the static step's dense read) in its automatic form; where the CPU has
    AVX-512, also fused-dense-avx2 and fused-dense-avx512 (each row loop forced, the same bits);
  * sdpa-dense:  torch's scaled_dot_product_attention over every row;
  * read-floor:  torch.sum over K and over V: every byte the dense call reads, read once with
    next to no arithmetic, so fused-dense ÷ read-floor says how far the dense kernel is from
    this host's read rate (both from whatever cache level holds the buffers: the host's L3
    may hold a 32K head's 33.5 MB, a model step's whole cache it does not).
Fixed thresholds (no calibration) so every arm reads the same thing each call. ``--outliers``
adds native arms ``...+outK`` (SCSAConfig.outliers = K: each cluster's K farthest keys read exactly).
``--python`` adds, per tau, two arms that price the Python around the kernel: ``kernel`` (the
kernel alone, on the arguments SCSALayer passes it) and ``static-op`` (the compiled static
step's op ``longattn::scsa_step`` with its per-layer Python, over the same cache as a
SparseState holds it), both in the kernels' automatic form: ``scsa-native`` − ``kernel`` is
SCSALayer.attend's Python, ``static-op`` − ``scsa-native`` the op's.
``--kv F ...`` adds, per cache format F other than f32 (cache/kv_format.py: bf16, int8), the arms
``scsa-native@tau/F`` (automatic form) and ``fused-dense/F`` over the same cache stored as F: both
widen the rows they read (SCSA only its exact rows; its index holds packed copies either way).
``--outlier-slots`` adds, per native arm, ``...+slots``: the same layer with the index's contiguous
outlier copies withheld, so the call reads the outliers from the cache by slot (the same bits).

    python benchmarks/scsa_call.py --threads 2 [--sizes 4096 32768] [--taus 0.02 0.16] [--copies 12]

Writes benchmarks/results/scsa_call.json. Do not run beside tests or builds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F


from longattn.cache.kv_format import KV_FORMATS, encode
from longattn.host import cpu_description
from longattn.ops import native
from longattn.sparse import SCSAConfig, SCSALayer
from longattn.sparse import layer as layer_mod
from longattn.sparse.synthetic import synthetic_cache
from longattn.sparse.static_op import SparseState

from common import RESULTS, write_result
H, HKV, D = 14, 2, 64


def timed(fn, calls):
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - t0) / calls


def python_arms(n, tau, outliers, bufs, qs, scale) -> dict:
    """``kernel@tau`` and ``static-op@tau`` over each cache copy (see ``--python``): per copy a
    SparseState whose layer has built its index and called the kernel once through the general
    path, whose arguments (after q, k, v) the kernel arm reuses on the 4-D tensors."""
    cfg = SCSAConfig(min_context=0, calib_steps=0, tau_default=tau, outliers=outliers)
    q_pos = torch.tensor([[n - 1]])
    ops, kernels = [], []
    for k, v in bufs:  # [1, Hkv, n, D]: the op's write-ahead at slot n - 1 writes what is there
        state = SparseState(cfg, H, HKV, D)
        k_new, v_new = k[:, :, n - 1:n].clone(), v[:, :, n - 1:n].clone()
        captured, real = [], layer_mod._native_call

        def capture(*a, real=real, captured=captured):
            captured.append(a)
            return real(*a)
        layer_mod._native_call = capture
        try:
            torch.ops.longattn.scsa_step(qs[0], k, v, q_pos, k_new, v_new, state.key, 0, scale)
        finally:
            layer_mod._native_call = real
        ops.append((state, k, v, k_new, v_new))
        kernels.append((k, v, captured[0][3:]))

    def static_op(i):
        state, k, v, k_new, v_new = ops[i % len(ops)]
        return torch.ops.longattn.scsa_step(qs[i], k, v, q_pos, k_new, v_new, state.key, 0, scale)

    def kernel(i):
        k, v, rest = kernels[i % len(kernels)]
        return layer_mod._native_call(qs[i], k, v, *rest)
    return {f"kernel@{tau}": kernel, f"static-op@{tau}": static_op}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=int, default=[4096, 32768])
    ap.add_argument("--taus", nargs="+", type=float, default=[0.02, 0.16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--copies", type=int, default=1,
                    help="cycle the calls through this many copies of the cache (past L3: cold reads)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--outliers", nargs="+", type=int, default=[SCSAConfig().outliers],
                    help="native SCSA arms per SCSAConfig.outliers value (the PyTorch arm: none)")
    ap.add_argument("--outlier-slots", action="store_true",
                    help="native arms ...+slots that read the outliers from the cache by slot, not the "
                         "index's copies (ClusterIndex.extra_k/extra_v)")
    ap.add_argument("--python", action="store_true",
                    help="arms kernel@tau and static-op@tau: the kernel alone and the static step's op, "
                         "to price the Python around the call")
    ap.add_argument("--kv", nargs="+", default=["f32"], choices=list(KV_FORMATS),
                    help="cache formats: arms scsa-native@tau/F and fused-dense/F for each F other than f32")
    ap.add_argument("--out", default=str(RESULTS / "scsa_call.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available():
        sys.exit("scsa_call: the native kernels are not built here (needs AVX2 and a compiler)")
    scale = D ** -0.5
    wide = native.has_avx512()
    rows = []
    for n in args.sizes:
        cache = synthetic_cache(n, HKV, D, seed=1)
        qs = cache.queries(args.calls, H, seed=2)  # [calls, 1, H, 1, D]
        # --copies > 1: call i reads copy i % copies (same contents, so the same opened sets;
        # each SCSA arm keeps one index per copy), enough of them to push the reads past L3
        bufs = [(cache.k, cache.v)] + [(cache.k.clone(), cache.v.clone()) for _ in range(args.copies - 1)]
        kv = lambda i: bufs[i % len(bufs)]  # noqa: E731
        k_pos = torch.arange(n).unsqueeze(0)
        q_pos = torch.full((1, 1), n - 1)
        none = cache.k[:, :, :0]
        layers = {}
        natives = {"scsa-native-avx2": "avx2", "scsa-native-avx512": "avx512"} if wide else {"scsa-native": None}
        tag = (lambda o: f"+out{o}") if len(args.outliers) > 1 else (lambda o: "")  # noqa: E731
        for tau in args.taus:
            reads = ["", "+slots"] if args.outlier_slots else [""]
            for arm, nat, o in [(a + tag(o) + r, True, o) for a in natives for o in args.outliers for r in reads] + \
                    [("scsa-torch", False, 0)]:
                isa = natives.get(arm.split("+")[0])
                per_copy = []
                for k, v in bufs:
                    layer = SCSALayer(SCSAConfig(min_context=0, calib_steps=0, tau_default=tau, native=nat,
                                                 outliers=o, isa=isa), H, HKV, D)
                    layer.attend(qs[0], k, v, scale)  # builds the index, untimed
                    if arm.endswith("+slots"):  # fixed n: no rebuild brings the copies back
                        layer.indexes[0].extra_k = layer.indexes[0].extra_v = None
                    per_copy.append(layer)
                layers[(arm, tau)] = per_copy
        arms = {f"{arm}@{tau}": (lambda i, Ls=per_copy: Ls[i % len(Ls)].attend(qs[i], *kv(i), scale))
                for (arm, tau), per_copy in layers.items()}
        if args.python:
            for tau in args.taus:
                arms.update(python_arms(n, tau, args.outliers[0], bufs, qs, scale))
        fused = lambda i, isa=None: torch.ops.longattn_cpu.decode_attention(  # noqa: E731
            qs[i], *kv(i), k_pos, q_pos, none, none, 0, 0, scale, isa=native.isa_code(isa))
        arms["fused-dense"] = fused  # the automatic form (native.dense_attention_avx512)
        if wide:  # each form forced
            arms["fused-dense-avx2"] = lambda i: fused(i, "avx2")
            arms["fused-dense-avx512"] = lambda i: fused(i, "avx512")
        for fmt in (f for f in args.kv if f != "f32"):
            stored = [tuple(encode(t, KV_FORMATS[fmt]) for t in b) for b in bufs]
            skv = lambda i, s=stored: s[i % len(s)]  # noqa: E731
            for tau in args.taus:
                per_copy = []
                for k, v in stored:
                    layer = SCSALayer(SCSAConfig(min_context=0, calib_steps=0, tau_default=tau,
                                                 outliers=args.outliers[0]), H, HKV, D)
                    layer.attend(qs[0], k, v, scale)  # builds the index, untimed
                    per_copy.append(layer)
                arms[f"scsa-native@{tau}/{fmt}"] = (lambda i, Ls=per_copy, f=skv: Ls[i % len(Ls)].attend(
                    qs[i], *f(i), scale))
            arms[f"fused-dense/{fmt}"] = lambda i, f=skv: torch.ops.longattn_cpu.decode_attention(
                qs[i], *f(i), k_pos, q_pos, none, none, 0, 0, scale)
        arms["read-floor"] = lambda i: [t.sum() for t in kv(i)]
        arms["sdpa-dense"] = lambda i: F.scaled_dot_product_attention(qs[i], *kv(i), scale=scale, enable_gqa=True)
        samples = {a: [] for a in arms}
        for _ in range(args.repeats):
            for a, fn in arms.items():
                samples[a].append(timed(fn, args.calls))
        med = {a: statistics.median(s) for a, s in samples.items()}
        opened = {}
        for (arm, tau), per_copy in layers.items():
            if arm.startswith("scsa-native"):
                rows_, calls = (sum(L.counters[c] for L in per_copy) for c in ("opened_rows", "calls"))
                opened[f"{arm}@{tau}"] = rows_ / calls / (HKV * n)
        row = {"rows": n, "ms": {a: 1e3 * t for a, t in med.items()}, "opened_fraction": opened,
               "speedup_vs_fused_dense": {a: med["fused-dense"] / t for a, t in med.items()},
               "dense_read_gb_s": {a: 2 * cache.k.nbytes / med[a] / 1e9 for a in med
                                   if a.startswith("fused-dense") or a == "read-floor"}}
        rows.append(row)
        print(f"N={n}: " + "  ".join(f"{a} {1e3 * t:.3f} ms" for a, t in med.items()), flush=True)
        print("   reads " + ", ".join(f"{a} {r:.1f} GB/s" for a, r in row["dense_read_gb_s"].items()), flush=True)
        print("   opened " + "  ".join(f"{a}: {100 * f:.1f}%" for a, f in opened.items()), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_result(args.out, {"threads": args.threads, "cpu": cpu_description(), "shape": [H, HKV, D],
                            "calls": args.calls, "copies": args.copies, "outliers": args.outliers,
                            "outlier_slots": args.outlier_slots, "python": args.python, "kv": args.kv,
                            "repeats": args.repeats, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
