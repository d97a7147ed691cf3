"""The decode step built ahead of time (engine/aot_step.py): it agrees with the float64
reference as the eager step does, reads the weights it is given (none are baked in), is built
once and loaded after, survives a killed build and a damaged entry, and gets its own entry for
another format, policy, buffer layout, CPU capability or thread count; one package serves
every length."""

import pytest
import torch

from conftest import tiny_formats
from longattn.engine import aot_step
from longattn.engine.static_step import StaticDecoder
from longattn.errors import LongattnError
from longattn.models.prepared import from_prepared
from longattn.ops import native
from longattn.policy import AttentionPolicy
from model_paths import ids_for
from tolerance import max_err

from test_static_decode import decode_logits, reference_and_tol

pytestmark = pytest.mark.skipif(not native.available(), reason="the ahead-of-time step needs the native kernels")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGATTN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture()
def torch_temporaries(tmp_path, monkeypatch):
    """Where torch puts temporaries unless told otherwise, pointed at empty directories of this
    test: ``$TMPDIR`` (the C++ loader unpacks a package there, the compiler writes there) and
    ``TORCHINDUCTOR_CACHE_DIR``; returns a function listing what they hold."""
    tmp, inductor = tmp_path / "tmp", tmp_path / "inductor"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    return lambda: sorted(str(p) for d in (tmp, inductor) if d.exists() for p in d.rglob("*"))


def entries(cache):
    d = cache / "steps"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_aot_step_agrees_with_reference_and_reads_the_weights_it_is_given(cache):
    m, m64 = tiny_formats("gemma3", "int8")  # hybrid: a ring group with sinks and a full group
    pol = AttentionPolicy.build(m.config, "checkpoint", sinks=1)
    ids = ids_for(2, T=24, seed=3)
    n = 6
    ref, tol = reference_and_tol(m, m64, pol, ids, n)
    dec = StaticDecoder(m, pol, batch=2, max_len=32, compile="aot")
    assert len(entries(cache)) == 1
    err = max_err(decode_logits(dec, ids, n), ref)
    assert err <= tol, f"{err:.2e} > {tol:.2e}"
    # the same structure with other weights loads the same package and follows those weights
    g = torch.Generator().manual_seed(1)
    other = from_prepared(m.config, {k: v * (1 + 0.05 * torch.randn(v.shape, generator=g)) if v.is_floating_point()
                                     else v for k, v in m.state_dict().items()}, m.weights)
    mine = StaticDecoder(other, pol, batch=2, max_len=32, compile="aot")
    assert len(entries(cache)) == 1  # loaded, not built again
    eager = StaticDecoder(other, pol, batch=2, max_len=32, compile=False)
    got, want = decode_logits(mine, ids, n), decode_logits(eager, ids, n)
    assert max_err(got, want) <= tol and max_err(got, ref) > tol  # other weights, not m's


# routed experts and learned sinks; softcaps; int4 and int5 groups (the default formats of Q4
# and Q5 files)
@pytest.mark.parametrize("family, weights", [("gpt_oss", "int8"), ("gemma2", "int8"), ("llama", "int4"),
                                             ("qwen2", "int5")])
def test_aot_step_agrees_with_reference_on_other_families(cache, family, weights):
    m, m64 = tiny_formats(family, weights)
    pol = AttentionPolicy.from_config(m.config)
    ids = ids_for(1, T=20, seed=3)
    ref, tol = reference_and_tol(m, m64, pol, ids, 6)
    err = max_err(decode_logits(StaticDecoder(m, pol, max_len=24, compile="aot"), ids, 6), ref)
    assert err <= tol, f"{err:.2e} > {tol:.2e}"


def test_one_package_serves_every_length_and_entries_are_keyed_by_what_the_code_depends_on(cache, monkeypatch):
    m, m64 = tiny_formats("llama", "int8")
    dense = AttentionPolicy.from_config(m.config)
    StaticDecoder(m, dense, max_len=16, compile="aot")
    ids = ids_for(1, T=40, seed=2)
    ref, tol = reference_and_tol(m, m64, dense, ids, 8)
    long = StaticDecoder(m, dense, max_len=48, compile="aot")  # the full buffers' length is a symbol
    assert len(entries(cache)) == 1
    err = max_err(decode_logits(long, ids, 8), ref)
    assert err <= tol, f"{err:.2e} > {tol:.2e}"
    long.reset(64)
    assert len(entries(cache)) == 1
    win = AttentionPolicy.build(m.config, "window", window=5, sinks=2)
    keys = {aot_step.step_key(StaticDecoder(m, pol, max_len=n, compile=False))
            for pol, n in [(win, 16), (win, 32), (dense, 16), (dense, 64),
                           (AttentionPolicy.build(m.config, "window", window=5, sinks=1), 16),
                           (win, 6)]}  # a ring of 7 slots does not fit 6 positions: a full buffer
    assert len(keys) == 4
    f32, _ = tiny_formats("llama", "f32")
    assert aot_step.step_key(StaticDecoder(f32, win, max_len=16, compile=False)) not in keys
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "OTHER")
    other_cpu = aot_step.step_key(StaticDecoder(m, win, max_len=16, compile=False))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    other_threads = aot_step.step_key(StaticDecoder(m, win, max_len=16, compile=False))
    assert len(keys | {other_cpu, other_threads}) == 6


def test_killed_build_leaves_nothing_and_a_damaged_entry_is_rebuilt(cache, monkeypatch, torch_temporaries):
    """Also: a build and a load leave nothing of torch's outside the cache (its inductor cache,
    the unpacked package), nor any temporary inside it, while the loaded step runs on."""
    m, _ = tiny_formats("llama", "int8")
    pol = AttentionPolicy.build(m.config, "window", window=5, sinks=2)

    def killed(*a, **k):
        raise KeyboardInterrupt
    with monkeypatch.context() as mp:
        mp.setattr(torch._inductor, "aoti_compile_and_package", killed)
        with pytest.raises(KeyboardInterrupt):
            StaticDecoder(m, pol, max_len=16, compile="aot")
    assert entries(cache) == []  # nothing half-written in place (atomic_dir)
    dec = StaticDecoder(m, pol, max_len=16, compile="aot")
    assert torch_temporaries() == [] and len(entries(cache)) == 1  # built, loaded, no .tmp-* left
    ids = ids_for(1, T=8, seed=1)
    first = decode_logits(dec, ids, 4)
    assert torch.equal(decode_logits(StaticDecoder(m, pol, max_len=16, compile="aot"), ids, 4), first)
    assert torch_temporaries() == [] and len(entries(cache)) == 1  # loaded again: nothing more
    step = cache / "steps" / entries(cache)[0] / aot_step.STEP_FILE
    data = bytearray(step.read_bytes())
    data[len(data) // 2] ^= 0xFF
    step.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="damaged"):
        again = StaticDecoder(m, pol, max_len=16, compile="aot")
    assert torch.equal(decode_logits(again, ids, 4), first)


def test_aot_refuses_what_it_cannot_build():
    m, _ = tiny_formats("llama", "f32")
    with pytest.raises(LongattnError, match="compile is"):
        StaticDecoder(m, compile="jit")
    with pytest.raises(LongattnError, match="every length already"):
        StaticDecoder(m, max_len=16, compile="aot", dynamic=True)


def test_generate_runs_the_ahead_of_time_step_and_the_files_int4_by_default(tmp_path):
    import json

    from cli_helpers import run_cli
    from longattn.checkpoint.paths import cache_root
    from tiny_gguf import write_tiny_gguf
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", mlp_type="Q4_1", attn_type="Q4_0")
    runs = {}
    for flags in ((), ("--compile", "none"), ("--policy", "sparse"), ("--kv", "int8")):
        # the user's cache: its kernels are built already (a private one would build them again)
        r = run_cli(["generate", "--model", gguf, "--prompt", "the cat", "--max-new-tokens", 4, "--json",
                     "--threads", 2, *flags], cache_root(), native=True)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[flags] = json.loads(r.stdout.strip().splitlines()[-1])
    steps = [run["step"] for run in runs.values()]
    assert steps == ["aot", "eager", "eager", "aot"]  # sparse layers have no ahead-of-time step
    # the compiled (paged) step's pool stores bfloat16 by default (int8 asked for); the eager step float32
    assert [run["kv"] for run in runs.values()] == ["bf16", "f32", "f32", "int8"]
    assert {run["weights"] for run in runs.values()} == {"int4+int8:embed,lm_head"}


def test_a_failed_build_falls_back_to_the_eager_step_by_default_and_is_refused_by_name(
        cache, tmp_path, monkeypatch, capsys):
    """A machine where the step cannot be built (no C++ compiler, say): the default run says so
    in one line and answers from the eager step, the same tokens; ``--compile aot`` is refused
    in one line (exit 2); nothing is left in the cache."""
    import json

    from longattn.cli.main import main
    from tiny_gguf import write_tiny_gguf
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    args = ["generate", "--model", str(gguf), "--prompt", "the cat", "--max-new-tokens", "4", "--json",
            "--threads", "2"]
    assert main(args + ["--compile", "none"]) == 0
    eager = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    def no_compiler(*a, **k):
        raise RuntimeError("g++: command not found")
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiler)
    assert main(args) == 0
    out, err = capsys.readouterr()
    got = json.loads(out.strip().splitlines()[-1])
    assert "could not be built (RuntimeError: g++: command not found); decoding with the eager step" in err
    assert got["step"] == "eager" and got["text"] == eager["text"]
    assert main(args + ["--compile", "aot"]) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("longattn:")]
    assert line.endswith("the ahead-of-time decode step could not be built (RuntimeError: g++: command not "
                         "found); decode with the eager step (--compile none)")
    assert entries(cache) == []
