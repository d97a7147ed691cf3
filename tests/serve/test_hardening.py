"""`longattn serve` against clients that misbehave: parameters at the edge of their ranges, a
failure inside one request's step, huge bodies, missing keys, browser-style requests, a drain
that runs out of time. In every case the other clients' streams finish with their own answer.

The served model is the tiny llama with a character tokenizer of test_serve.py.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("uvicorn")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from longattn.engine.sampling import SamplingConfig  # noqa: E402
from longattn.serve.batching import Request  # noqa: E402
from longattn.serve.guard import ServeOptions, host_name  # noqa: E402
from test_serve import NAME, _engine, _wait, checkpoint, served_dir, start_server  # noqa: E402,F401

JSON = {"Content-Type": "application/json"}


def call(url, method, path, body=None, headers=None, raw: bytes = None):
    """(status, headers, bytes) of one HTTP exchange."""
    host, port = url.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    c.request(method, path, body=data, headers={**JSON, **(headers or {})} if data is not None else (headers or {}))
    r = c.getresponse()
    out = r.read()
    c.close()
    return r.status, r.headers, out


def error_of(data: bytes) -> dict:
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


class Healthy:
    """A greedy stream from another client that must finish with [DONE] and the text it gets
    alone, whatever the requests beside it do."""

    BODY = {"model": NAME, "prompt": "The tide", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stream": True}

    def __init__(self, url, headers=None, max_tokens=40, pause=0.002):
        self.url, self.headers, self.events = url, headers or {}, []
        self.body, self.pause = {**self.BODY, "max_tokens": max_tokens}, pause
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        host, port = self.url.removeprefix("http://").split(":")
        c = http.client.HTTPConnection(host, int(port), timeout=120)
        c.request("POST", "/v1/completions", body=json.dumps(self.body), headers={**JSON, **self.headers})
        r = c.getresponse()
        for line in r:
            if line.startswith(b"data: "):
                self.events.append(line[6:].strip())
                time.sleep(self.pause)  # a slow reader keeps it in flight beside the others
        c.close()

    def text(self) -> str:
        self.thread.join(120)
        assert self.events and self.events[-1] == b"[DONE]", self.events[-3:]
        msgs = [json.loads(e) for e in self.events[:-1]]
        assert all("error" not in m for m in msgs), msgs
        return "".join(m["choices"][0]["text"] for m in msgs if m["choices"])


@pytest.fixture(scope="module")
def guarded(checkpoint):
    """A server with an API key and small limits -> (url, engine, key)."""
    ck, model = checkpoint
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = _engine(checkpoint, max_batch=4, max_queue=8, chunk=16, num_blocks=1024)
    key = "sk-test-123"
    url, stop = start_server(engine, ServeOptions(api_key=key, max_body=64 << 10, max_prompt_tokens=200))
    yield url, engine, key
    stop()
    torch.set_num_threads(threads)


def alone_text(url, key):
    status, _, data = call(url, "POST", "/v1/completions", {**Healthy.BODY, "stream": False},
                           {"Authorization": f"Bearer {key}"})
    assert status == 200
    return json.loads(data)["choices"][0]["text"]


def test_edge_parameters_are_served_or_refused_and_never_break_another_stream(guarded):
    url, engine, key = guarded
    auth = {"Authorization": f"Bearer {key}"}
    want = alone_text(url, key)
    healthy = Healthy(url, auth)
    base = {"model": NAME, "prompt": "abc", "max_tokens": 6}
    served = [{"temperature": 1e-300}, {"top_p": 1e-300}, {"temperature": 1e-300, "top_p": 1e-300, "seed": 3},
              {"seed": 2 ** 64 - 1}, {"policy": {"window": 256, "sinks": 4}}]
    refused = [{"policy": {"window": 10 ** 30}}, {"policy": {"window": 4, "sinks": 10 ** 30}}, {"seed": -1},
               {"seed": 2 ** 64}, {"seed": 10 ** 30}, {"stream": "yes"}, {"max_tokens": True},
               {"temperature": 2.5}, {"top_p": 0}, {"max_tokens": 0}, {"stop": ["x" * 1000]},
               {"prompt": [1, 10 ** 30]}, {"prompt": "x" * 300}]
    for extra in served:
        status, _, data = call(url, "POST", "/v1/completions", {**base, **extra}, auth)
        assert status == 200, (extra, data)
        assert json.loads(data)["choices"][0]["finish_reason"] in ("length", "stop")
    for extra in refused:
        status, _, data = call(url, "POST", "/v1/completions", {**base, **extra}, auth)
        assert status == 400, (extra, data)
        error_of(data)
    assert healthy.text() == want


def test_a_failure_inside_one_request_ends_that_request_alone(checkpoint):
    """A batched decode step that fails is run again row by row: only the row that fails
    alone ends (with an error), the others finish with the tokens they get alone."""
    engine = _engine(checkpoint, max_batch=4, chunk=8)
    poison = []  # requests whose stream fails every decode step from its first
    model = engine.model

    def faulty(tokens, pos, cache=None, **kw):
        if any(s is r.stream for s in cache.streams for r in poison) and tokens.shape[1] == 1:
            raise RuntimeError("injected fault")
        return model(tokens, pos, cache=cache, **kw)

    def run(prompts, bad=None):
        reqs, done = [], []
        for i, p in enumerate(prompts):
            ev = threading.Event()
            r = Request(prompt=p, max_tokens=12, sampling=SamplingConfig(), ignore_eos=True,
                        emit=lambda kind, payload, ev=ev: ev.set() if kind != "text" else None)
            reqs.append(r)
            done.append(ev)
        if bad is not None:  # poisoned before it is submitted: no race with a fast machine
            poison.append(reqs[bad])
        for r in reqs:
            engine.submit(r)
        assert all(ev.wait(60) for ev in done)
        return reqs

    try:
        prompts = [[5, 6, 7], [9, 10, 11, 12], [20, 21], [30, 31, 32, 33, 34]]
        alone = [list(run([p])[0].generated) for p in prompts]
        engine.model = faulty
        reqs = run(prompts, bad=1)
        assert reqs[1].finish_reason == "error"
        for i in (0, 2, 3):
            assert reqs[i].finish_reason == "length" and list(reqs[i].generated) == alone[i]
        snap = engine.snapshot()
        assert snap["running"] == 0 and snap["blocks_used"] == snap["blocks_retained"]
        assert engine.metrics.requests["error"] == 1
    finally:
        engine.model = model
        engine.stop()


def test_request_timeout_and_drain_timeout_end_requests_with_an_error(checkpoint):
    forever = dict(max_tokens=10 ** 6, sampling=SamplingConfig(), ignore_eos=True)
    from longattn.policy import AttentionPolicy
    ck, _ = checkpoint
    window = AttentionPolicy.build(ck.config, "window", window=8, sinks=2)  # bounded: runs forever
    engine = _engine(checkpoint, policy=window, timeout=0.5)
    got = []
    try:
        r = Request(prompt=[5, 6], emit=lambda kind, p: got.append((kind, p)), **forever)
        engine.submit(r)
        assert _wait(lambda: got and got[-1][0] == "error", 30)
        assert "--request-timeout" in got[-1][1] and r.finish_reason == "error"
    finally:
        engine.stop(drain=False)
    engine = _engine(checkpoint, policy=window)
    got = []
    r = Request(prompt=[5, 6], emit=lambda kind, p: got.append((kind, p)), **forever)
    engine.submit(r)
    assert _wait(lambda: len(r.generated) > 2)
    t = time.perf_counter()
    engine.stop(timeout=0.3)
    assert time.perf_counter() - t < 10 and not engine._thread.is_alive()
    assert got[-1][0] == "error" and "drain timeout" in got[-1][1]
    assert engine.snapshot()["blocks_used"] == 0


def test_api_key_content_type_host_and_routes(guarded, caplog):
    caplog.set_level(logging.INFO, logger="longattn.serve")
    url, engine, key = guarded
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
    for headers, why in (({}, "no API key"), ({"Authorization": "Bearer wrong"}, "not valid"),
                         ({"Authorization": key}, "no API key")):
        status, h, data = call(url, "POST", "/v1/completions", body, headers)
        assert status == 401 and why in error_of(data)["message"] and error_of(data)["code"] == "invalid_api_key"
    status, _, data = call(url, "GET", "/v1/models", headers={"Authorization": "Bearer nope"})
    assert status == 401
    auth = {"Authorization": f"Bearer {key}"}
    assert call(url, "POST", "/v1/completions", body, auth)[0] == 200
    assert call(url, "GET", "/v1/models", headers=auth)[0] == 200
    assert call(url, "GET", "/health")[0] == 200  # probes need no key
    # a browser's simple request (text/plain, form) is refused: JSON only
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        status, _, data = call(url, "POST", "/v1/completions", body, {**auth, "Content-Type": ctype})
        assert status == 415 and error_of(data)["code"] == "unsupported_media_type"
    assert call(url, "POST", "/v1/completions", body, {**auth, "Content-Type": "application/json; charset=utf-8"})[0] == 200
    # DNS rebinding: a foreign Host is refused on every route, loopback names are answered
    port = url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io"):
        status, _, data = call(url, "GET", "/health", headers={"Host": host})
        assert status == 421 and error_of(data)["code"] == "host_not_allowed"
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert call(url, "GET", "/health", headers={"Host": host})[0] == 200
    # unknown routes and methods, and the docs (off by default), answer in OpenAI's shape
    for method, path, status in (("GET", "/docs", 404), ("GET", "/openapi.json", 404), ("GET", "/v2/x", 404),
                                 ("GET", "/v1/completions", 405), ("DELETE", "/health", 405)):
        s, _, data = call(url, method, path, headers=auth)
        assert s == status and error_of(data)
    metrics = call(url, "GET", "/metrics")[2].decode()
    assert 'longattn_refused_requests_total{reason="invalid_api_key"}' in metrics
    logged = [r.getMessage() for r in caplog.records]
    assert "POST /v1/completions 401 invalid_api_key" in logged and "GET /health 421 host_not_allowed" in logged


def test_size_limits_answer_413_and_the_server_stays_responsive(guarded):
    url, engine, key = guarded
    auth = {"Authorization": f"Bearer {key}"}
    want = alone_text(url, key)
    healthy = Healthy(url, auth)
    big = json.dumps({"model": NAME, "prompt": "x" * (10 << 20)}).encode()  # 10 MB
    host, port = url.removeprefix("http://").split(":")
    answers = {}

    def send_big(chunked):
        s = socket.create_connection((host, int(port)), timeout=60)
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {key}\r\n")
        head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {len(big)}\r\n\r\n"
        s.sendall(head.encode())
        try:
            for i in range(0, len(big), 1 << 16):
                part = big[i:i + (1 << 16)]
                s.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
            if chunked:
                s.sendall(b"0\r\n\r\n")
        except OSError:  # the server answered and closed without reading the rest
            pass
        answers[chunked] = s.recv(4096).split(b"\r\n", 1)[0]
        s.close()

    senders = [threading.Thread(target=send_big, args=(c,)) for c in (False, True)]
    for t in senders:
        t.start()
    worst = 0.0
    while any(t.is_alive() for t in senders):
        t0 = time.perf_counter()
        assert call(url, "GET", "/health")[0] == 200
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.01)
    assert all(b" 413 " in a for a in answers.values()), answers
    assert worst < 1.0  # /health never waits on another client's body
    # a prompt over the token limit is a 400 naming the limit
    status, _, data = call(url, "POST", "/v1/completions", {"model": NAME, "prompt": "y" * 250}, auth)
    assert status == 400 and "--max-prompt-tokens" in error_of(data)["message"]
    assert healthy.text() == want


def test_tokenization_runs_off_the_event_loop(checkpoint):
    """A prompt that takes a while to tokenize delays no other client's /health."""
    ck, model = checkpoint
    engine = _engine(checkpoint)
    slow = threading.Event()
    tok = engine.tok

    class SlowTokenizer:
        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, text, **kw):
            if text.startswith("slow"):
                slow.set()
                time.sleep(1.5)
            return tok(text, **kw)
    engine.tok = SlowTokenizer()
    url, stop = start_server(engine)
    try:
        t = threading.Thread(target=call, args=(url, "POST", "/v1/completions",
                                                {"model": NAME, "prompt": "slow one", "max_tokens": 1}))
        t.start()
        assert slow.wait(30)
        t0 = time.perf_counter()
        assert call(url, "GET", "/health")[0] == 200
        assert time.perf_counter() - t0 < 0.5
        t.join(30)
    finally:
        stop()


def test_host_names_parse_with_and_without_ports():
    assert host_name("LocalHost:8000") == "localhost"
    assert host_name("[::1]:80") == "::1" and host_name("::1") == "::1"
    assert host_name("127.0.0.1") == "127.0.0.1"


# -------------------------------------------------------------------------------- fuzz

def _values():
    ints = st.one_of(st.integers(-3, 300), st.sampled_from([10 ** 30, -(10 ** 30), 2 ** 63, 2 ** 64]))
    floats = st.one_of(st.floats(allow_nan=False, allow_infinity=False, width=64),
                       st.sampled_from([0.0, 1e-300, 1e-45, 2.0, 2.0000001, -0.0]))
    junk = st.one_of(st.none(), st.booleans(), st.text(max_size=8), st.lists(st.integers(-2, 200), max_size=4),
                     st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
    return ints, floats, junk


@st.composite
def completion_bodies(draw):
    """A /v1/completions or /v1/chat/completions body: every field drawn from valid values,
    edge values and wrong types, fields dropped and unknown fields added."""
    ints, floats, junk = _values()
    chat = draw(st.booleans())
    body = {"model": draw(st.sampled_from([NAME, NAME, "other", 5]))}
    if chat:
        msg = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
                                     "content": st.one_of(st.text(max_size=30), junk)})
        body["messages"] = draw(st.one_of(st.lists(msg, max_size=3), junk))
    else:
        body["prompt"] = draw(st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 120), max_size=20),
                                        st.lists(st.text(max_size=10), max_size=2), junk))
    fields = {"max_tokens": st.one_of(st.integers(1, 8), ints, junk), "temperature": st.one_of(floats, junk),
              "top_p": st.one_of(floats, junk), "seed": st.one_of(ints, junk),
              "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=5), junk),
              "stream": st.one_of(st.booleans(), junk), "ignore_eos": st.one_of(st.booleans(), junk),
              "policy": st.one_of(st.fixed_dictionaries({"window": ints, "sinks": ints}), junk),
              "n": st.one_of(st.just(1), ints), "stream_options": st.one_of(
                  st.fixed_dictionaries({"include_usage": st.booleans()}), junk)}
    for name, strategy in fields.items():
        if draw(st.booleans()):
            body[name] = draw(strategy)
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool) \
            and body["max_tokens"] > 8 and draw(st.booleans()):
        body["max_tokens"] = 8  # keep most served requests short
    if draw(st.integers(0, 9)) == 0:
        body["frobnicate"] = 1
    return chat, body


@pytest.fixture(scope="module")
def fuzz_server(checkpoint):
    ck, model = checkpoint
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = _engine(checkpoint, max_batch=4, max_queue=8, chunk=16, num_blocks=2048, timeout=20)
    url, stop = start_server(engine, ServeOptions(max_body=64 << 10, max_prompt_tokens=200))
    healthy = Healthy(url, max_tokens=240, pause=0.04)  # in flight through the whole fuzz
    yield url, engine, healthy
    stop()
    torch.set_num_threads(threads)


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=completion_bodies())
def test_fuzzed_requests_get_an_answer_or_an_openai_error_and_harm_no_other_stream(fuzz_server, case):
    url, engine, healthy = fuzz_server
    chat, body = case
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8 and body.get("policy"):
        body["max_tokens"] = 8  # a bounded policy would otherwise run to the time limit
    status, headers, data = call(url, "POST", path, body)
    assert status in (200, 400, 404, 429), (status, body, data)
    if status != 200:
        error_of(data)
    elif body.get("stream") is True:
        events = [l[6:] for l in data.split(b"\n") if l.startswith(b"data: ")]
        assert events[-1] == b"[DONE]" and all("error" not in json.loads(e) for e in events[:-1])
    else:
        assert json.loads(data)["choices"][0]["finish_reason"] in ("length", "stop")
    assert engine.snapshot()["alive"] and engine.metrics.requests["error"] == 0


def test_the_healthy_stream_beside_the_fuzz_finished_as_alone(fuzz_server):
    url, engine, healthy = fuzz_server
    text = healthy.text()
    status, _, data = call(url, "POST", "/v1/completions", {**healthy.body, "stream": False})
    assert status == 200 and text == json.loads(data)["choices"][0]["text"]


# -------------------------------------------------------------------------------- the CLI

def _serve(served_dir, port, *extra, env=None):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2] / "src"), **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "longattn.cli.main", "serve", "--model", str(served_dir),
                             "--port", str(port), "--threads", "1", "--block-size", "4", "--compile", "none",
                             *extra],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True)


def test_a_drain_past_its_timeout_ends_streams_with_an_error_and_done(served_dir):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = _serve(served_dir, port, "--drain-timeout", "1", "--kv", "bf16", env={"LONGATTN_API_KEY": "k"})
    url = f"http://127.0.0.1:{port}"
    try:
        def up():
            try:
                return call(url, "GET", "/health")[0] == 200
            except OSError:
                return False
        assert _wait(up, 180), proc.stderr.read() if proc.poll() is not None else "server did not start"
        assert call(url, "GET", "/v1/models")[0] == 401  # the key from the environment
        assert 'longattn_kv_pool_bytes{format="bf16"}' in call(url, "GET", "/metrics")[2].decode()
        host, p = url.removeprefix("http://").split(":")
        c = http.client.HTTPConnection(host, int(p), timeout=60)
        c.request("POST", "/v1/completions", headers={**JSON, "Authorization": "Bearer k"},
                  body=json.dumps({"model": NAME, "prompt": "hello", "max_tokens": 10 ** 6, "stream": True,
                                   "ignore_eos": True, "policy": {"window": 8, "sinks": 2}}))
        r = c.getresponse()
        assert r.readline().startswith(b"data:")
        proc.send_signal(signal.SIGTERM)
        events = [l[6:].strip() for l in r.read().split(b"\n") if l.startswith(b"data: ")]
        assert events[-1] == b"[DONE]" and "drain timeout" in json.loads(events[-2])["error"]["message"]
        assert proc.wait(60) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_busy_port_is_refused_before_the_model_loads(served_dir, capsys, monkeypatch):
    from longattn.cli import serve as serve_cli
    from longattn.cli.main import main

    def no_load(*a, **kw):
        raise AssertionError("the model was loaded before the port was checked")
    monkeypatch.setattr(serve_cli, "open_checkpoint", no_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        assert main(["serve", "--model", str(served_dir), "--port", str(busy.getsockname()[1])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot listen" in err[0] and "--port" in err[0]


# ------------------------------------------------------------------------- long rope

def test_a_long_rope_model_is_served_on_one_side_of_its_switch(tmp_path):
    """Phi-3's long rope changes every key's rotation once the sequence passes its original
    context (transformers recomputes the sequence there; the server does not). A request whose
    reply would cross it is a 400, one without max_tokens stops at it, a prompt already past it
    is long from its first token, a cached stream is never continued across it, and every
    answer is what the eager Session (which does recompute) generates."""
    import shutil
    from conftest import tiny_dir
    from test_serve import char_tokenizer
    from longattn.checkpoint import load_checkpoint
    from longattn.engine.session import Session, generate
    from longattn.models import build_model
    from longattn.policy import AttentionPolicy
    from longattn.serve.batching import Engine, EngineConfig
    switch = 16
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)]}
    d = tmp_path / NAME
    shutil.copytree(tiny_dir("phi3", rope_parameters=longrope, original_max_position_embeddings=switch,
                             max_position_embeddings=64), d)
    char_tokenizer(d)
    ck = load_checkpoint(str(d))
    model = build_model(ck.config, ck.state_dict)
    engine = Engine(model, ck.tokenizer, AttentionPolicy.from_config(ck.config),
                    EngineConfig(block_size=4, num_blocks=512)).start()
    url, stop = start_server(engine)

    def complete(prompt, **extra):
        status, _, data = call(url, "POST", "/v1/completions", {"model": NAME, "prompt": prompt, "temperature": 0,
                                                                 "ignore_eos": True, **extra})
        return status, json.loads(data)

    def session(prompt, n):
        return generate(Session(model), [prompt], n, SamplingConfig(0.0), stop_ids=set()).tokens[0]
    try:
        short = list(range(10, 20))                                   # 10 tokens: short factors
        status, out = complete(short, max_tokens=switch - len(short) + 2)
        assert status == 400 and "original context of 16 tokens" in error_of(json.dumps(out).encode())["message"]
        status, out = complete(short)                                 # no limit: up to the switch
        assert status == 200 and out["usage"]["completion_tokens"] == switch - len(short) + 1
        assert out["choices"][0]["finish_reason"] == "length"
        want = session(short, switch - len(short) + 1)
        assert out["choices"][0]["text"] == ck.tokenizer.decode(want, skip_special_tokens=True)
        hits = engine.metrics.prefix_hits
        long = short + list(range(30, 40))                            # 20 tokens: long from the start
        status, out = complete(long, max_tokens=6)
        assert status == 200 and engine.metrics.prefix_hits == hits   # the short stream is not continued
        assert out["choices"][0]["text"] == ck.tokenizer.decode(session(long, 6), skip_special_tokens=True)
    finally:
        stop()
