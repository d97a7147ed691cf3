"""`longattn serve`: an OpenAI-compatible HTTP server (docs/serve.md)."""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading

from ..errors import LongattnError, check_int
from .common import add_model_args, add_policy_args, model_for, open_checkpoint, policy_from_args, setup_threads


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="POST /v1/completions and /v1/chat/completions (streaming or not), "
                                   "GET /v1/models, /health and /metrics. Requests are batched continuously "
                                   "over a paged KV pool; a windowed layer frees each block once it has "
                                   "left the window, so a conversation's memory stays bounded.")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--served-name", default=None,
                   help="model id clients send and /v1/models lists (default: the --model name)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="blocks in the KV pool, shared by all layers and streams (default: enough for one "
                        "conversation filling the model's trained context, at least 4096, at most half the "
                        "memory available)")
    p.add_argument("--block-size", type=int, default=16, help="token slots per KV block")
    p.add_argument("--kv", choices=["f32", "bf16", "int8"], default="bf16",
                   help="how the pool stores keys and values: bf16 holds twice the tokens in the same "
                        "memory at a measured cost of at most 0.004 bits/token on the bundled models "
                        "(docs/benchmarks.md); int8 (codes with a scale per 32 values) 3.6x; f32 is the "
                        "reference")
    p.add_argument("--compile", choices=["aot", "none"], default="aot",
                   help="aot (default): the step built ahead of time (once per model, weights, KV format "
                        "and machine, about a minute; any window and sinks) runs every decode row and "
                        "prefill chunk; none: the eager model (the reference)")
    p.add_argument("--max-batch", type=int, default=16, help="requests decoding at once")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for KV blocks before the server answers 429")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens per engine step (decode steps of other requests run between chunks)")
    p.add_argument("--prefix-cache", type=int, default=16,
                   help="finished conversations kept for prefix reuse (0 = off)")
    p.add_argument("--prefix-rewind", type=int, default=64, metavar="N",
                   help="positions a windowed layer keeps beyond its window, so a conversation can be "
                        "continued from up to N tokens before where its last turn ended (a chat template "
                        "that re-renders the reply's end differently) without a full prefill")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="on SIGTERM/SIGINT, seconds to let requests in flight finish; then each one still "
                        "running ends with an error event")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1 route (default: the "
                        "LONGATTN_API_KEY environment variable; unset = no key)")
    p.add_argument("--max-body", type=int, default=4 << 20, metavar="BYTES",
                   help="largest request body accepted (413 beyond)")
    p.add_argument("--max-prompt-tokens", type=int, default=131072, metavar="N",
                   help="longest prompt accepted, in tokens after the chat template")
    p.add_argument("--request-timeout", type=float, default=3600.0, metavar="S",
                   help="seconds a request may take from arrival to its last token (0 = no limit)")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a Host name to answer to besides the loopback names (a loopback-bound server "
                        "refuses other Host headers: DNS-rebinding protection); repeatable")
    p.add_argument("--docs", action="store_true", help="serve the interactive API docs at /docs")
    add_policy_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        import uvicorn

        from ..serve.app import create_app
    except ModuleNotFoundError as e:
        raise LongattnError(f"serve needs {e.name}: pip install 'longattn[serve]' (fastapi and uvicorn)") from None
    from ..serve.batching import Engine, EngineConfig
    from ..serve.guard import LOOPBACK_HOSTS, ServeOptions
    setup_threads(args.threads)
    if not 0 < args.port < 65536:
        raise LongattnError(f"--port must be in 1..65535, got {args.port}")
    check_int("--max-body", args.max_body, minimum=1)
    check_int("--max-prompt-tokens", args.max_prompt_tokens, minimum=1)
    if not 0 <= args.drain_timeout < float("inf"):
        raise LongattnError(f"--drain-timeout must be a finite number of seconds >= 0, got {args.drain_timeout}")
    config = EngineConfig(block_size=args.block_size, num_blocks=args.kv_blocks, max_batch=args.max_batch,
                          max_queue=args.max_queue, chunk=args.prefill_chunk, retain=args.prefix_cache,
                          rewind=args.prefix_rewind, timeout=args.request_timeout, kv=args.kv,
                          compile=args.compile)
    api_key = args.api_key if args.api_key is not None else os.environ.get("LONGATTN_API_KEY") or None
    options = ServeOptions(api_key=api_key, max_body=args.max_body, max_prompt_tokens=args.max_prompt_tokens,
                           allowed_hosts=(LOOPBACK_HOSTS | {h.lower() for h in args.allow_host})
                           if _is_loopback(args.host) else None, docs=args.docs)
    # The port is taken before the model loads: a busy port is one line at once, not after the load.
    sock = _bind(args.host, args.port)
    ck = open_checkpoint(args)
    if ck.tokenizer is None:
        raise LongattnError(f"{ck.name} has no tokenizer; serve needs one to read and write text")
    policy = policy_from_args(ck.config, args)
    # Tensors are made off the main thread, which then runs no PyTorch op at all: OpenMP keeps a
    # worker team per thread that has run a parallel region, and while the main thread's team
    # lives, every parallel region of the engine thread cost ~100 us more (measured: a SmolLM2
    # decode step 40 ms with the model loaded on the main thread, 23.5 ms without).

    def make_engine():
        from .generate import SparseTaus
        model = model_for(ck, args)
        taus = SparseTaus(ck, model, policy, calibrate=False)  # a sparse policy's kept taus, if any
        return Engine(model, ck.tokenizer, taus.policy, config, stop_ids=_stop_ids(ck), tau_path=taus.path)

    engine = _off_main_thread(make_engine)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    engine.start()
    app = create_app(engine, args.served_name or ck.name, options)
    blocks = engine.pool.num_blocks
    print(f"-- serving {ck.name} on http://{args.host}:{args.port}/v1 ({blocks} KV blocks of "
          f"{config.block_size} tokens, {engine.pool.block_bytes * blocks / 2**20:.0f} MiB, "
          f"{'compiled' if engine.step_kind == 'aot' else 'eager'} step"
          f"{', API key required' if api_key else ''})", file=sys.stderr, flush=True)
    # uvicorn turns SIGTERM/SIGINT into a graceful shutdown: no new connections, requests in
    # flight finish, then the app's lifespan stops the engine. Afterwards it raises the signal
    # again under the handler it found; a no-op SIGTERM handler makes a drained stop exit 0.
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    server = _draining_server(uvicorn.Config(app, log_level="warning", access_log=False,
                                             timeout_graceful_shutdown=args.drain_timeout + 10),
                              engine, args.drain_timeout)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0


def _draining_server(config, engine, drain: float):
    """uvicorn's server, whose first shutdown signal also starts the engine's drain: requests in
    flight get ``drain`` seconds, then each still running ends with an error event and
    ``[DONE]`` (uvicorn alone would cut their connections silently)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                threading.Thread(target=engine.stop, kwargs={"timeout": drain}, name="longattn-drain",
                                 daemon=True).start()
            super().handle_exit(sig, frame)
    return Server(config)


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, or one line saying why not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise LongattnError(f"--host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise LongattnError(f"cannot listen on {host}:{port}: {e.strerror}"
                            + (" (another process holds it; pick another --port)" if e.errno == errno.EADDRINUSE else "")) from None
    sock.set_inheritable(True)
    return sock


def _off_main_thread(make):
    """``make()`` run on a short-lived thread (its OpenMP team ends with it); its result, or
    its exception raised here."""
    box: dict = {}

    def work():
        try:
            box["value"] = make()
        except BaseException as e:  # re-raised on the calling thread, one-line errors included
            box["error"] = e
    t = threading.Thread(target=work, name="longattn-load", daemon=True)  # Ctrl-C need not wait for it
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _stop_ids(ck) -> set:
    """The checkpoint's end-of-sequence ids and its tokenizer's end-of-turn token."""
    ids = set(ck.config.eos_token_ids)
    tok = ck.tokenizer
    if getattr(tok, "eos_token_id", None) is not None:
        ids.add(tok.eos_token_id)
    return ids
