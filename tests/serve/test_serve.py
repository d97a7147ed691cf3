"""`longattn serve`: the real server (uvicorn on a free loopback port) driven by the official
``openai`` client and by raw HTTP.

The served model is the tiny random llama of conftest (context 256) with a character-level
tokenizer saved beside it, so every request costs milliseconds. Each answer is checked
against the library itself: greedy text == ``session.generate`` on the same prompt; several
requests at once == each alone; a conversation's next turn that reuses its cached prefix ==
prefilling the whole turn.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import tiny_dir

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from longattn.checkpoint import load_checkpoint  # noqa: E402
from longattn.models import build_model  # noqa: E402
from longattn.policy import AttentionPolicy  # noqa: E402
from longattn.engine.sampling import SamplingConfig  # noqa: E402
from longattn.serve.app import create_app  # noqa: E402
from longattn.serve.batching import Engine, EngineConfig, Request  # noqa: E402
from longattn.serve.detok import IncrementalText  # noqa: E402
from longattn.engine.session import Session, generate  # noqa: E402

CONTEXT = 256
NAME = "tiny"


def char_tokenizer(dst: Path) -> None:
    """Save a 96-token character tokenizer with a chat template into ``dst``: id 2 is </s> (the
    tiny configs' end of sequence), every other id one printable character, so any generated
    text encodes back to the ids that produced it."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    chars = [chr(c) for c in range(32, 127)]  # 95
    vocab = {chars[0]: 0, chars[1]: 1, "</s>": 2, **{ch: 3 + i for i, ch in enumerate(chars[2:])}}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}</s>{% endfor %}"
                         "{% if add_generation_prompt %}a:{% endif %}")
    tok.save_pretrained(str(dst))


@pytest.fixture(scope="module")
def served_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("served") / NAME
    shutil.copytree(tiny_dir("llama", max_position_embeddings=CONTEXT), d)
    char_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def checkpoint(served_dir):
    ck = load_checkpoint(str(served_dir))
    return ck, build_model(ck.config, ck.state_dict)


def start_server(engine: Engine, options=None):
    """uvicorn serving ``engine`` (guarded by ``options``, a ServeOptions) on a free 127.0.0.1
    port in a thread -> (base url, stop)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, NAME, options), log_level="warning", access_log=False))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)

    def stop():
        server.should_exit = True
        th.join(30)
        sock.close()
    return f"http://127.0.0.1:{port}", stop


@pytest.fixture(scope="module")
def server(checkpoint):
    ck, model = checkpoint
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread only adds wake-ups
    engine = Engine(model, ck.tokenizer, AttentionPolicy.from_config(ck.config),
                    EngineConfig(block_size=4, num_blocks=1024, max_batch=3, max_queue=2, chunk=16, compile="none"),
                    stop_ids=ck.config.eos_token_ids).start()
    url, stop = start_server(engine)
    yield url, engine, ck, model
    stop()
    torch.set_num_threads(threads)
    assert not engine._thread.is_alive()  # the lifespan's end stopped the engine


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(url, path, body, raw: bytes = None):
    """(status, headers, parsed JSON) of a raw POST."""
    host, port = url.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    c.request("POST", path, body=raw if raw is not None else json.dumps(body),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, r.headers, json.loads(data) if data else None


def library_greedy(model, tok, ids, n, policy=None):
    """Text of ``n`` greedy tokens from the library's own generate loop (the oracle)."""
    s = Session(model, policy)
    res = generate(s, [ids], n, SamplingConfig(), stop_ids=set(model.config.eos_token_ids))
    return tok.decode(res.tokens[0], skip_special_tokens=True), res.tokens[0]


def test_openai_client_completions_chat_and_streams(server):
    url, engine, ck, model = server
    tok = ck.tokenizer
    c = client(url)
    assert [m.id for m in c.models.list().data] == [NAME]
    r = c.completions.create(model=NAME, prompt="The moon is", max_tokens=7, temperature=0)
    want, toks = library_greedy(model, tok, tok("The moon is")["input_ids"], 7)
    assert r.choices[0].text == want
    assert r.usage.prompt_tokens == 11 and r.usage.completion_tokens == len(toks)
    assert r.usage.total_tokens == 11 + len(toks)

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0, seed=1)
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
    want, _ = library_greedy(model, tok, ids, 6)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids)

    parts, finish, usage = [], None, None
    for ch in c.chat.completions.create(model=NAME, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                        stream_options={"include_usage": True}):
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
        usage = ch.usage or usage
    assert "".join(parts) == want and finish in ("length", "stop") and usage.prompt_tokens == len(ids)

    text = "".join(ch.choices[0].text for ch in c.completions.create(
        model=NAME, prompt="The moon is", max_tokens=7, temperature=0, stream=True))
    assert text == library_greedy(model, tok, tok("The moon is")["input_ids"], 7)[0]

    # sampling: a seed reproduces, a stop string cuts the text before it
    a = c.completions.create(model=NAME, prompt="abc", max_tokens=12, temperature=0.9, top_p=0.9, seed=5)
    b = c.completions.create(model=NAME, prompt="abc", max_tokens=12, temperature=0.9, top_p=0.9, seed=5)
    assert a.choices[0].text == b.choices[0].text
    full = c.completions.create(model=NAME, prompt="The moon is", max_tokens=12, temperature=0).choices[0].text
    stop = full[3:5]
    r = c.completions.create(model=NAME, prompt="The moon is", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=NAME, prompt="The moon is", max_tokens=12, temperature=0, stop=[stop], stream=True))
    assert streamed == r.choices[0].text  # nothing past the stop string was streamed

    # a per-request policy override runs that policy
    r = c.completions.create(model=NAME, prompt="x" * 40, max_tokens=8, temperature=0,
                             extra_body={"policy": {"window": 6, "sinks": 2}})
    pol = AttentionPolicy.build(ck.config, "window", window=6, sinks=2)
    assert r.choices[0].text == library_greedy(model, tok, tok("x" * 40)["input_ids"], 8, pol)[0]

    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/metrics")
    metrics = conn.getresponse().read().decode()
    conn.request("GET", "/health")
    assert json.loads(conn.getresponse().read())["status"] == "ok"
    conn.close()
    for name in ("longattn_requests_total{outcome=\"ok\"}", "longattn_prompt_tokens_total",
                 "longattn_generation_tokens_total", "longattn_queue_depth", "longattn_kv_blocks_used",
                 "longattn_kv_blocks_free", "longattn_prefix_cache_hits_total", "longattn_step_seconds_sum",
                 'longattn_kv_pool_bytes{format="f32"}'):
        assert name in metrics
    ok = float(next(l for l in metrics.splitlines() if l.startswith('longattn_requests_total{outcome="ok"}')).split()[1])
    assert ok >= 9


def test_concurrent_requests_equal_each_alone(server):
    url, engine, ck, model = server
    c = client(url)
    prompts = ["Once upon a time", "zq", "The quick brown fox jumps over the lazy dog, " * 2, "12345", "Hi"]
    ns = [9, 14, 6, 11, 8]
    alone = [c.completions.create(model=NAME, prompt=p, max_tokens=n, temperature=0).choices[0].text
             for p, n in zip(prompts, ns)]
    engine.metrics.peak_decode_batch = 0
    got = [None] * len(prompts)

    def ask(i):
        got[i] = client(url).completions.create(model=NAME, prompt=prompts[i], max_tokens=ns[i],
                                                temperature=0).choices[0].text
    ths = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in ths:
        t.start()
    for t in ths:
        t.join(120)
    assert got == alone
    assert engine.metrics.peak_decode_batch > 1  # they really shared decode steps


def test_bad_requests_answer_400_with_an_openai_error_body(server):
    url = server[0]
    cases = [
        (None, b'{"model": "tiny", "prompt": '),                                  # malformed JSON
        ({"model": NAME, "prompt": "hi", "max_tokens": 3, "frobnicate": 1}, None),  # unknown field
        ({"model": NAME, "prompt": "hi", "max_tokens": -4}, None),                 # negative max_tokens
        ({"model": NAME, "prompt": "x" * (CONTEXT + 10), "max_tokens": 2}, None),  # longer than the context
        ({"model": NAME, "prompt": "hi", "n": 2}, None),
        ({"model": NAME, "prompt": "hi", "policy": {"window": 0}}, None),
    ]
    for body, raw in cases:
        status, _, err = post(url, "/v1/completions", body, raw)
        assert status == 400, (body, raw, err)
        assert set(err["error"]) == {"message", "type", "param", "code"}
        assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
    status, _, err = post(url, "/v1/chat/completions", {"model": NAME, "messages": []})
    assert status == 400
    status, _, err = post(url, "/v1/completions", {"model": "gpt-9", "prompt": "hi"})
    assert status == 404 and err["error"]["code"] == "model_not_found"
    _, _, err = post(url, "/v1/completions", {"model": NAME, "prompt": "hi", "frobnicate": 1})
    assert err["error"]["param"] == "frobnicate"


def _open_stream(url, body):
    host, port = url.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    c.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    return c, r


def _wait(cond, seconds=30):
    end = time.time() + seconds
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_disconnects_free_blocks_and_a_full_queue_answers_429(server):
    url, engine, ck, model = server
    long = {"model": NAME, "prompt": "hello", "max_tokens": 100000, "temperature": 0,
            "policy": {"window": 8, "sinks": 4}}  # bounded: may run forever
    base = engine.snapshot()["blocks_used"]
    conns = []
    for _ in range(3):  # max_batch running
        c, r = _open_stream(url, long)
        assert r.status == 200 and r.readline().startswith(b"data:")
        conns.append(c)
    assert _wait(lambda: engine.snapshot()["running"] == 3)
    for _ in range(2):  # max_queue waiting
        c, r = _open_stream(url, long)
        conns.append(c)
    assert _wait(lambda: engine.snapshot()["queue"] == 2)
    status, headers, err = post(url, "/v1/completions", long)
    assert status == 429 and int(headers["Retry-After"]) >= 1 and err["error"]["type"] == "rate_limit_error"
    for c in conns:  # every client goes away mid-stream
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
    def settled():
        snap = engine.snapshot()
        return snap["running"] == snap["queue"] == 0 and snap["blocks_used"] == snap["blocks_retained"]
    assert _wait(settled)  # nothing left held by the streams
    assert engine.snapshot()["blocks_used"] <= base
    # a non-stream request whose client leaves is cancelled too
    host, port = url.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    c.request("POST", "/v1/completions", body=json.dumps(long), headers={"Content-Type": "application/json"})
    assert _wait(lambda: engine.snapshot()["running"] == 1)
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    assert _wait(settled)


def test_next_chat_turn_prefills_only_new_tokens(server):
    url, engine, ck, model = server
    tok, c = ck.tokenizer, client(url)
    pol = {"window": 12, "sinks": 4}
    msgs = [{"role": "user", "content": "Tell me a long story about the sea and the wind."}]
    hits = engine.metrics.prefix_hits
    r1 = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=20, temperature=0,
                                   extra_body={"policy": pol})
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "And then?"}]
    r2 = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0,
                                   extra_body={"policy": pol})
    # stored: the prompt and every reply token that was fed back (the last one is not when
    # max_tokens ended the turn); only the rest of the next turn is prefilled
    stored = r1.usage.prompt_tokens + r1.usage.completion_tokens - (r1.choices[0].finish_reason == "length")
    assert engine.metrics.prefix_hits == hits + 1
    assert r2.usage.prompt_tokens_details.cached_tokens == stored
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
    want = library_greedy(model, tok, ids, 10, AttentionPolicy.build(ck.config, "window", window=12, sinks=4))[0]
    assert r2.choices[0].message.content == want



def _ask(engine, ids, n):
    """Submit ``ids`` for ``n`` greedy tokens to a started Engine and wait: the finished Request."""
    done = threading.Event()
    req = Request(prompt=ids, max_tokens=n, sampling=SamplingConfig(),
                  emit=lambda kind, p: done.set() if kind != "text" else None)
    engine.submit(req)
    assert done.wait(60)
    return req


def test_gemma3_hybrid_next_turn_reuses_its_prefix(served_dir):
    """On Gemma 3's local/global layers the stored conversation stays reusable: its local layers
    hold their sinks and last window, its global layers everything."""
    d = served_dir.parent / "gemma"
    shutil.copytree(tiny_dir("gemma3"), d)
    char_tokenizer(d)
    ck = load_checkpoint(str(d))
    model = build_model(ck.config, ck.state_dict)
    pol = AttentionPolicy.from_config(ck.config)
    engine = Engine(model, ck.tokenizer, pol, EngineConfig(block_size=4, num_blocks=512, chunk=16, compile="none")).start()
    try:
        first = list(range(3, 43))  # 40 tokens: past the window of 8
        r1 = _ask(engine, first, 12)
        second = first + list(r1.generated) + [2, 50, 60, 70]
        r2 = _ask(engine, second, 6)
        assert r2.reused == len(first) + len(r1.generated) - (r1.finish_reason == "length")
        alone = generate(Session(model, pol), [second], 6, SamplingConfig()).tokens[0]
        assert list(r2.generated) == alone
        assert engine.snapshot()["blocks_used"] == engine.snapshot()["blocks_retained"]
    finally:
        engine.stop()


def test_sigterm_drains_in_flight_requests_and_exits(served_dir, tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2] / "src"))
    proc = subprocess.Popen([sys.executable, "-m", "longattn.cli.main", "serve", "--model", str(served_dir),
                             "--port", str(port), "--threads", "1", "--block-size", "4", "--compile", "none"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def up():
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/health")
                return c.getresponse().status == 200
            except OSError:
                return False
        assert _wait(up, 180), proc.stderr.read() if proc.poll() is not None else "server did not start"
        c, r = _open_stream(url, {"model": NAME, "prompt": "hello", "max_tokens": 60, "temperature": 0})
        first = r.readline()
        assert first.startswith(b"data:")
        proc.send_signal(signal.SIGTERM)
        rest = r.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")  # the stream in flight finished
        assert proc.wait(60) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err and "POST /v1/completions 200" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.real
def test_incremental_text_equals_decoding_everything():
    """Token-by-token text == decoding all ids at once, on a real byte-level BPE (SmolLM2's:
    leading spaces, multi-byte characters split over tokens)."""
    from conftest import real_checkpoint
    tok = real_checkpoint("smollm2-135m").tokenizer
    text = "Héllo  wörld — naïve café, 東京 and 🙂 emoji.\n  Indented line\twith tab." * 3
    ids = tok(text)["input_ids"]
    inc = IncrementalText(tok)
    assert "".join(inc.push(t) for t in ids) == tok.decode(ids, skip_special_tokens=True)
    assert len(inc.ids) <= 2 * IncrementalText.CONTEXT  # the context and what has not settled


def test_cli_refuses_what_it_cannot_serve(capsys):
    from longattn.cli.main import main
    with pytest.raises(SystemExit) as refused:  # not one of serve's policies: argparse's refusal
        main(["serve", "--model", "smollm2-135m", "--policy", "auto"])
    assert refused.value.code == 2
    assert main(["serve", "--model", "smollm2-135m", "--port", "70000"]) == 2
    assert main(["serve", "--model", "smollm2-135m", "--kv-blocks", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(l.startswith("longattn: error: ") for l in err)
    assert "auto" in err[0] and "--port" in err[1] and "--kv-blocks" in err[2]


def _engine(checkpoint, policy=None, stop_ids=(), **cfg):
    ck, model = checkpoint
    pol = policy or AttentionPolicy.from_config(ck.config)
    return Engine(model, ck.tokenizer, pol, EngineConfig(**{"block_size": 4, "num_blocks": 512, "compile": "none", **cfg}),
                  stop_ids=stop_ids).start()


def test_end_of_turn_tokens_end_a_request_unless_ignore_eos(checkpoint):
    engine = _engine(checkpoint, stop_ids=range(96))  # every token ends the turn
    try:
        for ignore, want in ((False, 0), (True, 5)):
            done = threading.Event()
            req = Request(prompt=[5, 6], max_tokens=5, sampling=SamplingConfig(), ignore_eos=ignore,
                          emit=lambda kind, p: done.set() if kind != "text" else None)
            engine.submit(req)
            assert done.wait(60) and len(req.generated) == want
            assert req.finish_reason == ("length" if ignore else "stop")
    finally:
        engine.stop()


def test_retained_streams_keep_their_blocks_accounted_as_requests_come_and_go(checkpoint):
    """Each finished request's stream is retained for prefix reuse; a later request must never
    take its place in the prefix cache without its blocks going back to the pool, although
    Python hands a dropped Request's address to the next one."""
    engine = _engine(checkpoint, retain=4)
    try:
        for i in range(40):  # each round gives the allocator a chance to hand out the last address
            done = threading.Event()
            req = Request(prompt=[3 + i, 40, 41, 42, 43, 44], max_tokens=6, sampling=SamplingConfig(),
                          ignore_eos=True, emit=lambda kind, p: done.set() if kind != "text" else None)
            engine.submit(req)
            assert done.wait(60) and req.finish_reason == "length"
            del req  # its address is free for the next Request
            snap = engine.snapshot()
            assert snap["blocks_used"] == snap["blocks_retained"] > 0
            assert len(engine.retained) == min(i + 1, 4)
    finally:
        engine.stop()


def test_windowed_conversation_memory_stays_flat_past_the_context(checkpoint):
    """400 tokens on a window of 8 with 4 sinks, past the model's context of 256: the blocks held
    stop growing once the window and its rewind margin (4 positions here) are full, and stay
    within what admission reserved."""
    ck, _ = checkpoint
    pol = AttentionPolicy.build(ck.config, "window", window=8, sinks=4)
    engine = _engine(checkpoint, pol, rewind=4)
    used, done = [], threading.Event()
    req = Request(prompt=list(range(3, 13)), max_tokens=400, sampling=SamplingConfig(),
                  emit=lambda kind, p: used.append(engine.pool.used) if kind == "text" else done.set())
    try:
        engine.submit(req)
        assert done.wait(120) and req.finish_reason == "length" and len(req.generated) == 400
        # blocks come and go as the window crosses block boundaries; the range never grows
        assert max(used[50:200]) == max(used[200:]) <= req.need
        assert min(used[50:200]) == min(used[200:])
        assert max(used) < ck.config.num_layers * -(-CONTEXT // 4) // 8
        assert engine.pool.used == engine.snapshot()["blocks_retained"]
        # nor does the rest of its state grow with the reply, but its token ids (4 bytes each)
        assert req.text == "" and len(req.detok.ids) <= IncrementalText.CONTEXT
        assert req.generated.itemsize == req.fed.itemsize == 4
    finally:
        engine.stop()


def test_a_long_prefill_does_not_stall_decoding_requests(checkpoint):
    engine = _engine(checkpoint, chunk=4)
    order, first_a, done = [], threading.Event(), threading.Event()

    def emit(name):
        def f(kind, p):
            if kind == "text":
                order.append(name)
                if name == "a":
                    first_a.set()
            else:
                done.set() if name == "b" else None
        return f
    try:
        a = Request(prompt=[5, 6, 7], max_tokens=60, sampling=SamplingConfig(), emit=emit("a"))
        engine.submit(a)
        assert first_a.wait(60)
        b = Request(prompt=list(range(3, 63)), max_tokens=2, sampling=SamplingConfig(), emit=emit("b"))
        engine.submit(b)
        assert done.wait(60)
        # b's 60-token prompt took 15 chunks, each beside one decode step of a
        between = order[order.index("a") + 1:order.index("b")]
        assert between.count("a") >= 10
    finally:
        engine.stop(drain=False)


def test_a_request_the_pool_cannot_hold_yet_waits_and_then_runs(checkpoint):
    from longattn.serve.batching import QueueFull
    from longattn.errors import LongattnError
    engine = _engine(checkpoint, num_blocks=30, max_queue=1, retain=0)  # one request of 18 blocks fits
    events = []
    try:
        reqs = [Request(prompt=[5, 6], max_tokens=20, sampling=SamplingConfig(), ignore_eos=True,
                        emit=lambda kind, p, i=i: events.append((i, kind))) for i in range(3)]
        assert reqs[0].max_tokens and engine.blocks_needed(engine.policy_for(()), 2, 20) == 18
        engine.submit(reqs[0])
        engine.submit(reqs[1])
        with pytest.raises(QueueFull):
            engine.submit(reqs[2])
        assert _wait(lambda: sum(k == "done" for _, k in events) == 2, 60)
        done = [i for i, k in events if k == "done"]
        assert done == [0, 1] and all(len(r.generated) == 20 for r in reqs[:2])
        # request 1 produced nothing before request 0 finished: it waited for blocks
        assert events.index((0, "done")) < min(n for n, e in enumerate(events) if e[0] == 1)
        assert engine.pool.used == 0
        with pytest.raises(LongattnError, match="pool holds 30"):
            engine.submit(Request(prompt=[5, 6], max_tokens=200, sampling=SamplingConfig(), emit=print))
    finally:
        engine.stop()


def test_next_turn_reuses_its_stream_when_the_pool_is_tight(checkpoint):
    """A windowed chat's next turn continues its retained stream even when that stream and the
    turn's own reservation together exceed the pool: the stream is taken over, never evicted to
    make room for the very request that would continue it (which made every long windowed chat
    re-prefill). Output equals the request served alone."""
    ck, model = checkpoint
    pol = AttentionPolicy.build(ck.config, "window", window=8, sinks=2)
    first = list(range(3, 63))

    def run(num_blocks):
        engine = Engine(model, ck.tokenizer, pol, EngineConfig(block_size=4, num_blocks=num_blocks, chunk=16, compile="none")).start()
        try:
            r1 = _ask(engine, first, 6)
            retained = engine.snapshot()["blocks_retained"]
            second = first + list(r1.generated) + [20, 21, 22, 23]
            return r1, retained, second, _ask(engine, second, 6), engine.blocks_needed(pol, len(second), 6)
        finally:
            engine.stop()
    _, retained, second, roomy, need = run(4096)
    assert roomy.reused > 0
    tight = need + retained - 1  # the turn's reservation and the stream it continues do not both fit
    _, _, _, r2, _ = run(tight)
    assert r2.reused == roomy.reused and r2.generated == roomy.generated
    assert list(r2.generated) == generate(Session(model, pol), [second], 6, SamplingConfig()).tokens[0]


@pytest.mark.parametrize("rewind", [0, 8])
def test_next_turn_continues_from_before_where_the_last_ended(checkpoint, rewind):
    """A chat template that re-renders the end of the last reply differently (Gemma's trims it)
    makes the next turn share a prefix a few tokens shorter than what the stream stored. Windowed
    layers keep ``rewind`` positions beyond their window, so the stream is continued from there
    and only the rest is prefilled; without the margin the window has freed what that needs.
    Either way the output equals the request served alone."""
    ck, model = checkpoint
    pol = AttentionPolicy.build(ck.config, "window", window=8, sinks=2)
    engine = Engine(model, ck.tokenizer, pol, EngineConfig(block_size=4, num_blocks=1024, chunk=16,
                                                           rewind=rewind, compile="none")).start()
    try:
        first = list(range(3, 63))
        r1 = _ask(engine, first, 8)
        stored = len(first) + len(r1.generated) - (r1.finish_reason == "length")
        # the reply's last 4 stored tokens come back differently (5 with the one never fed)
        second = first + list(r1.generated[:-5]) + [30, 31, 32, 33, 34, 35]
        shared = len(first) + len(r1.generated) - 5
        r2 = _ask(engine, second, 6)
        assert stored - shared == 4
        assert r2.reused == (shared if rewind else 0)
        assert list(r2.generated) == generate(Session(model, pol), [second], 6, SamplingConfig()).tokens[0]
    finally:
        engine.stop()


def test_the_default_pool_holds_a_conversation_filling_the_context(monkeypatch):
    """Without --kv-blocks the pool holds one conversation as long as the trained context (so
    a long-document chat is not refused on its second turn), at least AUTO_MIN_BLOCKS, and at
    most half the memory available; its pages cost memory only as blocks are used."""
    from longattn.serve import batching
    ck = load_checkpoint(tiny_dir("llama", max_position_embeddings=40000), with_tokenizer=False)
    model = build_model(ck.config, ck.state_dict)
    pol = AttentionPolicy.from_config(ck.config)
    engine = Engine(model, None, pol, EngineConfig(block_size=4, compile="none"))
    one = engine.blocks_needed(pol, ck.config.max_context - 1, 1)
    assert one > batching.AUTO_MIN_BLOCKS and engine.pool.num_blocks == one
    assert engine.pool.used == 0 and torch.equal(engine.pool.k[:, :4], torch.zeros_like(engine.pool.k[:, :4]))
    b = engine.pool.alloc()  # a block handed out reads as zeros, whatever the memory held
    assert engine.pool.k[:, b * 4:(b + 1) * 4].abs().sum() == 0
    bytes_per_block = engine.pool.block_bytes
    monkeypatch.setattr(batching, "available_memory", lambda: 2 * 1000 * bytes_per_block)
    assert Engine(model, None, pol, EngineConfig(block_size=4, compile="none")).pool.num_blocks == 1000
    small = load_checkpoint(tiny_dir("llama", max_position_embeddings=CONTEXT), with_tokenizer=False)
    monkeypatch.setattr(batching, "available_memory", lambda: None)
    assert Engine(build_model(small.config, small.state_dict), None, AttentionPolicy.from_config(small.config),
                  EngineConfig(block_size=4, compile="none")).pool.num_blocks == batching.AUTO_MIN_BLOCKS
