"""The serving engine: one thread runs every model step; requests join and leave between steps.

Each loop iteration, at a step boundary: cancelled requests leave (their blocks go back to
the pool at once), queued requests are admitted while the pool can hold them, every
decoding request advances one token and one prefill chunk of one admitted request runs, so a
long prompt never stalls the others for more than a chunk.

The step: by default the compiled paged step (engine/paged_step.py), built ahead of time for the
server's policy, runs the decode rows of every request under that policy and the prefill chunk
in one call (also under a sparse policy: a sparse layer's rows run SCSA over their own stream's
index, sparse/paged_op.py), and requests with their own window or sinks on the same build where
their layers group alike; every request where the step cannot be built
(``EngineConfig.compile="none"``, no native kernels, a rope that follows the sequence length)
runs the eager model, one batched decode step per policy (one per stream under a sparse policy)
and then the chunk. Each path computes a row the same way whatever shares its step (the
invariance contract), so a request's greedy tokens do not depend on who else is served.

Admission and prefix reuse are the scheduler's (engine/scheduler.py): a request reserves the
most blocks it can ever hold (``cache.paged.blocks_bound`` over its layers for
``prompt + max_tokens`` positions), so the running requests never exhaust the pool; a request
the pool cannot hold yet waits in a bounded queue (``QueueFull`` beyond it: the HTTP layer
answers 429); a finished request's stream stays in the pool for a later prompt that shares its
prefix. docs/serve.md says which prefix lengths stay reusable. This module owns the thread, the
requests' text (detokenizing, stop strings) and the steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..cache.kv_format import KV_FORMATS
from ..cache.paged import BlockPool, PagedKVCache, PagedStream, blocks_bound, finish_rows, plan_rows
from ..engine.sampling import SamplingConfig, sample
from ..engine.scheduler import Scheduler
from ..engine.session import recompute_length
from ..errors import LongattnError, check_int
from ..policy import AttentionPolicy
from ..sparse.policy import sparse_layers
from .detok import IncrementalText

log = logging.getLogger("longattn.serve")

# distinct per-request policies remembered (each holds its own mask memo)
MAX_POLICIES = 32
STEP_KINDS = ("aot", "none")
# the automatic pool's floor (many short conversations) and its share of the memory available
AUTO_MIN_BLOCKS = 4096
AUTO_MEMORY_SHARE = 0.5


def available_memory() -> Optional[int]:
    """Bytes the kernel says can be allocated without swapping (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class QueueFull(Exception):
    """The admission queue is full; the client should retry after ``retry_after`` seconds."""

    def __init__(self, retry_after: int):
        super().__init__("the server is at capacity; retry later")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    """The engine is draining or stopped and admits nothing new."""

    def __init__(self):
        super().__init__("the server is shutting down")


@dataclass
class EngineConfig:
    block_size: int = 16        # token slots per KV block
    num_blocks: Optional[int] = None  # blocks in the pool (all layers, all streams); None: auto_blocks
    max_batch: int = 16         # requests decoding at once
    max_queue: int = 64         # requests waiting for admission before 429
    chunk: int = 256            # prefill tokens per step
    retain: int = 16            # finished streams kept for prefix reuse (0 = off)
    rewind: int = 64            # positions a windowed layer keeps beyond its window (PagedStream)
    timeout: float = 0.0        # seconds a request may take from submission (0 = no limit)
    kv: str = "f32"             # the pool's format: "f32" or "bf16" (KV_FORMATS)
    compile: str = "aot"        # "aot": the compiled paged step where it runs; "none": the eager model

    def __post_init__(self):
        check_int("--block-size", self.block_size, minimum=1)
        check_int("--kv-blocks", self.num_blocks, minimum=1, allow_none=True)
        check_int("--max-batch", self.max_batch, minimum=1)
        check_int("--max-queue", self.max_queue, minimum=0)
        check_int("--prefill-chunk", self.chunk, minimum=1)
        check_int("--prefix-cache", self.retain, minimum=0)
        check_int("--prefix-rewind", self.rewind, minimum=0)
        if self.compile not in STEP_KINDS:
            raise LongattnError(f"--compile must be one of {', '.join(STEP_KINDS)}, got {self.compile!r}")
        if self.kv not in KV_FORMATS:
            raise LongattnError(f"--kv must be one of {', '.join(KV_FORMATS)}, got {self.kv!r}")
        if not (isinstance(self.timeout, (int, float)) and 0 <= self.timeout < float("inf")):
            raise LongattnError(f"--request-timeout must be a finite number of seconds >= 0, got {self.timeout}")


@dataclass
class Request:
    """One generation: the prompt, how to sample, and where its output goes.

    ``emit(kind, payload)`` is called from the engine thread: ``("text", str)`` for each
    settled piece of text, then exactly one ``("done", Request)`` or ``("error", str)``.
    """

    prompt: list
    max_tokens: int
    sampling: SamplingConfig
    emit: Callable
    stop: list = field(default_factory=list)          # stop strings
    policy_key: tuple = ()                            # () = the server's policy
    ignore_eos: bool = False                          # end-of-turn tokens do not end it
    id: str = ""
    # filled by the engine
    key: int = -1                                     # unique per engine: names it in the cancel set and prefix cache
    policy: Optional[AttentionPolicy] = None
    need: int = 0                                     # blocks reserved
    stream: Optional[PagedStream] = None
    # Per-token state is 4 bytes a token (int32 arrays) or bounded: a conversation that runs to
    # millions of tokens keeps its memory flat apart from these ids, which prefix reuse compares.
    fed: array = field(default_factory=lambda: array("i"))  # tokens stored in the cache, in order
    pending: Optional[int] = None                     # sampled, not yet fed
    generated: array = field(default_factory=lambda: array("i"))  # emitted token ids
    text: str = ""                                    # settled text not yet emitted (see _send)
    finish_reason: Optional[str] = None
    reused: int = 0                                   # prompt tokens taken from the prefix cache
    t_submit: float = 0.0
    t_first: Optional[float] = None
    t_done: Optional[float] = None
    generator: Optional[torch.Generator] = None
    detok: Optional[IncrementalText] = None

    @property
    def ttft(self) -> Optional[float]:
        return None if self.t_first is None else self.t_first - self.t_submit


class Metrics:
    """Counters and gauges /metrics reports (updated by the engine thread, read by HTTP)."""

    def __init__(self):
        self.requests = {"ok": 0, "error": 0, "rejected": 0, "cancelled": 0, "invalid": 0}
        self.refused: dict = {}     # requests the HTTP guard refused, by reason (code)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.prefix_tokens = 0
        self.steps = 0
        self.step_seconds = 0.0
        self.last_step_seconds = 0.0
        self.decode_batch = 0       # rows of the latest batched decode step
        self.compiled_steps = 0     # steps the compiled paged step ran
        self.peak_decode_batch = 0
        # SCSA's counters (sparse/layer.py COUNTER_NAMES) summed over the finished requests'
        # sparse layers: calls, rows read exactly, rows opened in clusters, ...
        self.sparse: dict = {}


class Engine:
    """Continuous batching over a paged KV pool.

    Make and run it from threads other than one that runs PyTorch ops of its own (as
    ``longattn serve`` does, cli/serve.py): each thread that runs a parallel region keeps an
    OpenMP team, and with more team threads than cores every parallel region of the engine's
    step wakes its workers from sleep (measured: a SmolLM2 decode step 27 ms instead of 9 ms on
    2 cores when the main thread had read the checkpoint).

    Args:
        model: a Transformer. tokenizer: its tokenizer (decodes the output text).
        policy: the server's AttentionPolicy (window/dense layers).
        config: EngineConfig. stop_ids: token ids that end a turn (not emitted).
    """

    def __init__(self, model, tokenizer, policy: AttentionPolicy, config: EngineConfig = EngineConfig(),
                 stop_ids=(), tau_path=None):
        self.model, self.cfg, self.tok = model, model.config, tokenizer
        self.config = config
        # where a sparse server policy's calibrated taus are kept (sparse/tau_cache.py): the
        # first stream that calibrates every sparse layer stores them, and later streams start
        # from them (None: each stream calibrates, nothing is kept)
        self.tau_path = tau_path
        self.stop_ids = set(stop_ids)
        # a long-rope model's factor switch (Phi-3): requests never cross it (serve.app refuses
        # them) and a stream is continued only by a prompt on its side of it
        self.rope_switch = recompute_length(self.cfg)
        PagedStream.for_policy(policy)  # refuses kinds the pool cannot page
        self.policies = {(): policy}
        kv_dtype = KV_FORMATS[config.kv] if model.activation_dtype == torch.float32 else model.activation_dtype
        if config.num_blocks is None:
            config = self.config = dataclasses.replace(config, num_blocks=self.auto_blocks(policy, kv_dtype))
        self.pool = BlockPool(config.num_blocks, config.block_size, self.cfg.num_kv_heads, self.cfg.head_dim, kv_dtype)
        self.paged = self._compiled_step(policy) if config.compile == "aot" else None
        self.metrics = Metrics()
        self._cv = threading.Condition()
        self._inbox: list = []
        self._cancel: set = set()
        self._stopping = False
        self._abort: Optional[str] = None  # set: every request in flight ends with this error
        # the queue, the running batch and the retained streams (engine/scheduler.py)
        self.sched = Scheduler(self.pool, config.max_batch, config.retain, config.rewind, self.metrics,
                               self.rope_switch)
        self._ids = itertools.count()
        self._keys = itertools.count()
        self._thread: Optional[threading.Thread] = None

    def _compiled_step(self, policy: AttentionPolicy):
        """The compiled paged step for the server's policy (loaded, or built once), or None with
        the reason logged where it cannot run here (the eager model serves instead)."""
        from ..engine.aot_step import AOTBuildError
        from ..engine.paged_step import PagedStep, unsupported
        why = unsupported(self.model, policy)
        if why is None:
            try:
                return PagedStep(self.model, policy, self.pool)
            except AOTBuildError as e:
                why = e.reason
        log.warning("serving with the eager step (slower): the compiled step cannot run here: %s", why)
        return None

    @property
    def waiting(self) -> list:
        return self.sched.waiting

    @property
    def running(self) -> list:
        return self.sched.running

    @property
    def retained(self):
        return self.sched.retained

    @property
    def step_kind(self) -> str:
        """"aot" when the server's policy runs the compiled paged step, else "eager"."""
        return "aot" if self.paged is not None else "eager"

    def auto_blocks(self, policy: AttentionPolicy, dtype) -> int:
        """The pool's default size: one conversation that fills the model's trained context
        under ``policy`` (windowed layers free what leaves the window), at least AUTO_MIN_BLOCKS,
        at most AUTO_MEMORY_SHARE of the memory available now. The pool's pages are touched only
        as blocks are first used, so an idle large pool costs address space, not memory."""
        c = self.config
        one = self.blocks_needed(policy, self.cfg.max_context - 1, 1)
        want = max(AUTO_MIN_BLOCKS, one)
        block_bytes = BlockPool.bytes_per_block(c.block_size, self.cfg.num_kv_heads, self.cfg.head_dim, dtype)
        avail = available_memory()
        if avail is not None and want * block_bytes > avail * AUTO_MEMORY_SHARE:
            want = max(1, int(avail * AUTO_MEMORY_SHARE // block_bytes))
            log.warning("the KV pool is sized to half the available memory (%d blocks, %d MiB): a conversation "
                        "filling the model's context needs %d blocks", want, want * block_bytes >> 20, one)
        return want

    # ------------------------------------------------------------------ called from any thread

    def policy_for(self, key: tuple) -> AttentionPolicy:
        """The policy of an override ``(window, sinks)`` (``()`` = the server's)."""
        if key not in self.policies:
            window, sinks = key
            self.policies[key] = AttentionPolicy.build(self.cfg, "window", window=window, sinks=sinks)
            if len(self.policies) > MAX_POLICIES:  # requests keep their own reference
                del self.policies[next(k for k in self.policies if k != ())]
        return self.policies[key]

    def bounded(self, key: tuple = ()) -> bool:
        """Every layer windowed: a stream's memory stays bounded however long it runs."""
        return self.policy_for(key).max_window is not None

    def blocks_needed(self, policy: AttentionPolicy, prompt: int, max_tokens: int) -> int:
        """Most blocks a request of ``prompt`` tokens generating ``max_tokens`` ever holds: its
        longest forward stores ``min(chunk, prompt)`` positions before a window frees any."""
        c = self.config
        longest = min(c.chunk, prompt)
        return sum(blocks_bound(lp.window or None, lp.sinks if lp.window else 0, prompt + max_tokens, longest,
                                c.block_size, c.rewind) for lp in policy.layers)

    def submit(self, req: Request) -> None:
        """Queue ``req``; raises QueueFull when the queue is full, LongattnError when the pool
        could never hold it."""
        req.policy = self.policy_for(req.policy_key)
        req.need = self.blocks_needed(req.policy, len(req.prompt), req.max_tokens)
        if req.need > self.pool.num_blocks:
            raise LongattnError(f"this request needs {req.need} KV blocks and the pool holds "
                                f"{self.pool.num_blocks}; lower max_tokens, shorten the prompt, or use a "
                                f"window (or start the server with more --kv-blocks)")
        if not self.bounded(req.policy_key) and len(req.prompt) + req.max_tokens > self.cfg.max_context:
            raise LongattnError(f"the prompt ({len(req.prompt)} tokens) plus max_tokens ({req.max_tokens}) "
                                f"exceeds the model's context of {self.cfg.max_context} tokens under a policy "
                                f"with global layers; shorten them, or serve with a window on every layer")
        s = self.rope_switch  # the last token is never fed: the sequence ends at prompt + max_tokens - 1
        if s is not None and len(req.prompt) <= s < len(req.prompt) + req.max_tokens - 1:
            raise LongattnError(f"the prompt ({len(req.prompt)} tokens) and max_tokens ({req.max_tokens}) pass the "
                                f"model's original context of {s} tokens, where its long rope factors take over "
                                "and every cached key would have to be rotated again (transformers recomputes "
                                f"the sequence; the server does not): keep them within {s} tokens, or send a "
                                f"prompt longer than {s}")
        if req.sampling.seed is not None:
            req.generator = torch.Generator().manual_seed(req.sampling.seed)
        req.detok = IncrementalText(self.tok)
        req.t_submit = time.perf_counter()
        with self._cv:
            if self._stopping:
                raise ShuttingDown()
            if self.sched.queued_with(self._inbox + [req]) > self.config.max_queue:
                self.metrics.requests["rejected"] += 1
                raise QueueFull(retry_after=self._retry_after())
            req.id = req.id or f"{next(self._ids)}"
            req.key = next(self._keys)
            self._inbox.append(req)
            self._cv.notify()

    def cancel(self, req: Request) -> None:
        """Drop ``req`` at the next step boundary (its blocks go back to the pool)."""
        with self._cv:
            self._cancel.add(req.key)
            self._cv.notify()

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="longattn-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, drain: bool = True, timeout: Optional[float] = None) -> None:
        """Stop the loop: after the running and queued requests finish when ``drain`` (new ones
        are refused from now on). A drain that passes ``timeout`` seconds ends each request still
        in flight with an error (its client learns it was cut, never a silent end); without
        ``drain`` they are cancelled at once."""
        with self._cv:
            self._stopping = True
            if not drain:
                for r in self._inbox + self.waiting + self.running:
                    self._cancel.add(r.key)
            self._cv.notify()
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive() and drain and timeout is not None:
            with self._cv:
                self._abort = f"the server shut down before this request finished (drain timeout {timeout:g} s)"
                self._cv.notify()
            self._thread.join()

    def snapshot(self) -> dict:
        """Gauges for /metrics and /health."""
        with self._cv:
            return {"queue": len(self.waiting) + len(self._inbox), "running": len(self.running),
                    "blocks_used": self.pool.used, "blocks_free": self.pool.free,
                    "blocks_retained": self.sched.retained_blocks(),
                    "alive": self._thread is not None and self._thread.is_alive(), "step": self.step_kind}

    # ------------------------------------------------------------------ the engine thread

    def _retry_after(self) -> int:
        per_step = self.metrics.step_seconds / max(1, self.metrics.steps)
        return max(1, int(per_step * 16 + 0.999))

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._inbox or self.waiting or self.running or self._cancel or self._stopping):
                    self._cv.wait()
                self.waiting.extend(self._inbox)
                self._inbox.clear()
                cancel, self._cancel = self._cancel, set()
                abort = self._abort
                if self._stopping and not (self.waiting or self.running):
                    return
            if abort is not None:
                for r in list(self.waiting) + list(self.running):
                    self._finish(r, error=abort)
                self.waiting.clear()
                return
            t0 = time.perf_counter()
            try:
                self._drop(cancel)
                self._expire()
                self.sched.admit()
                self._step()
            except Exception as e:  # outside any one request's step: fail those in flight, keep serving
                log.exception("engine step failed")
                for r in list(self.running):
                    self._finish(r, error=f"internal error: {type(e).__name__}: {e}")
            dt = time.perf_counter() - t0
            self.metrics.steps += 1
            self.metrics.step_seconds += dt
            self.metrics.last_step_seconds = dt

    def _drop(self, cancel: set) -> None:
        if not cancel:
            return
        for r in [r for r in self.waiting if r.key in cancel]:
            self.waiting.remove(r)
            self.metrics.requests["cancelled"] += 1
            r.finish_reason = "cancelled"
            r.emit("done", r)
        for r in [r for r in self.running if r.key in cancel]:
            self._finish(r, reason="cancelled")

    def _expire(self) -> None:
        """End the requests that have run past the configured timeout (queued ones too)."""
        limit = self.config.timeout
        if not limit:
            return
        now = time.perf_counter()
        msg = f"the request ran past the server's time limit of {limit:g} s (--request-timeout)"
        for r in [r for r in self.waiting if now - r.t_submit > limit]:
            self.waiting.remove(r)
            self._finish(r, error=msg)
        for r in [r for r in self.running if now - r.t_submit > limit]:
            self._finish(r, error=msg)

    def _step(self) -> None:
        """Every decoding request's next token and one prefill chunk, one call per policy: the
        compiled step where it serves the policy, else the eager model."""
        pre = self.sched.next_prefill()
        by_key: dict = {}
        for r in self.running:
            if r.pending is not None:
                by_key.setdefault(r.policy_key, []).append(r)
        if pre is not None:
            by_key.setdefault(pre.policy_key, [])
        for key, dec in by_key.items():
            chunk = pre if pre is not None and pre.policy_key == key else None
            policy = (dec[0] if dec else chunk).policy
            if self.paged is not None and self.paged.serves(policy):
                self._compiled(dec, chunk, policy)
                continue
            if dec and sparse_layers(policy):  # eager: a sparse layer's index is its stream's, one per call
                for r in dec:
                    self._decode([r])
            elif dec:
                self._decode(dec)
            if chunk is not None:
                self._guarded(chunk, lambda: self._prefill_chunk(chunk))

    def _compiled(self, dec: list, pre: Optional[Request], policy: AttentionPolicy) -> None:
        """``_compiled_rows``; where it fails, each request's part again alone, so a failure
        ends its own request only. Re-running is safe: a failed step moved no stream's
        ``next_pos``, so its writes land in the same slots again."""
        try:
            self._compiled_rows(dec, pre, policy)
        except Exception:
            log.exception("compiled step failed; running its requests one by one")
            for r in dec:
                if r.pending is not None and r.finish_reason is None:
                    self._guarded(r, lambda r=r: self._compiled_rows([r], None, policy))
            if pre is not None and pre.finish_reason is None:
                self._guarded(pre, lambda: self._compiled_rows([], pre, policy))

    def _compiled_rows(self, dec: list, pre: Optional[Request], policy: AttentionPolicy) -> None:
        """One compiled step: the pending token of each request of ``dec`` and the next prefill
        chunk of ``pre`` (or None), all under ``policy``."""
        streams = [r.stream for r in dec]
        segments = [(r.stream.next_pos, [r.pending]) for r in dec]
        part: list = []
        if pre is not None:
            start = len(pre.fed)
            part = pre.prompt[start:start + self.config.chunk]
            streams.append(pre.stream)
            segments.append((start, part))
        completes = pre is not None and len(pre.fed) + len(part) == len(pre.prompt)
        batch = plan_rows(self.pool, streams, segments, self.paged.groups)
        # rows whose logits are wanted: each decode row, and a chunk's last row if it ends the prompt
        sel = list(range(len(dec))) + [batch.rows - 1] if completes or not dec else list(range(len(dec)))
        sparse = (None, [])
        if sparse_layers(policy):  # each row names its stream, whose SCSA state the step's op reads
            reqs = list(dec) + ([pre] if pre is not None else [])
            counts = torch.tensor([1] * len(dec) + ([len(part)] if pre is not None else []))
            sparse = (torch.arange(len(reqs)).repeat_interleave(counts), [(r.stream.op_state, r.policy) for r in reqs])
        logits = self.paged(batch, torch.tensor(sel, dtype=torch.int64), policy, sparse)  # [S, V]
        finish_rows(self.pool, streams, batch)
        self.metrics.compiled_steps += 1
        if dec:
            self.metrics.decode_batch = len(dec)
            self.metrics.peak_decode_batch = max(self.metrics.peak_decode_batch, len(dec))
        for b, r in enumerate(dec):
            self._guarded(r, lambda r=r, b=b: self._feed_and_take(r, logits[b:b + 1]))
        if pre is not None:
            pre.fed.extend(part)
            if completes:
                self._guarded(pre, lambda: self._take(pre, logits[-1:]))

    def _decode(self, rs: list) -> None:
        """One eager batched decode step over ``rs`` (one policy, a pending token each)."""
        self.metrics.decode_batch = len(rs)
        self.metrics.peak_decode_batch = max(self.metrics.peak_decode_batch, len(rs))
        try:
            logits = self._decode_rows(rs)                         # [B, V]
        except Exception:
            # Which row failed is unknown: each runs again alone, so a failure ends its own
            # request only. Re-running is safe: a failed step moved no stream's next_pos, so
            # its writes land in the same slots again.
            log.exception("batched decode step failed; running its rows one by one")
            for r in rs:
                self._guarded(r, lambda r=r: self._feed_and_take(r, self._decode_rows([r])))
            return
        for b, r in enumerate(rs):
            self._guarded(r, lambda r=r, b=b: self._feed_and_take(r, logits[b:b + 1]))

    def _decode_rows(self, rs: list) -> torch.Tensor:
        """One decode step over the requests ``rs`` (one pending token each) -> logits [B, V]."""
        cache = PagedKVCache(self.cfg, self.pool, [r.stream for r in rs])
        tokens = torch.tensor([[r.pending] for r in rs])               # [B, 1]
        pos = cache.next_position()                                    # [B, 1]
        return self.model(tokens, pos, cache=cache, policy=rs[0].policy, logits="all")[:, 0]

    def _feed_and_take(self, r: Request, logits: torch.Tensor) -> None:
        r.fed.append(r.pending)
        r.pending = None
        self._take(r, logits)

    def _guarded(self, r: Request, work: Callable) -> None:
        """Run ``work`` (one request's part of a step); a failure ends ``r`` alone with an error."""
        try:
            work()
        except Exception as e:
            log.exception("request %s failed", r.id)
            self._finish(r, error=f"internal error: {type(e).__name__}: {e}")

    def _prefill_chunk(self, r: Request) -> None:
        start = len(r.fed)
        part = r.prompt[start:start + self.config.chunk]
        cache = PagedKVCache(self.cfg, self.pool, [r.stream])
        ids = torch.tensor([part])                                      # [1, T]
        pos = torch.arange(start, start + len(part))[None]              # [1, T]
        logits = self.model(ids, pos, cache=cache, policy=r.policy, logits="last")[:, 0]  # [1, V]
        r.fed.extend(part)
        if len(r.fed) == len(r.prompt):
            self._take(r, logits)

    def _take(self, r: Request, logits: torch.Tensor) -> None:
        """Sample the next token of ``r`` from ``logits [1, V]``; emit text; finish when done."""
        t = int(sample(logits, r.sampling, r.generator)[0])
        if r.t_first is None:
            r.t_first = time.perf_counter()
        if t in self.stop_ids and not r.ignore_eos:
            return self._finish(r, reason="stop")
        r.generated.append(t)
        self.metrics.generation_tokens += 1
        piece = r.detok.push(t)
        if piece:
            r.text += piece
            if self._stop_string(r, len(r.text) - len(piece)):
                return self._finish(r, reason="stop")
            self._send(r, final=False)
        if len(r.generated) >= r.max_tokens:
            return self._finish(r, reason="length")
        if not self.bounded(r.policy_key) and len(r.fed) + 1 >= self.cfg.max_context:
            return self._finish(r, reason="length")
        r.pending = t

    @staticmethod
    def _stop_string(r: Request, new_from: int) -> bool:
        """Cut ``r.text`` at the first stop string the new text completes; True if one did."""
        if not r.stop:
            return False
        look = max(0, new_from - max(len(s) for s in r.stop) + 1)
        hits = [i for i in (r.text.find(s, look) for s in r.stop) if i >= 0]
        if hits:
            r.text = r.text[:min(hits)]
            return True
        return False

    @staticmethod
    def _send(r: Request, final: bool) -> None:
        """Emit the settled text not sent yet: all of it when ``final``, else all but a tail
        that could still grow into a stop string. Only that tail stays in ``r.text``: a stop
        string completed later starts inside it (text before it was no stop string's start
        when sent), so emitted text is never looked at again and a long reply's text is not
        kept (or copied on every token)."""
        end = len(r.text)
        if not final:
            for s in r.stop:
                for k in range(min(len(s) - 1, len(r.text)), 0, -1):
                    if r.text.endswith(s[:k]):
                        end = min(end, len(r.text) - k)
                        break
        if end > 0:
            r.emit("text", r.text[:end])
            r.text = r.text[end:]

    def _keep_taus(self, r: Request) -> None:
        """Once a stream under the server's sparse policy has calibrated every sparse layer, keep
        its taus (``tau_path``) and start later streams from them: they decode sparse from their
        first step past ``min_context`` instead of calibrating again."""
        from ..sparse.policy import policy_taus, stream_layers, with_taus
        from ..sparse.tau_cache import store_taus
        policy = self.policies[()]
        if r.policy_key != () or r.stream is None or not sparse_layers(policy) or policy_taus(policy):
            return
        held = stream_layers(r.stream)
        if not held or not all(i in held and held[i].calibrated for i in sparse_layers(policy)):
            return
        self.policies[()] = with_taus(policy, {i: held[i].tau_values() for i in sparse_layers(policy)})
        if self.tau_path is not None:
            try:
                store_taus(self.tau_path, policy, r.stream)
            except LongattnError as e:  # the server goes on with them; the next one calibrates again
                log.warning("calibrated taus not kept: %s", e)
        log.info("sparse taus calibrated by request %s; later requests start from them", r.id)

    def _count_sparse(self, r: Request) -> None:
        """Add what the stream's sparse layers did for ``r`` to /metrics (their counters start
        again for the request that continues the stream)."""
        from ..sparse.policy import stream_layers
        if r.stream is None:
            return
        for sc in stream_layers(r.stream).values():
            for name, value in sc.counters.items():
                self.metrics.sparse[name] = self.metrics.sparse.get(name, 0) + value
                sc.counters[name] = 0

    def attention_of(self, r: Request) -> str:
        """How ``r`` attends, for the request log: "sparse" (the server's SCSA policy),
        "window=W,sinks=S" (its own), or "server" (the server's policy, no sparse layer)."""
        if r.policy_key:
            return "window={},sinks={}".format(*r.policy_key)
        return "sparse" if r.policy is not None and sparse_layers(r.policy) else "server"

    def _finish(self, r: Request, reason: Optional[str] = None, error: Optional[str] = None) -> None:
        self._count_sparse(r)
        if error is None:
            self._keep_taus(r)
        self.sched.retire(r, keep=error is None and reason != "cancelled")
        r.t_done = time.perf_counter()
        r.finish_reason = reason or "error"
        if error is not None:
            self.metrics.requests["error"] += 1
            r.emit("error", error)
            return
        self.metrics.requests["cancelled" if reason == "cancelled" else "ok"] += 1
        if reason != "cancelled":
            self._send(r, final=True)
        r.emit("done", r)
