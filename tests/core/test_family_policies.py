"""Every attention policy on every family, through every way of running it.

A grid of family x policy x runner (the engine Session on its ring/auto cache, growing
caches trimmed to the window, a span evicted with renumbering, the lab's stream scoring,
the static decoder behind ``generate --compile`` run uncompiled, int8 and int4 weights):
each combination either runs (a 40-token prompt, 8 decode steps, finite logits) or refuses
with a one-line LongattnError naming what it cannot
do. Any other exception is a bug. Where an exact check is cheap it is made: a dense policy
equals the checkpoint's own on a family with no trained windows (torch.equal).
"""

import functools

import pytest
import torch

from conftest import tiny_dir
from longattn.errors import LongattnError

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt_oss"]
POLICIES = ["checkpoint", "dense", "window", "global", "sparse"]
RUNNERS = ["ring", "evict", "evict_span", "stream", "static", "int8", "int4"]
W, S, T, STEPS = 6, 2, 40, 8  # W + S < T, so prompts cross the imposed windows


@functools.lru_cache(maxsize=None)
def _model(family: str, weights: str = "f32"):
    from longattn.checkpoint import load_checkpoint
    from longattn.models import build_model
    ck = load_checkpoint(tiny_dir(family), with_tokenizer=False)
    return build_model(ck.config, ck.state_dict, weights=weights)


def _policy(cfg, name: str):
    from longattn.policy import AttentionPolicy
    if name == "sparse":
        from longattn.sparse import SCSAConfig
        from longattn.sparse.policy import build_sparse_policy
        return build_sparse_policy(cfg, SCSAConfig(min_context=0))
    if name in ("window", "global"):
        return AttentionPolicy.build(cfg, name, window=W, sinks=S)
    return AttentionPolicy.build(cfg, name)


def _ids(cfg, n: int = T) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(3))


def _decode(step, logits: torch.Tensor) -> torch.Tensor:
    """STEPS greedy steps from prefill ``logits [1, V]``; -> every step's logits ``[STEPS+1, V]``."""
    outs = [logits]
    for _ in range(STEPS):
        outs.append(step(outs[-1].argmax(-1)))
    return torch.cat(outs)


def _run(family: str, policy_name: str, runner: str) -> tuple:
    """(logits ``[N, V]``, policy) of one combination (raises LongattnError where it is refused)."""
    model = _model(family, runner if runner in ("int8", "int4") else "f32")
    cfg = model.config
    policy = _policy(cfg, policy_name)
    ids = _ids(cfg)
    return _decoded(model, policy, ids, runner), policy


def _decoded(model, policy, ids, runner: str) -> torch.Tensor:
    """Prefill ``ids [1, T]`` and decode under ``policy`` the ``runner`` way -> logits ``[N, V]``."""
    from longattn.cache import make_cache
    from longattn.cache.evict import evict, trim_to_window
    from longattn.engine import Session
    from longattn.engine.static_step import StaticDecoder
    from longattn.lab.stream import stream_score
    cfg = model.config
    if runner in ("ring", "int8", "int4"):
        sess = Session(model, policy)
        _decoded.last_cache = sess.cache  # what the ops kept (test_imposed_policy_takes_effect)
        return _decode(sess.step, sess.prefill(ids, chunk=16)[:, 0])
    if runner == "evict":  # growing caches trimmed to each layer's window between steps
        sess = Session(model, policy, cache=make_cache(cfg, policy, kind="growing", model=model))
        logits = sess.prefill(ids, chunk=16)[:, 0]

        def step(tok):
            trim_to_window(sess.cache, policy)
            return sess.step(tok)
        return _decode(step, logits)
    if runner == "evict_span":  # a span cut out of the middle, later keys re-rotated (ring/auto cache)
        sess = Session(model, policy)
        logits = sess.prefill(ids, chunk=16)[:, 0]
        evict(sess.cache, 4, 10, model)
        return _decode(sess.step, logits)
    if runner == "stream":
        cache = make_cache(cfg, policy, kind="auto", model=model)
        res = stream_score(model, _ids(cfg, T + STEPS)[0], policy, cache, chunk=16)
        assert res.scored == T + STEPS - 1
        return torch.tensor([[res.bits_per_token]])
    if runner == "static":
        dec = StaticDecoder(model, policy, compile=False, max_len=64)
        return _decode(dec.step, dec.prefill(ids, chunk=16)[:, 0])
    raise ValueError(runner)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("policy_name", POLICIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_policy_runs_or_refuses_in_one_line(family, policy_name, runner):
    try:
        out, _ = _run(family, policy_name, runner)
    except LongattnError as e:
        msg = str(e)
        assert msg and "\n" not in msg, f"{family}/{policy_name}/{runner}: refusal is not one line: {msg!r}"
        return
    assert torch.isfinite(out).all(), f"{family}/{policy_name}/{runner}: non-finite logits"


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_equals_checkpoint_without_trained_windows(family):
    cfg = _model(family).config
    if any(w is not None for w in cfg.layer_windows):
        pytest.skip(f"{family} has trained windows: dense is a different function")
    a, b = _run(family, "checkpoint", "ring")[0], _run(family, "dense", "ring")[0]
    assert torch.equal(a, b)


@pytest.mark.parametrize("policy_name", ["window", "global", "sparse"])
@pytest.mark.parametrize("family", FAMILIES)
def test_imposed_policy_takes_effect(family, policy_name):
    """An imposed policy that runs changes what runs: W lands on a layer, SCSA answers decode
    steps. On a checkpoint windowed on every layer "global" and "sparse" have no global layer
    to act on, and SCSA has no term for score soft-capping: those are refused,
    never run as another policy under this one's name."""
    from longattn.sparse.policy import sparse_layers, stream_layers
    try:
        _, policy = _run(family, policy_name, "ring")
    except LongattnError as e:
        assert "\n" not in str(e)
        cfg = _model(family).config
        no_global = all(w is not None for w in cfg.layer_windows)
        no_scsa_term = cfg.attn_softcap is not None
        assert no_global or (policy_name == "sparse" and no_scsa_term), f"{family}/{policy_name}: {e}"
        return
    if policy_name == "sparse":
        layers = sparse_layers(policy)
        assert layers and sorted(stream_layers(_decoded.last_cache)) == layers, f"{family}: SCSA never ran"
    else:
        assert W in policy.windows and all(lp.sinks == S for lp in policy.layers if lp.window == W)


@pytest.mark.parametrize("family", FAMILIES)
def test_lab_cache_and_modes_on_every_family(family):
    """The cache lab's policies build on every family and their measured bytes equal the
    hybrid-cache formula to the byte; the quality/retrieval "auto" mode imposes W somewhere."""
    from longattn.lab.cachebytes import cache_sweep, named_policies
    from longattn.lab.quality import resolve_mode
    from longattn.lab.retrieval import retrieval_policies
    model = _model(family)
    cfg = model.config
    res = cache_sweep(cfg, named_policies(cfg, W, S), [5, T], model=model, chunk=16)
    assert all(r["match"] for r in res["rows"]), [r for r in res["rows"] if not r["match"]]
    mode = resolve_mode(cfg, "auto")
    imposed = [pol for label, pol in retrieval_policies(cfg, W, S, mode) if label.startswith(f"window {W}")]
    assert imposed and all(W in pol.windows for pol in imposed), f"{family}: auto mode {mode} imposes no window"


@pytest.mark.parametrize("family", FAMILIES)
def test_lab_measurements_on_every_family(family):
    """receptive, sinks and scaling run on every family; sink mass (over cached tokens) is
    refused in one line where learned sink logits hold a share no token holds."""
    from longattn.lab.receptive import receptive_field
    from longattn.lab.scaling import decode_step_times
    from longattn.lab.sinkmass import sink_mass
    model = _model(family)
    cfg = model.config
    ids = _ids(cfg)[0]
    receptive_field(model, ids, W, sinks=S)
    decode_step_times(model, [16, 32], W, sinks=S, repeats=1, warmup=0)
    try:
        res = sink_mass(model, ids, policy=_policy(cfg, "window"))
    except LongattnError as e:
        assert cfg.learned_sinks and "\n" not in str(e), str(e)
        return
    assert not cfg.learned_sinks and len(res["mass"]) == cfg.num_layers


@pytest.mark.parametrize("policy_name", ["checkpoint", "window"])
@pytest.mark.parametrize("family", FAMILIES)
def test_trim_to_window_decodes_as_before(family, policy_name):
    """trim_to_window drops only keys no query can read: with the fused decode kernel (it
    visits the allowed slots only) decoding is bit-identical to the untrimmed growing cache.
    Paths that read by matmul (score soft-capping, the kernel not built) sum
    over a different number of masked slots, so there the check is skipped."""
    from longattn.cache import make_cache
    from longattn.engine import Session
    from longattn.ops import native
    model = _model(family)
    cfg = model.config
    if not native.available() or cfg.attn_softcap is not None:
        pytest.skip(f"{family}: decode steps read by matmul here")
    policy = _policy(cfg, policy_name)
    if all(w is None for w in policy.windows):
        pytest.skip(f"{family}/{policy_name}: no window, nothing to trim")
    trimmed = _decoded(model, policy, _ids(cfg), "evict")
    sess = Session(model, policy, cache=make_cache(cfg, policy, kind="growing", model=model))
    assert torch.equal(trimmed, _decode(sess.step, sess.prefill(_ids(cfg), chunk=16)[:, 0]))
