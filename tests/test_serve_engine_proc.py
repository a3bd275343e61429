"""The engine in a process of its own (serve/engine_proc.py and serve/engine_client.py, `python -m serve
--engine-process`): the same answers as the engine in-process, metrics and profiles across the pipe, aborts, a failed
start and a dead engine process. Real tiny models, a spawned engine process on the CPU, uvicorn on 127.0.0.1."""
from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import threading
import time
from multiprocessing.connection import Connection

import httpx
import pytest

from dspark.checkpoint import load_drafter, load_target
from dspark.engine import Engine
from dspark.request import SamplingParams
from serve import EngineClient, ServerThread, free_port, load_server
from serve.__main__ import main as serve_main
from serve.engine_proc import PipeSink
from serve.runner import Event, Snapshot
from tests.targets import SERVE_MAX_LEN

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n", "for i in range(", "x = [1, 2", "while True:"]
TOKENS = 24


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    app = load_server(*models, max_model_len=SERVE_MAX_LEN, max_batch_size=4, device="cpu", engine_process=True,
                      profile_dir=str(tmp_path_factory.mktemp("profile")))
    with ServerThread(app) as srv:
        yield srv


def metrics(url: str) -> dict[str, float]:
    lines = httpx.get(url + "/metrics").text.splitlines()
    return {ln.split("{")[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines if ln and not ln.startswith("#")}


def wait_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    t0 = time.time()
    while True:
        m = metrics(url)
        if m["dspark:num_requests_running"] == 0 and m["dspark:cache_blocks_used"] == 0:
            return m
        assert time.time() - t0 < timeout, f"server not idle after {timeout} s: {m}"
        time.sleep(0.05)


def body(prompt: str, **kw) -> dict:
    return {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, **kw}


async def complete_all(url: str, payloads: list[dict]) -> list[str]:
    """Texts of concurrent completions (streaming ones joined from their SSE events)."""
    async def one(client: httpx.AsyncClient, p: dict) -> str:
        if not p.get("stream"):
            r = await client.post("/v1/completions", json=p)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        parts = []
        async with client.stream("POST", "/v1/completions", json=p) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    parts.append(json.loads(line[6:])["choices"][0]["text"])
        return "".join(parts)

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await asyncio.gather(*(one(client, p) for p in payloads))


def test_engine_process_serves_what_the_engine_generates(server, models):
    """Greedy texts through the engine process, concurrent, streamed and not, equal the engine's own in this
    process (CPU fp32: batch-invariant); the counters on /metrics come across the pipe."""
    target = load_target(models[0])
    ref = Engine(target, load_drafter(models[1], target), max_batch_size=4, max_model_len=SERVE_MAX_LEN).generate(
        PROMPTS, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    before = wait_idle(server.url)
    payloads = [body(p, stream=i % 2 == 0) for i, p in enumerate(PROMPTS)]
    texts = asyncio.run(complete_all(server.url, payloads))
    assert texts == [o.text for o in ref]
    # read at once: the snapshot promised after the last request's last event counts every token
    assert metrics(server.url)["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] \
        == TOKENS * len(PROMPTS)
    after = wait_idle(server.url)  # the idle engine's last snapshot is current
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == TOKENS * len(PROMPTS)
    assert after["vllm:spec_decode_num_draft_tokens_total"] > before["vllm:spec_decode_num_draft_tokens_total"]


def test_engine_process_texts_are_decoded_by_the_server_and_cut_by_stop_strings(server, models):
    """The engine process sends token ids and the server's process decodes them: streamed and whole texts equal
    the engine's own, also where a stop string cuts the text (the last event carries the cut text) and where a
    longer stop string never matches (its last characters are held back until the end, then sent)."""
    target = load_target(models[0])
    engine = Engine(target, load_drafter(models[1], target), max_batch_size=4, max_model_len=SERVE_MAX_LEN)
    full = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    stops = [[o.text[len(o.text) // 2: len(o.text) // 2 + 2]] for o in full]  # found mid-text: a cut
    stops[1].append("\x00never\x00")  # held back while it could match, never does
    want = [engine.generate([p], SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, stop=st))[0]
            for p, st in zip(PROMPTS, stops)]
    assert want[0].finish_reason == "stop" and len(want[0].text) < len(full[0].text)
    payloads = [body(p, stop=st, stream=stream) for p, st in zip(PROMPTS, stops) for stream in (False, True)]
    texts = asyncio.run(complete_all(server.url, payloads))
    assert texts == [w.text for w in want for _ in (0, 1)]


def test_abort_and_profile_cross_the_pipe(server):
    """A request aborted mid-stream ends with "abort" well before its max_tokens and frees its cache; the profile
    routes answer from the engine process (409 out of order, then the files written there)."""
    client: EngineClient = server.app.state.runner
    assert httpx.post(server.url + "/stop_profile").status_code == 409
    assert httpx.post(server.url + "/start_profile").json() == {"files": []}
    ids = client.tokenizer.encode("def f(x):", add_special_tokens=False)
    long = SamplingParams(max_tokens=SERVE_MAX_LEN - len(ids) - 16, temperature=0, ignore_eos=True)

    async def run():
        _, events = await client.submit(ids, long, "abort-me")
        first = await asyncio.wait_for(events.get(), 30)
        client.abort("abort-me")
        ev = first
        while ev.finish_reason is None:
            ev = await asyncio.wait_for(events.get(), 30)
        return first, ev

    first, last = asyncio.run(run())
    assert first.finish_reason is None and last.finish_reason == "abort"
    assert 0 < last.completion_tokens < long.max_tokens
    wait_idle(server.url)
    files = httpx.post(server.url + "/stop_profile", timeout=60).json()["files"]
    assert len(files) == 2 and "engine.launch" in open(files[0]).read()


def test_engine_process_start_failure_names_the_cause(models, tmp_path):
    """A drafter the engine process cannot load: the server's start fails with the engine's own error, the same
    one-line error an in-process start gives for bad input; any other failure with the engine's traceback."""
    bad = tmp_path / "drafter"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    load = dict(target_dir=str(models[0]), drafter_dir=str(bad), device="cpu", max_model_len=SERVE_MAX_LEN)
    with pytest.raises(ValueError, match=r"config\.json") as err:
        EngineClient(load)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineClient({**load, "drafter_dir": str(models[1]), "num_speculative_tokens": 9})
    with pytest.raises(RuntimeError, match=r"engine process failed to start(.|\n)*Traceback(.|\n)*TypeError"):
        EngineClient({**load, "drafter_dir": str(models[1]), "max_batch_size": "2"})


def test_dead_engine_process_fails_streams_and_answers_503(models):
    """The engine process killed mid-request: that stream ends with an error, /health and new requests are 503,
    and the server itself keeps answering."""
    app = load_server(*models, max_model_len=SERVE_MAX_LEN, max_batch_size=2, device="cpu", engine_process=True)
    with ServerThread(app) as srv:
        client: EngineClient = app.state.runner
        assert httpx.get(srv.url + "/health").status_code == 200
        ids = client.tokenizer.encode("import os\n", add_special_tokens=False)

        async def run():
            _, events = await client.submit(ids, SamplingParams(max_tokens=200, ignore_eos=True), "doomed")
            await asyncio.wait_for(events.get(), 30)
            client._proc.kill()
            ev = await asyncio.wait_for(events.get(), 30)
            while ev.finish_reason is None:
                ev = await asyncio.wait_for(events.get(), 30)
            return ev

        ev = asyncio.run(run())
        assert ev.finish_reason == "error" and "engine process" in ev.error
        assert httpx.get(srv.url + "/health").status_code == 503
        r = httpx.post(srv.url + "/v1/completions", json=body("x = 1"), timeout=30)
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
        assert httpx.get(srv.url + "/v1/models").status_code == 200


def test_cli_engine_process_flag(models, capsys):
    """`python -m serve --engine-process` on the CPU: the banner's facts come from the engine process."""
    argv = ["--target", str(models[0]), "--drafter", str(models[1]), "--dry-run", "--device", "cpu",
            "--max-model-len", str(SERVE_MAX_LEN), "--max-batch-size", "2", "--port", str(free_port())]
    assert serve_main(argv + ["--engine-process"]) == 0
    out = capsys.readouterr().out
    assert f"k=4, max_model_len={SERVE_MAX_LEN}, max_batch_size=2," in out and "engine_process=on" in out
    assert serve_main(argv + ["--engine-process", "--num-speculative-tokens", "9"]) == 2  # the child's bad input
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: num_speculative_tokens") and "\n" not in err


def test_events_cross_the_pipe_as_tuples_with_every_field():
    ev = Event([1, 2], "", "stop", prompt_tokens=5, completion_tokens=7, error="e", final_text="cut here")
    ours, theirs = mp.Pipe()
    sink = PipeSink(ours)
    sink.deliver([("r0", ev)])
    sink.close()
    kind, items, snap, promised = theirs.recv()
    assert kind == "events" and type(items[0][1]) is tuple and snap is None and promised is False
    assert items[0][0] == "r0" and Event(*items[0][1]) == ev


def gated_sink() -> tuple[threading.Event, Connection, PipeSink]:
    """A PipeSink over a real pipe whose writes wait for the gate -> (gate, the pipe's other end, the sink)."""
    ours, theirs = mp.Pipe()
    gate = threading.Event()

    class Gated:
        def send(self, msg):
            gate.wait(10)
            ours.send(msg)

    return gate, theirs, PipeSink(Gated())


def test_pipe_sink_sends_in_order_from_its_thread_and_merges_queued_events():
    """PipeSink: what the engine thread queues arrives in order; events queued back to back leave as one message
    (the items concatenated, nothing lost), with the newest snapshot queued ahead of them, which the reader takes
    first (no event is delivered before a snapshot queued ahead of it), and a promise of a snapshot among them; a
    snapshot queued after events leaves after them (it never delays them); close() sends what is still queued."""
    gate, theirs, sink = gated_sink()  # the real pipe, its first send held until the whole burst is queued
    for i in range(50):
        if i % 10 == 9:
            sink.promise()  # this step finished a request: a snapshot follows its events
        sink.deliver([(f"r{i}", Event([i], str(i)))])
        if i % 10 == 9:
            sink.publish(Snapshot({"step": i}))
    gate.set()
    sink.close()
    msgs, seen, snap, promises = 0, [], -1, []  # seen: (event, the snapshot the reader holds as it delivers it)
    while theirs.poll(1.0):
        kind, items, s, promised = theirs.recv()  # events cross as Event.wire() tuples
        msgs += 1
        assert kind == "events"
        snap = s.counters["step"] if s is not None else snap
        seen += [(rid, Event(*w).token_ids[0], snap) for rid, w in items]
        if promised:
            promises.append(seen[-1][1])  # the last event of the message that carries the promise
        # a snapshot comes in the message of the events queued after it, never of those queued before it
        assert s is None or not items or s.counters["step"] < Event(*items[0][1]).token_ids[0]
    assert 1 <= msgs < 50  # merged
    assert promises == [9, 19, 29, 39, 49]  # each with the events it was queued before
    assert [(rid, i) for rid, i, _ in seen] == [(f"r{i}", i) for i in range(50)]
    assert all(s >= (i // 10) * 10 - 1 for _, i, s in seen)  # never behind a snapshot queued before the event
    assert snap == 49  # the last snapshot arrives


def test_pipe_sink_wait_sent_returns_once_what_was_queued_is_written():
    """wait_sent (what an idle engine's snapshot waits for) times out while the pipe's write is held, and returns
    True once the queued events have crossed."""
    gate, theirs, sink = gated_sink()
    assert sink.wait_sent(0.01)  # nothing queued
    sink.deliver([("r0", Event([1], ""))])
    assert not sink.wait_sent(0.05)
    gate.set()
    assert sink.wait_sent(5) and theirs.poll(0)
    assert theirs.recv()[1][0][0] == "r0"
    sink.close()
