"""Phi-3's longrope across its original context, against transformers' generate.

A longrope takes its short factors while the sequence fits the original context
(``original_max_position_embeddings``, 16 here) and its long factors past it. transformers'
Phi-3 generation drops its cache at the step that passes it and runs the whole sequence again,
so from there on every key is rotated with the long factors. longattn's Session does the same
(it rebuilds the cache from the tokens it was fed); any other way of passing the switch with
short-factor keys cached is refused in one line. A prompt prefilled in chunks rotates as one
call would, so a prompt already past the switch is long from its first token.
"""

import pytest
import torch

from conftest import tiny_dir
from longattn.errors import LongattnError

ORIG = 16
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)]}
OVER = dict(rope_parameters=LONGROPE, original_max_position_embeddings=ORIG, max_position_embeddings=64)


def _pair(**over):
    from transformers import AutoModelForCausalLM
    from longattn.checkpoint import load_checkpoint
    from longattn.models import build_model
    d = tiny_dir("phi3", **{**OVER, **over})
    ck = load_checkpoint(d, with_tokenizer=False)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    return build_model(ck.config, ck.state_dict), hf


def _hf_generate(hf, prompt, n):
    """transformers' greedy tokens and the logits it chose each from."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)


def _prompt(n, seed=1):
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("window", [None, 8], ids=["full", "window"])
@pytest.mark.parametrize("prompt_len, chunk", [(10, 512), (10, 3), (20, 6)],
                         ids=["short-prompt", "short-prompt-chunked", "long-prompt-chunked"])
def test_session_generates_as_transformers_across_the_switch(window, prompt_len, chunk):
    from longattn.engine.sampling import SamplingConfig
    from longattn.engine.session import Session, generate
    ours, hf = _pair(sliding_window=window)
    prompt, n = _prompt(prompt_len), 14
    want, want_logits = _hf_generate(hf, prompt, n)
    # greedy through the switch
    res = generate(Session(ours), [prompt], n, SamplingConfig(0.0), stop_ids=set(), chunk=chunk)
    assert res.tokens[0] == want
    # the logits of every step, transformers' tokens fed
    s = Session(ours)
    got = [s.prefill([prompt], chunk=chunk)[:, 0]] + [s.step(torch.tensor([t])) for t in want[:-1]]
    err = (torch.cat(got) - want_logits).abs().max().item()
    assert err < 1e-4, f"max |delta logit| {err:.2e}"


def test_the_switch_changes_the_function():
    """Keeping the short-factor keys past the switch gives other logits than transformers:
    the fixture is one where recomputing matters."""
    from longattn.cache import make_cache
    ours, hf = _pair()
    prompt = _prompt(10)
    want, want_logits = _hf_generate(hf, prompt, 8)
    for blk in ours.model.layers:  # no refusal: the short-factor keys stay in the cache
        blk.self_attn.rope_switch = None
    cache = make_cache(ours.config, model=ours)
    got = [ours(torch.tensor([prompt]), cache=cache)[:, -1]]
    got += [ours(torch.tensor([[t]]), cache=cache)[:, -1] for t in want[:-1]]
    moved = (torch.cat(got) - want_logits)[ORIG - len(prompt):].abs().max().item()
    assert moved > 1e-3, moved


def test_cached_keys_of_the_other_factors_refused():
    """A cache filled with short-factor keys cannot take a call past the switch outside the
    Session (the static decoder, a hand-driven cache): one line, naming the length."""
    from longattn.cache import make_cache
    ours, _ = _pair()
    cache = make_cache(ours.config, model=ours)
    ours(torch.tensor([_prompt(ORIG)]), cache=cache)
    with pytest.raises(LongattnError, match=f"passes the original context of {ORIG} tokens"):
        ours(torch.tensor([[5]]), cache=cache)


def test_session_with_a_given_cache_refuses_the_rebuild():
    from longattn.cache import make_cache
    from longattn.engine.session import Session
    ours, _ = _pair()
    s = Session(ours, cache=make_cache(ours.config, model=ours))
    s.prefill([_prompt(ORIG)])
    with pytest.raises(LongattnError, match="cannot rebuild a cache it was given"):
        s.step(torch.tensor([5]))


def test_prefill_logits_all_across_the_switch():
    """A second prefill that passes the switch gives the logits of its own tokens, each as a
    whole-sequence run with the long factors gives them."""
    from longattn.engine.session import Session
    ours, hf = _pair()
    first, second = _prompt(10), _prompt(12, seed=2)
    s = Session(ours)
    s.prefill([first])
    got = s.prefill([second], logits="all")
    with torch.no_grad():
        want = hf(torch.tensor([first + second])).logits[:, len(first):]
    err = (got - want).abs().max().item()
    assert err < 1e-4, f"max |delta logit| {err:.2e}"
