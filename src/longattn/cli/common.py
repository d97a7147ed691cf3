"""Options shared by every command that runs a model, and the one-line error contract."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path

from ..errors import LongattnError


# The fastest weights whose quality cost is negligible (models.weights.auto_recipe): a file's
# own 4- and 5-bit groups as int4 and int5 (its weights exactly), int8 elsewhere (<= 0.005
# bits/token in all on the bundled models; int4 made from other formats costs 0.1-0.37:
# docs/benchmarks.md).
DEFAULT_WEIGHTS = "auto"


def default_threads() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def add_model_args(p: argparse.ArgumentParser, default_model: str = "smollm2-135m") -> None:
    p.add_argument("--model", default=default_model,
                   help="bundled model name (see `longattn models`), a .gguf file or an HF directory")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="torch intra-op threads (the CPUs this process may use); several "
                        "streams share one pool, so do not start one process per stream")
    p.add_argument("--weights", default=DEFAULT_WEIGHTS,
                   help="weight format, prepared once and memory-mapped from the cache after: auto "
                        "(the default: int4 and int5 for the matrices a GGUF stores as Q4_0/Q4_1 and "
                        "Q5_0/Q5_1 groups, read as they are, int8 for the rest: <= 0.005 bits/token "
                        "against the checkpoint's weights), f32 (the reference), bf16, int8 "
                        "(per output row), int4 or int5 (groups of 32; decode "
                        "quantizes activations to int8 per block of 32); int4+int8:embed keeps the "
                        "matrices whose module name contains 'embed' (the embedding table and tied "
                        "head) in int8 (fragments separated by commas; int5+int8:qkv+int4:gate_up "
                        "names several formats)")
    p.add_argument("--reference", action="store_true",
                   help="run PyTorch's ops instead of longattn's native kernels everywhere (the reference "
                        "the kernels are tested against; the same as LONGATTN_NATIVE=off)")
    # the first releases spelled it --dtype float32|bfloat16
    p.add_argument("--dtype", dest="weights", help=argparse.SUPPRESS,
                   type=lambda v: {"float32": "f32", "bfloat16": "bf16"}.get(v, v))


def add_policy_args(p: argparse.ArgumentParser, auto: bool = False, sparse: bool = True) -> None:
    """The policy options; ``auto``: offer ``--policy auto`` (a command that knows how many
    tokens it will generate, so it can weigh SCSA's costs against its saving); ``sparse``:
    offer ``--policy sparse`` and its tuning flags (a command whose cache has a sparse path)."""
    p.add_argument("--policy", default="checkpoint",
                   choices=["checkpoint", "dense", "window", "global"] + (["sparse"] if sparse else [])
                   + (["auto"] if auto else []),
                   help="checkpoint: trained windows; dense: none; window: --window on every layer; "
                        "global: --window on the checkpoint's global layers"
                        + ("; sparse: SCSA decode" if sparse else "")
                        + ("; auto: SCSA on the layers where the cost model predicts it pays for this "
                           "prompt and --max-new-tokens (taus calibrated by an earlier sparse run), "
                           "the checkpoint's attention elsewhere" if auto else ""))
    p.add_argument("--window", type=int, default=None, help="window W (keys per query incl. itself)")
    p.add_argument("--sinks", type=int, default=0, help="sink tokens always readable")
    if not sparse:
        return
    # SUPPRESS: an option not given leaves SCSAConfig's default (named in the help) in force
    p.add_argument("--sparse-min-context", type=int, default=argparse.SUPPRESS, metavar="N",
                   help="sparse: layers run dense below N cached tokens (default: 8192)")
    p.add_argument("--sparse-tolerance", type=float, default=argparse.SUPPRESS, metavar="T",
                   help="sparse: relative output error per head that calibration holds the median "
                        "(or --sparse-calib-quantile's order statistic) of its errors to (default: 0.025)")
    p.add_argument("--sparse-calib-quantile", type=float, default=argparse.SUPPRESS, metavar="Q",
                   help="sparse: which order statistic of a head's calibration errors must meet the "
                        "tolerance (default: 0.5, the median; 0.9 = nine steps in ten, opens more)")
    p.add_argument("--sparse-outliers", type=int, default=argparse.SUPPRESS, metavar="K",
                   help="sparse: keys per cluster, farthest from its centroid, always read exactly; "
                        "0 = none (default: 8)")
    p.add_argument("--sparse-probe", dest="sparse_probe_dims", type=int, default=argparse.SUPPRESS, metavar="R",
                   help="sparse: every key also scored over the query's R largest dimensions; the "
                        "clusters of each query head's best key open whatever the stop rule says; "
                        "more answers match dense on retrieval, at a lower speed-up (default: 0 = off)")
    p.add_argument("--sparse-always", dest="sparse_dense_when_cheaper", action="store_false",
                   default=argparse.SUPPRESS,
                   help="sparse: keep calibrated layers sparse even where the cost model predicts "
                        "their dense read is cheaper (default: such layers attend densely)")


def add_json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with the figures as the last line of stdout")


def setup_threads(n: int) -> None:
    cpus = os.cpu_count() or 1
    if n is None or n < 1:
        raise LongattnError(f"--threads must be >= 1, got {n}")
    if n > 4 * cpus:  # torch crashes starting tens of thousands of threads; beyond the CPUs they only wait
        raise LongattnError(f"--threads {n} is more than 4x this machine's {cpus} CPUs; use at most {cpus}")
    import torch  # here, not at module level: `longattn --help` and `models` never load torch
    torch.set_num_threads(n)


def emit_json(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, default=float) + "\n")
    sys.stdout.flush()


def add_kv_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv", choices=["f32", "bf16", "int8"], default="f32",
                   help="how the KV caches store keys and values: f32 (the reference the lab measures "
                        "against), bf16 (half the bytes, widened exactly when read) or int8 (codes with a "
                        "float32 scale per 32 values, keys rotated: 0.28x the bytes of f32)")


def add_context_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-beyond-context", action="store_true",
                   help="run positions past the model's trained context under a policy with full-"
                        "attention layers (otherwise refused: the model never saw such positions)")


def check_policy_args(args, cfg=None) -> None:
    """Refuse options the chosen policy would ignore, and impossible windows, sink counts and
    SCSA settings, before any slow work (a refusal names the option the user passed, never
    one implied). ``cfg``: the model's config, for the bounds that depend on it (the trained
    context, the head size); without it only the bounds of every model are checked."""
    window = getattr(args, "window", None)
    if window is not None and window < 1:
        raise LongattnError(f"--window must be >= 1 (keys per query, itself included), got {window}; "
                            "for full attention use --policy dense")
    sinks = getattr(args, "sinks", 0)
    if sinks is not None and sinks < 0:
        raise LongattnError(f"--sinks must be a non-negative integer (tokens always readable), got {sinks}")
    if window is not None and args.policy == "dense":
        raise LongattnError("--window has no effect under --policy dense; drop one of them")
    sparse = sorted(k for k in vars(args) if k.startswith("sparse_"))
    if sparse and args.policy not in ("sparse", "auto"):
        flags = ", ".join(_sparse_flag(k) for k in sparse)
        verb = "only applies" if len(sparse) == 1 else "only apply"
        raise LongattnError(f"{flags} {verb} with --policy sparse; drop them or add --policy sparse")
    if cfg is not None:
        name = cfg.name or "the model"
        if sinks and sinks > cfg.max_context:
            raise LongattnError(f"--sinks {sinks} is more than {name}'s trained context ({cfg.max_context}); "
                                "a few (e.g. 4) are enough")
        if window is not None and window > cfg.max_context:
            raise LongattnError(f"--window {window} is longer than {name}'s trained context ({cfg.max_context}), "
                                f"where it means full attention; use --window <= {cfg.max_context} or "
                                "--policy dense")
    if sparse:
        check_sparse_args(args, cfg)


def _sparse_flag(dest: str) -> str:
    """The option a ``--sparse-*`` argparse destination comes from."""
    return "--" + dest.replace("_", "-").replace("-probe-dims", "-probe").replace("-dense-when-cheaper", "-always")


# The most cached tokens --sparse-min-context may name: far above any cache a machine holds, so
# a mistyped count (10**30) is refused instead of quietly keeping every layer dense.
MAX_MIN_CONTEXT = 2**31 - 1


def check_sparse_args(args, cfg=None) -> None:
    """Refuse a ``--sparse-*`` value outside what SCSA runs, naming the option and its range
    (SCSAConfig refuses the same settings, but by its field names and only once the model is
    read; a huge count would otherwise reach the native kernel's 64-bit arguments)."""
    from ..sparse.config import SCSAConfig

    def refuse(dest: str, rng: str, why: str = "") -> None:
        raise LongattnError(f"{_sparse_flag(dest)} must be {rng}{why}, got {getattr(args, dest)}")
    n = getattr(args, "sparse_min_context", None)
    if n is not None and not 0 <= n <= MAX_MIN_CONTEXT:
        refuse("sparse_min_context", f">= 0 and at most {MAX_MIN_CONTEXT}", " (cached tokens)")
    t = getattr(args, "sparse_tolerance", None)
    if t is not None and not 0 < t <= 1:
        refuse("sparse_tolerance", "> 0 and at most 1", " (a relative output error per head)")
    q = getattr(args, "sparse_calib_quantile", None)
    if q is not None and not 0 < q <= 1:
        refuse("sparse_calib_quantile", "in (0, 1]", " (an order statistic, as a fraction of the steps)")
    k = getattr(args, "sparse_outliers", None)
    cluster = SCSAConfig().cluster_size  # the CLI leaves it at its default
    most = cluster // 2  # clustering.outlier_width: at most half of a cluster
    if k is not None and not 0 <= k <= most:
        refuse("sparse_outliers", f">= 0 and at most {most}",
               f" (keys per {cluster}-key cluster read exactly; 0 = none)")
    r = getattr(args, "sparse_probe_dims", None)
    if r is not None and r < 0:
        refuse("sparse_probe_dims", ">= 0", " (query dimensions; 0 = off)")
    if r is not None and cfg is not None and r > cfg.head_dim:
        refuse("sparse_probe_dims", f"in 0..{cfg.head_dim}",
               f" (dimensions of {cfg.name or 'the model'}'s {cfg.head_dim}-dimensional query heads; 0 = off)")


def policy_from_args(cfg, args):
    """The AttentionPolicy the options ask for on the model of ``cfg`` (see check_policy_args)."""
    from ..policy import AttentionPolicy
    check_policy_args(args, cfg)
    mode = args.policy
    if args.window is not None and mode == "checkpoint":
        mode = "window"  # --window alone imposes it on every layer
    if mode in ("sparse", "auto"):  # auto: the sparse policy, which the command then restricts
        from ..sparse.policy import sparse_policy  # noqa: WPS433 (wired in the SCSA module)
        return sparse_policy(cfg, args)
    return AttentionPolicy.build(cfg, mode=mode, window=args.window, sinks=args.sinks)


def check_context(cfg, policy, positions: int, args, what: str) -> None:
    """Refuse ``positions`` (``what`` says how they add up) past ``cfg.max_context`` when a
    layer of ``policy`` attends without a window, unless --allow-beyond-context; a windowed
    layer only ever reads its last W positions, so such runs are what windows are for."""
    if positions <= cfg.max_context or getattr(args, "allow_beyond_context", False):
        return
    full = sum(lp.window is None for lp in policy.layers)
    if not full:
        return
    stream = "; with `longattn stream` add --reindex to keep positions within the cache" \
        if hasattr(args, "reindex") else ""
    raise LongattnError(f"{what} is {positions} positions, past {cfg.name or 'the model'}'s trained context "
                        f"of {cfg.max_context}, and {full} of its {len(policy.layers)} layers attend "
                        f"without a window; run it with a window on every layer (--policy window "
                        f"--window W --sinks 4){stream}, or pass --allow-beyond-context")


def check_token_ids(cfg, ids) -> None:
    """Refuse token ids the model has no embedding for (a tokenizer from another model)."""
    top = max((int(i) for i in ids), default=-1)
    if top >= cfg.vocab_size:
        raise LongattnError(f"the tokenizer gives token id {top} but {cfg.name or 'the model'} has "
                            f"{cfg.vocab_size} embeddings; the tokenizer belongs to another model")


# The most a prompt or text file may hold. Its text is tokenized in one piece, so 64 MiB (some
# 16 million tokens, past every bundled model's context many times over) bounds what one
# run reads and holds, whatever the path names.
MAX_TEXT_BYTES = 64 * 2**20


def read_text_file(path: str, what: str, limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of the regular file at ``path``, read whole.

    Refused in one line naming ``what`` (nothing read in part): anything but a regular file (a
    FIFO would wait for a writer for ever, ``/dev/zero`` never ends), a file over ``limit``
    bytes, a binary file (a NUL byte) or text that is not UTF-8 (the first bad byte named).
    The file is opened without waiting, so a FIFO is refused rather than waited on.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # OSError (missing, unreadable): run_guarded's line
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if stat.S_ISDIR(st.st_mode):
            raise LongattnError(f"{what} {path} is a directory, not a text file")
        if not stat.S_ISREG(st.st_mode):
            raise LongattnError(f"{what} {path} is not a regular file (a pipe, device or socket); "
                                "save the text to a file and pass that")
        data = f.read(limit + 1)  # a file that grows while read still stops here
    if st.st_size > limit or len(data) > limit:
        size = max(st.st_size, len(data))
        raise LongattnError(f"{what} {path} holds {size} bytes, more than the {limit // 2**20} MiB "
                            "longattn reads from a text file; pass a shorter text")
    if b"\0" in data:
        raise LongattnError(f"{what} {path} is a binary file (NUL byte at offset {data.index(0)}), not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LongattnError(f"{what} {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                            f"{e.start}); convert it, e.g. iconv -t utf-8") from None


def check_text_arg(text: str, flag: str) -> str:
    """``text`` (an option's value) when it is valid Unicode. Python hands over argv bytes that
    are not UTF-8 as lone surrogates (``$'\\xff'`` arrives as U+DCFF), which no tokenizer can
    encode: refused in one line naming ``flag`` and the first bad byte, as a file's would be."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as e:
        ch, at = text[e.start], len(text[:e.start].encode("utf-8", "surrogateescape"))
        what = (f"byte 0x{ord(ch) - 0xDC00:02x} at offset {at}" if 0xDC80 <= ord(ch) <= 0xDCFF
                else f"a lone surrogate U+{ord(ch):04X} at offset {at}")
        raise LongattnError(f"{flag} is not UTF-8 text ({what}); pass UTF-8 text, or put the text "
                            "in a UTF-8 file") from None


def check_chunk(chunk: int) -> None:
    if chunk < 1:
        raise LongattnError(f"--chunk must be >= 1 (tokens per forward), got {chunk}")


def open_checkpoint(args, progress: bool = True):
    """The checkpoint of --model: config and tokenizer, its weights not read yet (so the checks
    that need only the config refuse bad options before the slow part)."""
    from ..checkpoint import load_checkpoint
    from ..models.weights import parse_recipe
    parse_recipe(getattr(args, "weights", DEFAULT_WEIGHTS))  # a bad format fails before the slow load
    return load_checkpoint(args.model, progress=progress, read_weights=False)


def model_for(ck, args, progress: bool = True):
    """The model of ``ck`` in --weights, from the prepared-weights cache (built once)."""
    from ..checkpoint.prepared import prepared_model
    return prepared_model(ck, getattr(args, "weights", DEFAULT_WEIGHTS), progress=progress)


def load_model(args, progress: bool = True):
    """(checkpoint, model) from --model / --weights, with a one-line error on bad input."""
    ck = open_checkpoint(args, progress)
    return ck, model_for(ck, args, progress)


def _close_progress_bars() -> None:
    """End any progress bar still drawn and its line, so a message that follows starts a
    line of its own on a terminal and in a log file alike."""
    tqdm = sys.modules.get("tqdm")
    bars = list(getattr(getattr(tqdm, "tqdm", None), "_instances", ()) or ())
    for bar in bars:
        try:
            bar.close()
        except Exception:  # a half-built bar: nothing more to tidy
            pass
    if bars:
        sys.stderr.write("\n")


def fail(message: str, code: int = 2) -> int:
    """Print ``longattn: <message>`` as one line on stderr (after any progress bar); return ``code``."""
    _close_progress_bars()
    sys.stdout.flush()
    print(f"longattn: {message}", file=sys.stderr, flush=True)
    return code


def run_guarded(fn, args) -> int:
    """Run a command; a LongattnError (or bad file) becomes one line on stderr and exit 2."""
    if getattr(args, "reference", False):
        from ..ops import native
        native.use_reference()
    try:
        return fn(args) or 0
    except LongattnError as e:
        return fail(f"error: {e}")
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except OSError as e:  # unreadable input, a full disk, a directory where a file was meant
        where = f": {e.filename}" if e.filename else ""
        return fail(f"error: {e.strerror or e}{where}")
    except MemoryError:
        return fail("error: out of memory; use a smaller context, window or batch")
    except RuntimeError as e:  # torch reports a failed allocation as a RuntimeError
        if "allocate" not in str(e) or "memory" not in str(e):
            raise
        return fail("error: out of memory; use a smaller context, window or batch")

# ---------------------------------------------------------------- lab commands
# The experiment commands (quality, receptive, cache, scaling, sinks, retrieval) share
# their parser's frame, the progress ticker and the way they write results.

def add_lab_parser(sub, name: str, help: str, description: str,
                   model: bool = True) -> argparse.ArgumentParser:
    """The subparser of a lab command: defaults shown in --help and, unless ``model`` is
    False, the model options (add_model_args) first."""
    p = sub.add_parser(name, help=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description=description)
    if model:
        add_model_args(p)
    return p


def add_output_args(p: argparse.ArgumentParser, out: str, run) -> None:
    """The closing options of a lab command: --out (default ``out``), --json; ``run`` runs it."""
    p.add_argument("--out", default=out, help="directory for the JSON and PNG")
    add_json_arg(p)
    p.set_defaults(func=run)


def progress_ticker(total: int, desc: str, unit: str):
    """``(bar, tick)``: a progress bar on stderr and ``tick(label)``, which shows the label
    and advances the bar by one; close the bar when done."""
    from ..lab.plots import progress_bar
    bar = progress_bar(total, desc, unit=unit)

    def tick(label):
        bar.set_postfix_str(label)
        bar.update(1)
    return bar, tick


def save_results(args, out, stem: str, doc: dict, plot, summary=None) -> None:
    """Write ``out/stem.json`` (``doc``) and ``out/stem.png`` (``plot(path)``), print what was
    written, and with --json print ``summary()`` (default: ``doc``) as the last line of stdout."""
    from ..lab.plots import write_json, written
    paths = [write_json(out / f"{stem}.json", doc)]
    png = out / f"{stem}.png"
    plot(png)
    paths.append(png)
    print(written(paths))
    if args.json:
        emit_json(doc if summary is None else summary())


def load_text_model(args, needs: str):
    """``(checkpoint, model, encode)`` like load_model, for a command that reads text: a
    checkpoint without a tokenizer is refused ("<name> has no tokenizer; <needs>");
    ``encode(text)`` gives the token ids."""
    ck, model = load_model(args)
    tok = ck.tokenizer
    if tok is None:
        raise LongattnError(f"{ck.name} has no tokenizer; {needs}")
    return ck, model, lambda s: tok(s)["input_ids"]
