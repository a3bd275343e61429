"""The server's side of the engine process (serve.engine_proc: the process, and the pipe's messages): it starts the
process, hands it requests, reads its events and snapshots on a thread of its own and decodes their text, and
answers the routes as the in-process EngineRunner does."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing as mp
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from dspark.checkpoint import load_tokenizer
from dspark.request import IncrementalText, SamplingParams
from serve.engine_proc import START_ERRORS, START_TIMEOUT_S, engine_main
from serve.runner import EngineDead, EngineInfo, Event, LoopSink, Snapshot, TextDelta, kept_snapshot

log = logging.getLogger("serve.engine_client")

@dataclass
class _Stream:
    """A request's stream on the server's side: its event loop's sink and queue, and its text, decoded here from
    the token ids the engine process sends (vLLM's frontend detokenizes too: the engine's thread does not)."""
    sink: LoopSink
    events: asyncio.Queue
    detok: IncrementalText
    text: TextDelta
    ids: list[int] = field(default_factory=list)

    def fill(self, ev: Event) -> Event:
        """ev with its text delta: what the new tokens add (the whole text, on the last event, where stop strings
        may have cut it)."""
        self.ids += ev.token_ids
        text = ev.final_text if ev.final_text is not None else self.detok.text(self.ids)
        ev.text = self.text.delta(text, final=ev.finish_reason is not None)
        return ev


class EngineClient:
    """The server's handle on the engine process; what the routes use of EngineRunner (submit, abort, profile,
    alive, snapshot, info, tokenizer, stop). load: build_engine's arguments."""

    def __init__(self, load: dict, profile_dir: str | None = None, start_timeout: float = START_TIMEOUT_S):
        self.profiler = profile_dir  # truthy: the profile routes exist
        self.tokenizer = load_tokenizer(load["target_dir"])
        self.error: str | None = None
        self._stopping = False
        self._streams: dict[str, _Stream] = {}
        self._sinks: dict[asyncio.AbstractEventLoop, LoopSink] = {}
        self._adds: dict[str, concurrent.futures.Future] = {}
        self._profiles: deque[concurrent.futures.Future] = deque()
        self._lock = threading.Lock()
        ctx = mp.get_context("spawn")  # the child initialises CUDA itself
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=engine_main, args=(child, load, profile_dir), name="dspark-engine")
        self._proc.start()
        child.close()
        msg = self._first(start_timeout)
        if msg[0] != "ready":
            self._proc.join(10)
            kind, text, trace = msg[1] if isinstance(msg[1], tuple) else ("", msg[1], msg[1])
            if kind in START_ERRORS:  # bad input (a dir, a field): the one-line error the in-process server gives
                raise START_ERRORS[kind](text)
            raise RuntimeError(f"the engine process failed to start:\n{trace}")
        self.info: EngineInfo = msg[1]
        self.snapshot: Snapshot = msg[2]
        self._promised = self._kept = 0  # snapshots promised with events, and of those arrived (kept_snapshot)
        self._reader = threading.Thread(target=self._read, name="dspark-engine-pipe", daemon=True)
        self._reader.start()

    def _first(self, timeout: float):
        end = time.monotonic() + timeout
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                return ("failed", f"it exited with code {self._proc.exitcode}")
            if time.monotonic() > end:
                self._proc.kill()
                return ("failed", f"not ready within {timeout:.0f} s")
        try:
            return self._conn.recv()
        except EOFError:
            return ("failed", f"it exited with code {self._proc.join(10) or self._proc.exitcode}")

    @property
    def alive(self) -> bool:
        return self.error is None and self._proc.is_alive()

    def _send(self, msg) -> None:
        with self._lock:
            self._conn.send(msg)

    async def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str
                     ) -> tuple[None, asyncio.Queue]:
        """Hand a tokenized request to the engine process -> (None, its event queue); ValueError for a request the
        engine rejects, EngineDead when the engine is not running."""
        if not self.alive:
            raise EngineDead("the engine process is not running")
        loop = asyncio.get_running_loop()
        sink = self._sinks.get(loop) or self._sinks.setdefault(loop, LoopSink(loop))
        events: asyncio.Queue = asyncio.Queue()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._streams[request_id] = _Stream(sink, events, IncrementalText(self.tokenizer), TextDelta(params.stop))
        self._adds[request_id] = fut
        try:
            self._send(("add", request_id, prompt_ids, params))
        except (OSError, ValueError):
            self._drop(request_id)
            raise EngineDead("the engine process is not running") from None
        try:
            await asyncio.wrap_future(fut)
        except BaseException:
            self._drop(request_id)
            raise
        return None, events

    def _drop(self, rid: str) -> None:
        self._streams.pop(rid, None)
        self._adds.pop(rid, None)

    def abort(self, request_id: str) -> None:
        if self.alive:
            try:
                self._send(("abort", request_id))
            except (OSError, ValueError):
                pass

    async def fresh_snapshot(self) -> Snapshot:
        """The snapshot /metrics serves (kept_snapshot)."""
        return await kept_snapshot(self)

    async def profile(self, action: str) -> list[str]:
        if not self.profiler:
            raise RuntimeError("profiling is off: start the server with --profile-dir (or VLLM_TORCH_PROFILER_DIR)")
        if not self.alive:
            raise EngineDead("the engine process is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._profiles.append(fut)
        self._send(("profile", action))
        return await asyncio.wrap_future(fut)

    # ------------------------------------------------------------------ the pipe's reader thread
    def _read(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                if msg[0] == "events":
                    if msg[2] is not None:  # made after every promise the reader has seen
                        self.snapshot, self._kept = msg[2], self._promised
                    if msg[3]:  # before the events, so that their client's /metrics waits for the snapshot
                        self._promised += 1
                    if msg[1]:
                        self._deliver([(rid, Event(*ev)) for rid, ev in msg[1]])
                elif msg[0] == "added":
                    self._added(msg[1], msg[2])
                elif msg[0] == "profiled" and self._profiles:
                    fut, out = self._profiles.popleft(), msg[1]
                    if isinstance(out, tuple):
                        fut.set_exception(EngineDead(out[1]) if out[0] == "EngineDead" else RuntimeError(out[1]))
                    else:
                        fut.set_result(out)
                elif msg[0] == "dead":
                    self.error = msg[1]
                    break
        except (EOFError, OSError):
            pass
        self.error = self.error or f"the engine process exited (code {self._proc.exitcode})"
        if not self._stopping:
            log.error("engine process: %s", self.error)
        for fut in [*self._adds.values(), *self._profiles]:
            if not fut.done():
                fut.set_exception(EngineDead(self.error))
        self._deliver([(rid, Event([], "", "error", error=self.error)) for rid in list(self._streams)])

    def _added(self, rid: str, err) -> None:
        fut = self._adds.pop(rid, None)
        if fut is None or fut.done():
            return
        if err is None:
            fut.set_result(None)
        else:
            kind, text = err
            fut.set_exception(ValueError(text) if kind == "ValueError" else EngineDead(text)
                              if kind == "EngineDead" else RuntimeError(text))

    def _deliver(self, items: list[tuple[str, Event]]) -> None:
        """A step's events into their requests' queues: one delivery per event loop."""
        by_sink: dict[LoopSink, list[tuple[asyncio.Queue, Event]]] = {}
        for rid, ev in items:
            s = self._streams.get(rid)
            if ev.finish_reason is not None:
                self._streams.pop(rid, None)
            if s is not None:
                by_sink.setdefault(s.sink, []).append((s.events, s.fill(ev)))
        for sink, evs in by_sink.items():
            sink.deliver(evs)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._proc.is_alive():
            try:
                self._send(("stop",))
            except (OSError, ValueError):
                pass
            self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout)
        self._conn.close()
