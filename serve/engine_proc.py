"""The engine in a process of its own (vLLM's EngineCore split): the HTTP side and the engine no longer share a GIL.

In one process, the event loop (parsing, streaming SSE to every client) and the engine thread take turns on the
GIL, so at high concurrency each decode step waits for the HTTP side and each new request waits for the engine.
With `python -m serve --engine-process` (the default on a GPU) the server's process keeps the HTTP side and a
tokenizer; a child process (spawned: it initialises CUDA itself) loads the models, captures the graphs and runs the
in-process server's EngineRunner loop on its main thread, reading the pipe between steps. One pipe joins them:

    server -> engine   ("add", rid, prompt_ids, params) | ("abort", rid) | ("profile", action) | ("stop",)
    engine -> server   ("ready", EngineInfo, Snapshot) | ("failed", (kind, message, traceback)) at start;
                       ("added", rid, error) | ("events", [(rid, Event.wire())], Snapshot | None, promised) (one
                       message per step; a Snapshot runner.SNAPSHOT_S apart and when idle, after the events it
                       follows: the reader takes it before the message's events; promised: a Snapshot follows
                       these events, which /metrics waits for) |
                       ("profiled", files | error) |
                       ("dead", error) when the engine loop died

The events carry token ids; the server's process decodes their text (the last event of a request with stop strings
carries its whole text, which a stop string may have cut), so the engine's thread does not detokenize.
The engine process ends when the pipe closes (the server's process is gone) or on "stop". The server's side of the
pipe is serve.engine_client.EngineClient.
"""
from __future__ import annotations

import concurrent.futures
import gc
import queue
import select
import sys
import threading
import time
import traceback
from pathlib import Path

from dspark.checkpoint import load_drafter, load_target
from dspark.device import resolve_device, resolve_dtype
from dspark.engine import Engine
from dspark.request import Request
from serve.runner import AddCommand, EngineRunner, Event, ProfileCommand, Snapshot

SWITCH_INTERVAL_S = 2e-4  # the engine loop waits at most this for the sending thread to yield the GIL (default 5 ms)
START_TIMEOUT_S = 3600.0  # loading, compiling and capturing: a compiled server's start can take many minutes
# an engine that fails to start on bad input raises one of these: the client raises it again, with its message
START_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}


def check_max_model_len(max_model_len: int | None, positions: int | None, name: str = "max_model_len") -> None:
    if max_model_len is not None and positions is not None and max_model_len > positions:
        raise ValueError(f"{name}: {max_model_len} exceeds the target's max_position_embeddings {positions}")


def build_engine(target_dir: str | Path, drafter_dir: str | Path | None = None, *, num_speculative_tokens=None,
                 max_batch_size: int = 32, max_model_len: int | None = None, adaptive_verification: bool = False,
                 draft_top_k: int = 0, device: str = "auto", dtype: str = "auto", enforce_eager: bool = False,
                 compile: bool = False, async_scheduling: bool | None = None) -> Engine:
    """Load the pair and build a server's engine, its graphs captured (greedy and sampled; those of top-k / top-p
    requests, which sort the vocabulary, at their first use)."""
    device = resolve_device(device, "device")
    dtype = resolve_dtype(dtype, device, "dtype")
    target = load_target(target_dir, device=device, dtype=dtype)
    check_max_model_len(max_model_len, getattr(target.config, "max_position_embeddings", None))
    drafter = load_drafter(drafter_dir, target) if drafter_dir is not None else None
    engine = Engine(target, drafter, num_speculative_tokens=num_speculative_tokens, max_batch_size=max_batch_size,
                    max_model_len=max_model_len, adaptive_verification=adaptive_verification,
                    draft_top_k=draft_top_k, graphs=False if enforce_eager else None, compile=compile,
                    overlap=async_scheduling)
    t0 = time.perf_counter()
    n = engine.warmup(modes=("greedy", "sample"), progress=True)
    if n:  # beside the progress bars: where a start's time went (a first start compiles and autotunes kernels)
        slowest = ", ".join(f"rows {k.rows} k {k.k} {k.mode} width {k.width} {s:.2f} s"
                            for s, k in engine.slowest_captures)
        print(f"warmup: {n} graphs in {time.perf_counter() - t0:.1f} s; the slowest step captures: {slowest}",
              file=sys.stderr, flush=True)
    return engine


# ---------------------------------------------------------------------------- the engine process
_CLOSE = ("close",)  # PipeSink's last message: not sent, it ends the sending thread
_MERGED = ("events", "snapshot", "promise")  # what PipeSink sends as one "events" message when queued back to back


class PipeSink:
    """The engine process's side of the pipe: a request's key is its id. Messages go out from a thread of its own,
    in order: the engine loop only queues them (pickling a step's events and the pipe's write, which wakes the
    server's reader, cost it tens of microseconds per step otherwise); the events queued meanwhile leave as one
    message, with the newest snapshot queued before them (the reader takes it first) and whether a snapshot was
    promised. A snapshot queued after events leaves in a message of its own: its pickling (a drafter's policy view
    makes it the larger part of a finished request's message) never delays the events it follows. wait_sent lets the
    engine loop hold back Python work (an idle engine's snapshot) until this thread has written what it queued: this
    thread needs the GIL to pickle, and the loop's pure-Python work would hold it for up to the switch interval."""

    detokenizes = True  # the server's process decodes the text (serve.runner.LoopSink)

    def __init__(self, conn):
        self.conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._send_all, name="dspark-pipe-send", daemon=True)
        self._thread.start()

    def open(self, req: Request) -> str:
        return req.id

    def deliver(self, items: list[tuple[str, Event]]) -> None:
        self.send(("events", items))

    def publish(self, snap: Snapshot) -> None:
        self.send(("snapshot", snap))

    def promise(self) -> None:
        """A snapshot follows the events queued next (the server's /metrics waits for it)."""
        self.send(("promise",))

    def send(self, msg) -> None:
        self._queue.put(msg)

    def wait_sent(self, timeout: float) -> bool:
        """Wait, at most timeout s, until the messages queued so far have been written to the pipe -> whether they
        have (a marker queued behind them, which the sending thread sets: nothing on the per-step path)."""
        done = threading.Event()
        self._queue.put(("sent", done))
        return done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, then stop the sending thread."""
        self._queue.put(_CLOSE)
        self._thread.join(timeout)

    def _send_all(self) -> None:
        taken = None  # a message taken from the queue behind a run of events, sent next
        while True:
            msg, taken = taken or self._queue.get(), None
            if msg is _CLOSE:
                return
            if msg[0] == "sent":  # wait_sent's marker: what was queued before it has been written
                msg[1].set()
                continue
            if msg[0] in _MERGED:  # with what is queued behind it, as one message, up to a snapshot after events
                items, snap, promised = [], None, False
                while True:
                    if msg[0] == "events":
                        items += [(rid, ev.wire()) for rid, ev in msg[1]]
                    elif msg[0] == "promise":
                        promised = True
                    else:
                        snap = msg[1]
                    if self._queue.empty():
                        break
                    msg = self._queue.get()
                    if msg is _CLOSE or msg[0] not in _MERGED or (msg[0] == "snapshot" and items):
                        taken = msg
                        break
                msg = ("events", items, snap, promised)
            try:
                self.conn.send(msg)
            except (OSError, ValueError):  # the server's process is gone
                return


def _answer(sink: PipeSink, kind: str, rid: str | None):
    """A future's done-callback that sends its outcome: (kind, rid, error) or ("profiled", files | error)."""
    def done(fut: concurrent.futures.Future) -> None:
        err = fut.exception()
        err = None if err is None else (type(err).__name__, str(err))
        sink.send(("added", rid, err) if kind == "added" else ("profiled", fut.result() if err is None else err))
    return done


class PipeRunner(EngineRunner):
    """The engine process's EngineRunner: its loop runs on the process's main thread and takes its commands from the
    pipe itself between steps (a thread reading the pipe and queueing for an engine thread would add a thread's
    wake-up and a turn on the GIL to every request's way in)."""

    def __init__(self, engine, conn, sink: PipeSink, profile_dir: str | None = None):
        super().__init__(engine, profile_dir=profile_dir)
        self.conn, self.sink = conn, sink
        self.publish, self.promise, self.sent = sink.publish, sink.promise, sink.wait_sent
        self._poller = select.poll()  # a registered poll: 0.3 us a look between steps (Connection.poll: 3 us)
        self._poller.register(conn.fileno(), select.POLLIN)

    def serve(self) -> None:
        """Run the engine loop here until the pipe closes or says "stop" (an engine that dies answers "dead")."""
        self._run()
        if self.error is not None:
            self.sink.send(("dead", self.error))

    def _next(self, block: bool):
        if not self._poller.poll(None if block else 0):  # (a closed pipe reads as ready: recv says EOF)
            return ...
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):  # the server's process is gone
            return None
        if msg[0] == "add":
            _, rid, ids, params = msg
            fut: concurrent.futures.Future = concurrent.futures.Future()
            fut.add_done_callback(_answer(self.sink, "added", rid))
            return AddCommand(ids, params, rid, self.sink, fut)
        if msg[0] == "abort":
            return msg
        if msg[0] == "profile":  # (the server's side asks only when profiling is on)
            fut = concurrent.futures.Future()
            fut.add_done_callback(_answer(self.sink, "profiled", None))
            return ProfileCommand(msg[1], fut)
        return None if msg[0] == "stop" else ...


def engine_main(conn, load: dict, profile_dir: str | None) -> None:
    """The engine process: build the engine, answer "ready", then serve the pipe until it closes or says "stop"."""
    sink = PipeSink(conn)
    try:
        engine = build_engine(**load)
        runner = PipeRunner(engine, conn, sink, profile_dir=profile_dir)
    except BaseException as e:  # noqa: BLE001 - the server reports it and exits
        sink.send(("failed", (type(e).__name__, str(e), traceback.format_exc())))
        sink.close()
        return
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    gc.collect()
    gc.freeze()  # what lives now lives as long as this process (serve.app.freeze_heap says why)
    sink.send(("ready", runner.info, runner.snapshot))
    try:
        runner.serve()
    finally:
        sink.close()
