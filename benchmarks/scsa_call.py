"""One SCSA layer call vs one dense decode-attention call, Qwen2.5-0.5B head shapes.

Arms, alternated per repeat on the same synthetic clustered cache (14 query / 2 KV heads,
head_dim 64, float32; sparse.synthetic):
  * scsa-native: SCSALayer.attend with the C++ call (SCSAConfig.native, the default); where the
    CPU has AVX-512 VNNI, as two arms: scsa-native-avx2 and scsa-native-avx512 (the forms of
    its opened-cluster phase, bit-identical outputs; native.avx512);
  * scsa-torch:  the same layer on the PyTorch ops (native=False), same decisions;
  * fused-dense: longattn's fused C++ dense decode kernel over every row (the eager
    Session's and the static step's dense read);
  * sdpa-dense:  torch's scaled_dot_product_attention over every row.
Fixed thresholds (no calibration) so every arm reads the same thing each call.

    python benchmarks/scsa_call.py --threads 2 [--sizes 4096 32768] [--taus 0.02 0.16]

Writes benchmarks/results/scsa_call.json. Do not run beside tests or builds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from longattn.host import cpu_description  # noqa: E402
from longattn.ops import native  # noqa: E402
from longattn.sparse import SCSAConfig, SCSALayer  # noqa: E402
from longattn.sparse.synthetic import synthetic_cache  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
H, HKV, D = 14, 2, 64


def timed(fn, calls):
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - t0) / calls


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", type=int, default=[4096, 32768])
    ap.add_argument("--taus", nargs="+", type=float, default=[0.02, 0.16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "scsa_call.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available():
        sys.exit("scsa_call: the native kernels are not built here (needs AVX2 and a compiler)")
    scale = D ** -0.5
    wide = native.avx512(None)
    rows = []
    for n in args.sizes:
        cache = synthetic_cache(n, HKV, D, seed=1)
        qs = cache.queries(args.calls, H, seed=2)  # [calls, 1, H, 1, D]
        k, v = cache.k, cache.v
        k_pos = torch.arange(n).unsqueeze(0)
        q_pos = torch.full((1, 1), n - 1)
        none = k[:, :, :0]
        layers, form = {}, {}
        natives = {"scsa-native-avx2": False, "scsa-native-avx512": True} if wide else {"scsa-native": None}
        for tau in args.taus:
            for arm, nat in [(a, True) for a in natives] + [("scsa-torch", False)]:
                layer = SCSALayer(SCSAConfig(min_context=0, calib_steps=0, tau_default=tau, native=nat), H, HKV, D)
                layer.attend(qs[0], k, v, scale)  # builds the index, untimed
                layers[(arm, tau)] = layer
                form[f"{arm}@{tau}"] = natives.get(arm)
        arms = {f"{arm}@{tau}": (lambda i, L=layer: L.attend(qs[i], k, v, scale))
                for (arm, tau), layer in layers.items()}
        arms["fused-dense"] = lambda i: torch.ops.longattn_cpu.decode_attention(
            qs[i], k, v, k_pos, q_pos, none, none, 0, 0, scale)
        arms["sdpa-dense"] = lambda i: F.scaled_dot_product_attention(qs[i], k, v, scale=scale, enable_gqa=True)
        samples = {a: [] for a in arms}
        for _ in range(args.repeats):
            for a, fn in arms.items():
                native.avx512(form.get(a))  # None: the CPU's best
                samples[a].append(timed(fn, args.calls))
        native.avx512(None)
        med = {a: statistics.median(s) for a, s in samples.items()}
        opened = {}
        for (arm, tau), layer in layers.items():
            if arm.startswith("scsa-native"):
                c = layer.counters
                opened[tau] = c["opened_rows"] / c["calls"] / (HKV * n)
        row = {"rows": n, "ms": {a: 1e3 * t for a, t in med.items()}, "opened_fraction": opened,
               "speedup_vs_fused_dense": {a: med["fused-dense"] / t for a, t in med.items()}}
        rows.append(row)
        print(f"N={n}: " + "  ".join(f"{a} {1e3 * t:.3f} ms" for a, t in med.items()), flush=True)
        print("   opened " + "  ".join(f"tau {t}: {100 * f:.1f}%" for t, f in opened.items()), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"threads": args.threads, "cpu": cpu_description(), "shape": [H, HKV, D],
                                          "calls": args.calls,
                                          "repeats": args.repeats, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
