"""The HTTP face of the engine: OpenAI-compatible routes, server-sent events, /metrics.

Each completion request becomes an engine ``Request`` whose output arrives on an asyncio
queue (the engine thread hands events over with ``call_soon_threadsafe``). A client that
goes away -- a closed stream or an abandoned non-stream request -- is cancelled in the
engine, which frees its blocks at the next step boundary. One log line per request.

The event loop only moves bytes: parsing, templating and tokenization run on a small thread
pool, so a client sending a huge prompt delays no other client's stream or /health. What a
request must pass first (Host, API key, body size and type) is ``guard.Guard``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import LongattnError
from ..engine.sampling import SamplingConfig
from .batching import Engine, QueueFull, Request, ShuttingDown
from .guard import BodyTooLarge, Guard, ServeOptions, too_large
from .metrics import render_metrics
from .protocol import APIError, ChatRequest, CompletionRequest, Sampling, validation_message

log = logging.getLogger("longattn.serve")


def create_app(engine: Engine, model_id: str, options: Optional[ServeOptions] = None):
    """An ASGI app serving ``engine`` under the model name ``model_id``, guarded by ``options``
    (``guard.ServeOptions``; the defaults: no API key, loopback Host names only, 4 MiB bodies).
    Its lifespan's end drains the engine (requests in flight finish, then the engine thread
    stops)."""
    opt = options or ServeOptions()
    work = ThreadPoolExecutor(opt.tokenizer_threads, thread_name_prefix="longattn-tokenize")

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)
        work.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="longattn", lifespan=lifespan, docs_url="/docs" if opt.docs else None,
                  redoc_url=None, openapi_url="/openapi.json" if opt.docs else None)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: HTTPRequest, e: APIError):
        if e.status in (400, 404, 413):
            engine.metrics.requests["invalid"] += 1
        log.info("%s %s %d %s", request.method, request.url.path, e.status, e.message)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: HTTPRequest, e: StarletteHTTPException):
        # unknown routes and methods answer in OpenAI's error shape too
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on "
                   f"{request.url.path}"}.get(e.status_code, str(e.detail))
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        log.info("%s %s %d", request.method, request.url.path, e.status_code)
        return JSONResponse(APIError(e.status_code, message, code=code).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    async def off_loop(fn, *args):
        """``fn(*args)`` on the tokenizer pool: CPU work that would stall every stream if run here."""
        return await asyncio.get_running_loop().run_in_executor(work, fn, *args)

    async def parse(request: HTTPRequest, schema):
        """The body as ``schema`` (its size and Content-Type are checked by the guard)."""
        try:
            raw = await request.body()
        except BodyTooLarge:
            raise APIError(413, too_large(opt.max_body), None, "body_too_large")
        try:
            return await off_loop(schema.model_validate_json, raw)
        except ValidationError as e:
            msg, param = validation_message(e.errors())
            raise APIError(400, msg, param)

    @app.get("/health")
    async def health():
        snap = engine.snapshot()
        ok = snap["alive"]
        return JSONResponse({"status": "ok" if ok else "stopped", **snap}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(engine), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "longattn"}]}

    def engine_request(body: Sampling, prompt: list, default_max: Optional[int]) -> Request:
        if body.model != model_id:
            raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{model_id}'",
                           "model", "model_not_found")
        if not prompt:
            raise APIError(400, "the prompt is empty", "prompt")
        if len(prompt) > opt.max_prompt_tokens:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; this server takes at most "
                                f"{opt.max_prompt_tokens} (--max-prompt-tokens)", "messages", "context_length_exceeded")
        if body.policy is not None:
            for name in ("window", "sinks"):
                if getattr(body.policy, name) > engine.cfg.max_context:
                    raise APIError(400, f"policy.{name} must be at most the model's context, "
                                        f"{engine.cfg.max_context}", f"policy.{name}")
        key = (body.policy.window, body.policy.sinks) if body.policy else ()
        max_tokens = body.max_tokens
        # a long-rope model (Phi-3) changes every key's rotation when the sequence passes its
        # original context: a reply without a limit stops there (Engine.submit refuses a limit
        # past it)
        switch = engine.rope_switch
        crossing = switch is not None and len(prompt) <= switch
        if max_tokens is None:
            # a reply without a limit ends by the context: what is left of it under a policy
            # with global layers, the context's length when every layer is windowed
            room = engine.cfg.max_context - len(prompt)
            if engine.bounded(key):
                room = engine.cfg.max_context
            if crossing:  # the last token is never fed: the sequence ends at prompt + max_tokens - 1
                room = min(room, switch - len(prompt) + 1)
            max_tokens = min(default_max, room) if default_max is not None else room
            if max_tokens < 1:
                raise APIError(400, f"the prompt ({len(prompt)} tokens) leaves no room in the model's "
                                    f"context of {engine.cfg.max_context} tokens", "messages", "context_length_exceeded")

        try:
            sampling = SamplingConfig(body.temperature, 0, body.top_p, body.seed)
        except LongattnError as e:
            raise APIError(400, str(e))
        return Request(prompt=prompt, max_tokens=max_tokens, sampling=sampling,
                       emit=None, stop=list(body.stop or []), policy_key=key, ignore_eos=body.ignore_eos)

    async def submit(req: Request) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def emit(kind, payload):
            try:
                loop.call_soon_threadsafe(q.put_nowait, (kind, payload))
            except RuntimeError:  # the event loop has closed: nobody is listening any more
                pass
        req.emit = emit
        try:
            engine.submit(req)
        except QueueFull as e:
            raise APIError(429, str(e), None, "rate_limit_exceeded", "rate_limit_error",
                           headers={"Retry-After": str(e.retry_after)})
        except ShuttingDown as e:
            raise APIError(503, str(e), None, "shutting_down", "server_error", headers={"Retry-After": "5"})
        except LongattnError as e:
            code = "context_length_exceeded" if "context" in str(e) else None
            raise APIError(400, str(e), None, code)
        return q

    async def client_gone(request: HTTPRequest) -> None:
        """Returns once the client has disconnected (the body is already read, so the next
        message a request receives is the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    def usage(r: Request) -> dict:
        return {"prompt_tokens": len(r.prompt), "completion_tokens": len(r.generated),
                "total_tokens": len(r.prompt) + len(r.generated),
                "prompt_tokens_details": {"cached_tokens": r.reused}}

    def log_done(path: str, r: Request, status: int = 200) -> None:
        ttft = f"{r.ttft * 1000:.0f}ms" if r.ttft is not None else "-"
        total = (r.t_done or time.perf_counter()) - r.t_submit
        log.info("POST %s %d id=%s prompt=%d cached=%d completion=%d finish=%s ttft=%s total=%.2fs attention=%s",
                 path, status, r.id, len(r.prompt), r.reused, len(r.generated), r.finish_reason, ttft, total,
                 engine.attention_of(r))

    async def run(request: HTTPRequest, body: Sampling, req: Request, kind: str):
        """Answer one request: a JSON body, or an event stream when ``body.stream``."""
        q = await submit(req)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        path = request.url.path
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream_events(q, req, rid, kind, include_usage, path),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text = []
        gone = asyncio.ensure_future(client_gone(request))
        try:
            while True:
                get = asyncio.ensure_future(q.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    engine.cancel(req)
                    log_done(path, req, 499)
                    return JSONResponse({}, status_code=499)
                ev, payload = get.result()
                if ev == "text":
                    text.append(payload)
                elif ev == "error":
                    log.info("POST %s 500 id=%s %s", path, req.id, payload)
                    return JSONResponse(APIError(500, payload, kind="server_error").body(), status_code=500)
                else:
                    break
        except asyncio.CancelledError:
            engine.cancel(req)
            raise
        finally:
            gone.cancel()
        log_done(path, req)
        out = "".join(text)
        choice = ({"index": 0, "message": {"role": "assistant", "content": out}, "finish_reason": req.finish_reason,
                   "logprobs": None} if kind == "chat" else
                  {"index": 0, "text": out, "finish_reason": req.finish_reason, "logprobs": None})
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": model_id, "choices": [choice], "usage": usage(req)}

    async def stream_events(q, req: Request, rid: str, kind: str, include_usage: bool, path: str):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        created = int(time.time())

        def chunk(delta: Optional[str], finish: Optional[str] = None, role: bool = False, usage_=None,
                  choices: bool = True) -> str:
            if kind == "chat":
                d = {} if delta is None else {"content": delta}
                if role:
                    d = {"role": "assistant", "content": ""}
                choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            msg = {"id": rid, "object": obj, "created": created, "model": model_id,
                   "choices": [choice] if choices else []}
            if usage_ is not None:
                msg["usage"] = usage_
            return f"data: {json.dumps(msg)}\n\n"

        done = False
        try:
            if kind == "chat":
                yield chunk(None, role=True)
            while True:
                ev, payload = await q.get()
                if ev == "text":
                    yield chunk(payload)
                elif ev == "error":
                    done = True
                    log.info("POST %s 500 id=%s %s", path, req.id, payload)
                    yield f"data: {json.dumps(APIError(500, payload, kind='server_error').body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                else:
                    done = True
                    yield chunk(None, finish=req.finish_reason, usage_=usage(req))
                    if include_usage:
                        yield chunk(None, usage_=usage(req), choices=False)
                    yield "data: [DONE]\n\n"
                    log_done(path, req)
                    return
        finally:
            if not done:  # the client went away mid-stream
                engine.cancel(req)
                log_done(path, req, 499)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = await parse(request, CompletionRequest)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            prompt = await off_loop(lambda: list(engine.tok(p)["input_ids"]))
        else:
            # a million ids take a while to check: off the loop like tokenization
            if await off_loop(lambda: any(t < 0 or t >= engine.cfg.vocab_size for t in p)):
                raise APIError(400, f"token ids must lie in [0, {engine.cfg.vocab_size})", "prompt")
            prompt = list(p)
        return await run(request, body, engine_request(body, prompt, default_max=16), "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        body = await parse(request, ChatRequest)
        from ..chat import chat_ids
        msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = await off_loop(chat_ids, engine.tok, msgs)
        except LongattnError as e:
            raise APIError(400, str(e), "messages")
        except Exception as e:  # the template itself refused the conversation
            raise APIError(400, f"the chat template refused these messages: {e}", "messages")
        return await run(request, body, engine_request(body, prompt, default_max=None), "chat")

    return Guard(app, opt, engine.metrics.refused)
