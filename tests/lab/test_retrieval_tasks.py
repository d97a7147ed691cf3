"""Retrieval task generators (lab/tasks.py), their scoring, and the retrieval sweep."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import zlib

import pytest
from hypothesis import given, settings, strategies as st

from longattn.lab import tasks as T


def toy_encode(text: str) -> list:
    """A cheap deterministic tokenizer: words, numbers and punctuation, one token each."""
    return [zlib.crc32(t.encode()) % 96 for t in re.findall(r"\w+|[^\w\s]", text)]


@functools.lru_cache(maxsize=1)
def real_tokenizer():
    from longattn.checkpoint import load_checkpoint
    return load_checkpoint("smollm2-135m", progress=False).tokenizer


def real_encode(text: str) -> list:
    return real_tokenizer()(text)["input_ids"]


def _needle_text(s: T.Sample) -> str:
    """The first needle string of the sample, as it appears in the prompt."""
    if s.task == "passkey":
        return T.PASSKEY_NEEDLE.format(key=s.outputs[0])
    if s.task == "vt":
        return f"VAR {s.outputs[0]} = {s.extra['value']}"
    first = min((s.prompt.index(f"is: {o}.") for o in s.outputs))
    return s.prompt[s.prompt.rindex("One of the special magic", 0, first):first]


def _distance_by_offsets(s: T.Sample) -> int:
    """Needle distance measured independently: the token holding the needle's first character,
    found through the fast tokenizer's offset mapping."""
    tok = real_tokenizer()
    enc = tok(s.prompt, return_offsets_mapping=True)
    at = s.prompt.rindex(_needle_text(s)) if s.task == "vt" else s.prompt.index(_needle_text(s))
    idx = next(i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > at and b > a)
    return len(enc["input_ids"]) - idx


def _max_unit_tokens(s: T.Sample, encode) -> int:
    if s.haystack.startswith("essay"):
        return max(len(encode(" " + u)) for u in T.split_sentences(s.input))
    return len(encode(" " + T.NOISE_LINE))


# ------------------------------------------------------------------------------ generators

@pytest.mark.real
@pytest.mark.parametrize("task", T.TASKS)
@pytest.mark.parametrize("distance", [150, 600])
def test_needle_at_requested_distance_real_tokenizer(task, distance):
    s = T.make_sample(task, real_encode, distance, 1024, seed=7)
    assert s.length == len(real_encode(s.prompt)) <= 1024
    assert s.length >= 1024 - 2 * _max_unit_tokens(s, real_encode)  # the haystack fills the budget
    assert abs(s.needle_distance - distance) <= _max_unit_tokens(s, real_encode), (s.needle_distance, distance)
    assert _distance_by_offsets(s) == s.needle_distance


@pytest.mark.parametrize("task", T.TASKS)
def test_answers_present_exactly_once(task):
    s = T.make_sample(task, toy_encode, 300, 900, seed=11)
    body = s.input
    if task == "passkey":
        assert body.count(T.PASSKEY_NEEDLE.format(key=s.outputs[0])) == 1
        assert body.count(s.outputs[0]) == 2  # twice inside the one needle line
        assert s.prompt.endswith("What is the pass key? The pass key is")
    elif task == "vt":
        task_part = body[body.rindex("Memorize and track"):]
        value = s.extra["value"]
        assert task_part.count(f"VAR {s.outputs[0]} = {value}") == 1
        hops = [task_part.index(f"VAR {b} = VAR {a} ") for a, b in zip(s.outputs, s.outputs[1:])]
        assert hops == sorted(hops) and task_part.index(f"= {value}") < hops[0]  # chain in order
        assert s.prompt.endswith(f"5 variables are assigned the value {value}, they are: ")
    else:
        for o in s.outputs:
            assert body.count(o) == 1, o
        q = s.extra["query"]
        assert s.answer_prefix.endswith("mentioned in the provided text " + ("is" if len(s.outputs) == 1 else "are"))
        assert q in s.answer_prefix
    assert s.metric == ("passkey" if task == "passkey" else "string_match_all")


def test_templates_follow_ruler():
    s = T.make_sample("niah_single_2", toy_encode, 200, 600, seed=1)
    assert s.input.startswith("A special magic number is hidden within the following text. Make sure to "
                              "memorize it. I will quiz you about the number afterwards.\n")
    assert f"\nWhat is the special magic number for {s.extra['query']} mentioned in the provided text?" in s.input
    m = T.make_sample("niah_multivalue", toy_encode, 200, 600, seed=1)
    assert m.input.startswith("Some special magic numbers are hidden within the following text.")
    assert m.answer_prefix == f" The special magic numbers for {m.extra['query']} mentioned in the provided text are"
    assert len(m.outputs) == 4 and all(re.fullmatch(r"\d{7}", o) for o in m.outputs)
    u = T.make_sample("niah_single_3", toy_encode, 200, 600, seed=1)
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", u.outputs[0])
    assert "special magic uuid for" in u.input
    q = T.make_sample("niah_multiquery", toy_encode, 200, 600, seed=1)
    assert q.extra["query"].count(", ") == 3 and ", and " in q.extra["query"]
    k = T.make_sample("niah_multikey_1", toy_encode, 300, 900, seed=1)
    assert len(k.extra["keys"]) == 4 and k.extra["distractors_in_prompt"] >= 1
    n = T.make_sample("niah_single_1", toy_encode, 200, 600, seed=1)
    assert T.NOISE_LINE + "\n" in n.input and n.haystack == "noise"


def test_deterministic_given_seed():
    for task in T.TASKS:
        a = T.make_sample(task, toy_encode, 250, 700, seed=3)
        b = T.make_sample(task, toy_encode, 250, 700, seed=3)
        c = T.make_sample(task, toy_encode, 250, 700, seed=4)
        assert a.prompt == b.prompt and a.outputs == b.outputs
        assert a.outputs != c.outputs


# The longest needle distance each task can honour in a 1,000-token prompt: variable tracking
# carries a ~260-token few-shot example and question, so a distance of 753 needs 1,015 tokens
# (found by hypothesis; the generator refuses it with a clear error, checked below).
MAX_DISTANCE_IN_1000 = {task: (700 if task == "vt" else 800) for task in T.TASKS}


@settings(max_examples=25, deadline=None)
@given(task=st.sampled_from(T.TASKS), frac=st.floats(0.0, 1.0), seed=st.integers(0, 10_000))
def test_distance_and_length_hold_for_any_request(task, frac, seed):
    distance = 120 + round(frac * (MAX_DISTANCE_IN_1000[task] - 120))
    s = T.make_sample(task, toy_encode, distance, 1000, seed)
    assert s.length == len(toy_encode(s.prompt)) <= 1000
    assert abs(s.needle_distance - distance) <= _max_unit_tokens(s, toy_encode)


def test_impossible_request_is_a_clear_error():
    from longattn.errors import LongattnError
    with pytest.raises(LongattnError, match="needs a prompt of 1015 tokens"):
        T.make_sample("vt", toy_encode, 753, 1000, 0)
    with pytest.raises(LongattnError, match="distance"):
        T.make_sample("passkey", toy_encode, 500, 100)
    with pytest.raises(LongattnError, match="unknown task"):
        T.make_sample("qa_9", toy_encode, 50, 100)
    with pytest.raises(LongattnError, match="length"):
        T.make_sample("niah_multivalue", toy_encode, 90, 100)  # the block alone is longer


# ------------------------------------------------------------------------------ scoring

def test_scoring_as_published():
    assert T.postprocess_pred("  \x01abc\x02 ") == "abc"
    assert T.string_match_all("The numbers are 123 and 456", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert T.string_match_all("ABC-def", ["abc-DEF"]) == 1.0
    assert T.string_match_part("nothing here", ["x", "here"]) == 1.0
    assert T.string_match_part("nothing", ["x"]) == 0.0
    assert T.first_int_match(" is 4821. Remember") == 4821
    assert T.first_int_match("no digits") is None
    s = T.make_sample("passkey", toy_encode, 100, 300, seed=0)
    key = s.outputs[0]
    assert T.score(s, f" {key}. Remember it.") == 1.0
    assert T.score(s, f" {key}1") == 0.0 and T.score(s, " 7 then " + key) == 0.0
    assert not T.settled(s, f" {key}") and T.settled(s, f" {key}.")
    m = T.make_sample("niah_multivalue", toy_encode, 200, 600, seed=0)
    half = " ".join(m.outputs[:2])
    assert T.score(m, half) == 0.5 and not T.settled(m, half)
    assert T.settled(m, " ".join(m.outputs))


# ------------------------------------------------------------------------------ sweep

def _toy_decode(ids: list) -> str:
    return "".join(str(i % 10) if i % 3 == 0 else chr(97 + i % 26) + " " for i in ids)


def test_retrieval_sweep_on_tiny_model():
    from conftest import tiny_model
    from longattn.lab.retrieval import greedy_continuation, retrieval_policies, retrieval_sweep
    from longattn.policy import AttentionPolicy
    m = tiny_model("llama", num_hidden_layers=2)
    pols = retrieval_policies(m.config, 24, 2)
    assert [l for l, _ in pols] == ["full attention", "window 24", "window 24 + 2 sinks"]
    pols.append(("window >= prompt", AttentionPolicy.build(m.config, "window", window=500)))
    res = retrieval_sweep(m, toy_encode, _toy_decode, ["passkey", "niah_single_1"], [60, 150], pols,
                          samples=1, length=200, max_new_tokens=6)
    assert len(res["rows"]) == 2 * len(pols) * 2 and len(res["records"]) == 2 * 2 * len(pols)
    assert all(0.0 <= r["score"] <= 100.0 for r in res["rows"])
    by = {}
    for r in res["records"]:
        by.setdefault((r["task"], r["distance"], r["seed"]), {})[r["policy"]] = r
    for group in by.values():  # the same prompt under every policy; a window over it changes nothing
        assert len({r["needle_distance"] for r in group.values()}) == 1
        assert group["window >= prompt"]["prediction"] == group["full attention"]["prediction"]
    json.dumps(res)
    # stopping once the score is settled gives the score of the full continuation
    s = T.make_sample("passkey", toy_encode, 60, 200, seed=5)
    ids = toy_encode(s.prompt)
    full = greedy_continuation(m, pols[0][1], ids, 10, _toy_decode)
    early = greedy_continuation(m, pols[0][1], ids, 10, _toy_decode, sample=s)
    assert full[:len(early)] == early
    assert T.score(s, _toy_decode(full)) == T.score(s, _toy_decode(early))


@pytest.mark.real
def test_cli_retrieval_smoke(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "LONGATTN_CACHE"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    out = tmp_path / "r"
    r = subprocess.run([sys.executable, "-m", "longattn.cli.main", "retrieval", "--model", "smollm2-135m",
                        "--tasks", "passkey", "--distances", "60", "--length", "100", "--samples", "1",
                        "--window", "16", "--sinks", "2", "--max-new-tokens", "4", "--out", str(out), "--json"],
                       capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["policies"] == ["full attention", "window 16", "window 16 + 2 sinks"]
    assert len(doc["rows"]) == 3 and {row["distance"] for row in doc["rows"]} == {60}
    assert (out / "retrieval_smollm2-135m.json").exists() and (out / "retrieval_smollm2-135m.png").exists()
