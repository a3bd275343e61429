"""The engine thread: one background thread owns the (not thread-safe) Engine.

The asyncio side tokenizes and checks a request, then calls `submit()` / `abort()`; both only put commands on a
thread-safe queue, so the engine thread never tokenizes. Each request's events go to its sink: an event loop's
asyncio queue here, the pipe to the server's process when the engine runs in a process of its own
(serve/engine_proc.py). The thread admits new requests between steps (continuous
batching is the engine's: a request joins the running batch at the next step), calls `engine.step()` while there is
work, and pushes `Event`s onto each request's asyncio queue through `loop.call_soon_threadsafe`. Text deltas are held
back while they could still change: a trailing partial UTF-8 character ('\\ufffd') and the last len(stop)-1
characters that a stop string could still cut.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from dspark.request import Request, RequestOutput, SamplingParams
from serve.profile import EngineProfile

log = logging.getLogger("serve.runner")

SNAPSHOT_S = 0.05  # /metrics lags a busy engine by at most this (an idle one's snapshot is current)
SNAPSHOT_WAIT_S = 1.0  # /metrics waits at most this for a snapshot promised after a request's last event ...
SNAPSHOT_POLL_S = 2e-4  # ... looking this often (it comes a few hundred microseconds after the event)
SENT_WAIT_S = 2e-3  # an idle engine's snapshot waits at most this for the events before it to leave (EngineRunner.sent)


@dataclass
class Event:
    token_ids: list[int]
    text: str  # the new text since the previous event ("" towards a sink that detokenizes)
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error" on the last event
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    final_text: str | None = None  # towards a sink that detokenizes, on the last event: the whole text, when stop
    # strings could have cut it

    def wire(self) -> tuple:
        """The fields as a tuple, Event(*wire) again: what crosses the engine process's pipe (a step's 64 events
        pickle about 4x faster as tuples than as dataclasses, in the thread that competes with the engine loop)."""
        return (self.token_ids, self.text, self.finish_reason, self.prompt_tokens, self.completion_tokens, self.error,
                self.final_text)


class TextDelta:
    """What a stream sends of a growing text: each new part once, holding back a trailing partial UTF-8 character
    ('\ufffd') and the last len(stop) - 1 characters that a stop string could still cut, until the last event."""

    def __init__(self, stops: list[str]):
        self.sent = 0  # characters already sent
        self.holdback = max((len(x) for x in stops), default=1) - 1

    def delta(self, text: str, final: bool) -> str:
        end = len(text) if final else len(text) - self.holdback
        if not final:
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent:end], end
        return out


@dataclass
class EngineInfo:
    """What the HTTP side needs to know of the engine (plain values: it crosses a process boundary)."""
    max_model_len: int
    k: int
    vocab_size: int
    max_batch_size: int
    graphs: bool
    compiled: bool
    overlap: bool
    step_ms: dict[int, float] | None  # the k policy's replay time per candidate k, one row at full context

    @classmethod
    def of(cls, e) -> EngineInfo:
        ms = e.step_times(1, e.max_model_len, "greedy") if e.drafts is not None else None
        return cls(e.max_model_len, e.k, e.target.config.vocab_size, e.max_batch_size, e.runner.graphs,
                   e.runner.compiled, e.overlap, ms)


@dataclass
class Snapshot:
    """What /metrics reads: taken by the engine thread, read (never mutated) by the event loop."""
    counters: dict
    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    time: float = field(default_factory=time.time)


class LoopSink:
    """Delivers events to an asyncio event loop of this process: a request's key is its asyncio.Queue."""

    detokenizes = False  # its events carry their text (a sink that detokenizes gets token ids and decodes them)

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop

    def open(self, req: Request) -> asyncio.Queue:
        return asyncio.Queue()

    def deliver(self, items: list[tuple[asyncio.Queue, Event]]) -> None:
        try:  # one wake-up of the loop for all of a step's events
            self.loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the loop is closed (server shutting down)
            pass


@dataclass
class _Stream:
    req: Request
    sink: LoopSink  # or engine_proc.PipeSink: open(req) -> key, deliver([(key, Event)])
    key: object  # the request's key in its sink
    text: TextDelta | None = None  # what of req.text was sent (None: the sink detokenizes)


@dataclass
class AddCommand:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    sink: LoopSink
    future: concurrent.futures.Future


@dataclass
class ProfileCommand:
    action: str  # "start" or "stop"
    future: concurrent.futures.Future


def _deliver(items: list[tuple[asyncio.Queue, Event]]) -> None:
    for q, ev in items:
        q.put_nowait(ev)


async def kept_snapshot(holder) -> Snapshot:
    """holder's snapshot (an EngineRunner's or an EngineClient's) once every snapshot promised after a request's last
    event is there (_kept reaches _promised: a client that saw its last token reads metrics that count it), at most
    SNAPSHOT_WAIT_S later."""
    end = time.monotonic() + SNAPSHOT_WAIT_S
    while holder._kept < holder._promised and holder.alive and time.monotonic() < end:
        await asyncio.sleep(SNAPSHOT_POLL_S)
    return holder.snapshot


class EngineDead(RuntimeError):
    """The engine thread is not running (it died, or the server is stopping)."""


class EngineRunner:
    def __init__(self, engine, recent: int = 1024, profile_dir: str | None = None):
        self.engine = engine
        self.info, self.tokenizer = EngineInfo.of(engine), engine.tokenizer
        self.profiler = EngineProfile(profile_dir) if profile_dir else None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._exited = threading.Event()  # set when _run ends, before it answers what is still queued
        # finished outputs of the streams decoded here (a sink that detokenizes decodes its own: no decode here)
        self.recent: collections.deque[RequestOutput] = collections.deque(maxlen=recent)
        self.error: str | None = None  # set if the thread died
        self.loop_s = 0.0  # seconds of the thread's iterations: steps and delivery (not its idle waits)
        self.snapshot = self._snap()
        self.publish = None  # called with each new snapshot (the engine process sends it on)
        self.promise = None  # called before the events a snapshot follows (the engine process sends that on too)
        # called (with a timeout) before an idle engine's snapshot is built: the engine process's sending thread has
        # written the events before it (building the snapshot holds the GIL that thread needs to pickle them)
        self.sent = None
        self._promised = self._kept = 0  # snapshots promised after a request's last event, and of those published
        self._sinks: dict[asyncio.AbstractEventLoop, LoopSink] = {}
        self._out: dict[LoopSink, list[tuple[object, Event]]] = {}  # events to deliver, by sink
        self._finished = False  # a stream ended since the last delivery
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> EngineRunner:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._exited.is_set() and self.error is None

    async def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str
                     ) -> tuple[Request, asyncio.Queue]:
        """Enqueue a tokenized request; the engine thread adds it between steps. Raises ValueError for a request the
        engine rejects, EngineDead when the thread is not running."""
        loop = asyncio.get_running_loop()
        sink = self._sinks.get(loop) or self._sinks.setdefault(loop, LoopSink(loop))
        return await asyncio.wrap_future(self.enqueue(prompt_ids, params, request_id, sink))

    def enqueue(self, prompt_ids: list[int], params: SamplingParams, request_id: str, sink
                ) -> concurrent.futures.Future:
        """Queue a request for the engine thread -> a future of (request, its key in `sink`)."""
        if not self.alive:
            raise EngineDead("engine thread is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(AddCommand(prompt_ids, params, request_id, sink, fut))
        if self._exited.is_set():  # it ended between the check and the put: nobody else will answer
            self._drain()
        return fut

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    async def fresh_snapshot(self) -> Snapshot:
        """The snapshot /metrics serves (kept_snapshot)."""
        return await kept_snapshot(self)

    async def profile(self, action: str) -> list[str]:
        """Start ("start") or stop ("stop": -> the paths written) the engine thread's profile window; RuntimeError
        when there is no profile dir or the window is already in that state."""
        return await asyncio.wrap_future(self.profile_future(action))

    def profile_future(self, action: str) -> concurrent.futures.Future:
        if self.profiler is None:
            raise RuntimeError("profiling is off: start the server with --profile-dir (or VLLM_TORCH_PROFILER_DIR)")
        if not self.alive:
            raise EngineDead("engine thread is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(ProfileCommand(action, fut))
        return fut

    # ------------------------------------------------------------------ engine thread
    def _next(self, block: bool):
        """The next command (None: stop), or ... when none is queued and block is False (one consumer: empty() then
        get())."""
        return self._cmds.get() if block or not self._cmds.empty() else ...

    def _run(self) -> None:
        torch.set_grad_enabled(False)  # this thread's grad mode: the engine's steps then skip entering no_grad
        try:
            while not self._stop.is_set():
                cmd = self._next(block=not self.engine.has_work())  # block only when idle
                while cmd is not ...:  # between steps take whatever arrived
                    if cmd is None:
                        return  # (finally: flushes what _handle pushed)
                    self._handle(cmd)
                    cmd = self._next(block=False)
                t0 = time.perf_counter()
                if self.engine.has_work():
                    self._step()  # with the engine's overlap its next step is queued: the delivery overlaps it
                self.loop_s += time.perf_counter() - t0
                # a snapshot due goes after the events (no token waits for it: with a drafter's policy view it
                # takes a few hundred microseconds); when a request finished, it is promised first, and /metrics
                # waits for it (a client that saw its last token reads metrics that count it: fresh_snapshot)
                due = not self.engine.has_work() or time.time() - self.snapshot.time >= SNAPSHOT_S
                if due and self._finished:
                    self._promised += 1
                    if self.promise is not None:
                        self.promise()
                t0 = time.perf_counter()
                self._flush()
                self.loop_s += time.perf_counter() - t0
                if due:
                    if self.sent is not None and not self.engine.has_work():
                        self.sent(SENT_WAIT_S)  # the last events out first: nothing else to do meanwhile
                    self._publish_snapshot()
                self._finished = False
        except BaseException as e:  # noqa: BLE001 - report, fail every open stream, and stop
            self.error = f"engine thread died: {type(e).__name__}: {e}"
            log.exception("engine thread died")
            for rid in list(self._streams):
                self._finish(rid, "error", self.error)
        finally:
            self._flush()
            self._exited.set()
            self._drain()

    def _drain(self) -> None:
        """Answer every request still queued once the thread is gone (their submit() would wait forever)."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, (AddCommand, ProfileCommand)) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(EngineDead("engine thread is not running"))

    def _handle(self, cmd) -> None:
        if isinstance(cmd, AddCommand):
            if not cmd.future.set_running_or_notify_cancel():
                return  # the client went away before admission
            try:
                req = self.engine.add_request(cmd.prompt_ids, cmd.params, request_id=cmd.request_id)
            except ValueError as e:  # the request's fault: a 400
                cmd.future.set_exception(e)
                return
            except Exception as e:  # noqa: BLE001 - fails this request only, never the thread
                log.exception("adding request %s failed", cmd.request_id)
                cmd.future.set_exception(e)
                return
            s = _Stream(req, cmd.sink, cmd.sink.open(req),
                        None if cmd.sink.detokenizes else TextDelta(req.params.stop))
            self._streams[req.id] = s
            cmd.future.set_result((req, s.key))
        elif isinstance(cmd, ProfileCommand):
            counters = {**self.engine.metrics(), "loop_s": self.loop_s}
            try:
                if cmd.action == "start":
                    self.profiler.start(counters)
                    cmd.future.set_result([])
                else:
                    cmd.future.set_result(self.profiler.stop(counters))
            except RuntimeError as e:
                cmd.future.set_exception(e)
        elif cmd[0] == "abort":
            rid = cmd[1]
            if rid in self._streams:
                self.engine.abort(rid)
                self._finish(rid, "abort")

    def _step(self) -> None:
        try:
            emitted = self.engine.step()
        except Exception as ex:  # the engine finished the batch with "error"; keep serving the others
            log.exception("engine.step failed")
            msg = f"engine error: {type(ex).__name__}: {ex}"
            for rid, s in list(self._streams.items()):
                if s.req.status.value == "finished":
                    self._finish(rid, s.req.finish_reason or "error", msg)
            return
        for req, toks in emitted:
            s = self._streams.get(req.id)
            if s is None:
                continue
            done = req.status.value == "finished"
            if done:
                self._finish(req.id, req.finish_reason or "stop", toks=toks)
            else:
                self._push(s, Event(list(toks), self._delta(s, final=False)))
        sched = self.engine.scheduler
        if len(self._streams) > len(sched.running) + len(sched.waiting):  # some finished without emitting (defensive)
            for rid, s in list(self._streams.items()):
                if s.req.status.value == "finished":
                    self._finish(rid, s.req.finish_reason or "stop")

    def _delta(self, s: _Stream, final: bool) -> str:
        return "" if s.text is None else s.text.delta(s.req.text, final)

    def _finish(self, rid: str, reason: str, error: str | None = None, toks=()) -> None:
        s = self._streams.pop(rid, None)
        if s is None:
            return
        self._finished = True
        r = s.req
        if s.text is not None:
            self.recent.append(r.output())
        cut = r.text if s.text is None and r.params.stop else None  # a stop string's cut, for a sink that decodes
        self._push(s, Event(list(toks), self._delta(s, final=True), reason, len(r.prompt_ids), len(r.output_ids),
                            error, cut))

    def _push(self, s: _Stream, ev: Event) -> None:
        self._out.setdefault(s.sink, []).append((s.key, ev))

    def _flush(self) -> None:
        """Hand this step's events to their sinks: one delivery per sink per step, not one per request."""
        out, self._out = self._out, {}
        for sink, items in out.items():
            sink.deliver(items)

    def _publish_snapshot(self) -> None:
        self.snapshot = self._snap()
        self._kept = self._promised
        if self.publish is not None:
            self.publish(self.snapshot)

    def _snap(self) -> Snapshot:
        e = self.engine
        pool = e.cache.pool
        return Snapshot({**e.metrics(), "loop_s": self.loop_s}, len(e.scheduler.running), len(e.scheduler.waiting),
                        pool.num_used, pool.num_free)
