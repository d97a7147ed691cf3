"""`longattn serve`: an OpenAI-compatible HTTP server (docs/serve.md)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from ..errors import LongattnError
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
    p.add_argument("--kv-blocks", type=int, default=4096, help="blocks in the KV pool (all layers and streams)")
    p.add_argument("--block-size", type=int, default=16, help="token slots per KV block")
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
                   help="on SIGTERM/SIGINT, seconds to let requests in flight finish before they are cut")
    add_policy_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        import uvicorn

        from ..serve.app import create_app
    except ModuleNotFoundError as e:
        raise LongattnError(f"serve needs {e.name}: pip install 'longattn[serve]' (fastapi and uvicorn)") from None
    from ..serve.batching import Engine, EngineConfig
    setup_threads(args.threads)
    if not 0 < args.port < 65536:
        raise LongattnError(f"--port must be in 1..65535, got {args.port}")
    config = EngineConfig(block_size=args.block_size, num_blocks=args.kv_blocks, max_batch=args.max_batch,
                          max_queue=args.max_queue, chunk=args.prefill_chunk, retain=args.prefix_cache,
                          rewind=args.prefix_rewind)
    if args.policy == "sparse":
        raise LongattnError("serve runs window and dense policies; the paged cache has no sparse path")
    ck = open_checkpoint(args)
    if ck.tokenizer is None:
        raise LongattnError(f"{ck.name} has no tokenizer; serve needs one to read and write text")
    policy = policy_from_args(ck.config, args)
    # Tensors are made off the main thread, which then runs no PyTorch op at all: OpenMP keeps a
    # worker team per thread that has run a parallel region, and while the main thread's team
    # lives, every parallel region of the engine thread cost ~100 us more (measured: a SmolLM2
    # decode step 40 ms with the model loaded on the main thread, 23.5 ms without).
    engine = _off_main_thread(lambda: Engine(model_for(ck, args), ck.tokenizer, policy, config,
                                             stop_ids=_stop_ids(ck)))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    engine.start()
    app = create_app(engine, args.served_name or ck.name)
    print(f"-- serving {ck.name} on http://{args.host}:{args.port}/v1 ({config.num_blocks} KV blocks of "
          f"{config.block_size} tokens, {engine.pool.block_bytes * config.num_blocks / 2**20:.0f} MiB)",
          file=sys.stderr, flush=True)
    # uvicorn turns SIGTERM/SIGINT into a graceful shutdown: no new connections, requests in
    # flight finish, then the app's lifespan stops the engine. Afterwards it raises the signal
    # again under the handler it found; a no-op SIGTERM handler makes a drained stop exit 0.
    signal.signal(signal.SIGTERM, lambda sig, frame: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=args.drain_timeout)
    return 0


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
