"""The OpenAI-compatible server end to end: a tiny random Qwen3 target + real BPE tokenizer + random DSpark drafter,
uvicorn on 127.0.0.1 in a thread, driven by the official `openai` client (and httpx for raw SSE / disconnects)."""
from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest
import torch

from dspark.policy import WEIGHED
from dspark.runner import TIME_EVERY
from serve import ServerThread, free_port, load_server
from serve.__main__ import main as serve_main
from serve.__main__ import step_times
from serve.runner import EngineInfo
from tests.targets import SERVE_MAX_LEN

MAX_LEN = SERVE_MAX_LEN
@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    app = load_server(*models, max_model_len=MAX_LEN, max_batch_size=8, max_concurrent=64,
                      profile_dir=str(tmp_path_factory.mktemp("profile")))
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def metrics(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, val = line.rsplit(" ", 1)
            pos = re.search(r'(?:position|k)="(\d+)"', name)
            out[name.split("{")[0] + (f"[{pos.group(1)}]" if pos else "")] = float(val)
    return out


def wait_idle(server, timeout=15.0) -> dict[str, float]:
    t0 = time.time()
    while True:
        m = metrics(server)
        if m["dspark:num_requests_running"] == 0 and m["dspark:cache_blocks_used"] == 0:
            return m
        if time.time() - t0 > timeout:
            raise AssertionError(f"server not idle after {timeout} s: {m}")
        time.sleep(0.05)


@pytest.fixture
def slow_engine(server, monkeypatch):
    """10 ms per engine step, so a 240-token request surely outlives the client in the disconnect tests."""
    eng = server.app.state.runner.engine
    step = eng.step
    monkeypatch.setattr(eng, "step", lambda: (time.sleep(0.01), step())[1])
    yield
    wait_idle(server)


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def test_models_and_completion(server, client, models):
    assert [m.id for m in client.models.list().data] == ["tiny-target"]
    r = client.completions.create(model="tiny-target", prompt="def foo(x):", max_tokens=24, **GREEDY)
    tok = server.app.state.runner.engine.tokenizer
    assert r.usage.prompt_tokens == len(tok.encode("def foo(x):", add_special_tokens=False))
    assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
    out = next(o for o in server.app.state.runner.recent if o.request_id == r.id)
    assert r.choices[0].text == tok.decode(out.token_ids, skip_special_tokens=True) and len(out.token_ids) == 24
    # the same prompt as token ids gives the same greedy output
    ids = tok.encode("def foo(x):", add_special_tokens=False)
    r2 = client.completions.create(model="tiny-target", prompt=ids, max_tokens=24, **GREEDY)
    assert r2.choices[0].text == r.choices[0].text


def test_stream_equals_nonstream(server, client):
    kw = dict(model="tiny-target", prompt="class A:\n    def", max_tokens=30, **GREEDY)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 30
    msgs = [{"role": "user", "content": "write a sort"}]
    chat = client.chat.completions.create(model="tiny-target", messages=msgs, max_tokens=20, **GREEDY)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 20
    tok = server.app.state.runner.engine.tokenizer
    templ = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert templ.endswith("<|im_start|>assistant\n")
    assert chat.usage.prompt_tokens == len(tok.encode(templ, add_special_tokens=False))
    parts = list(client.chat.completions.create(model="tiny-target", messages=msgs, max_tokens=20, stream=True,
                                                **GREEDY))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content
    # raw SSE framing: data lines only, ending with [DONE]
    with httpx.stream("POST", server.url + "/v1/completions", json={"model": "tiny-target", "prompt": kw["prompt"],
                                                                   "max_tokens": 30, "stream": True, "temperature": 0,
                                                                   "ignore_eos": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in resp.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    assert "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1]) == full


def test_stop_strings(client):
    kw = dict(model="tiny-target", prompt="import os\n", max_tokens=40, **GREEDY)
    full = client.completions.create(**kw).choices[0].text
    i = next(i for i in range(4, len(full) - 2) if "\ufffd" not in full[i: i + 2] and full[i: i + 2].strip())
    stop = full[i: i + 2]
    want = full[: full.find(stop)]
    r = client.completions.create(stop=[stop, "never-appears-xyz"], **kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kw))
    assert streamed == want


def test_bad_requests(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=4)
    assert "no-such-model" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-target", prompt="x", max_tokens=-3)
    assert e.value.status_code == 400 and "max_tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-target", prompt="x = 1\n" * 200, max_tokens=16)
    assert f"context length {MAX_LEN}" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-target", messages=[{"role": "user", "content": "x"}],
                                       temperature=-1)
    assert "temperature" in e.value.body["message"]
    url = server.url + "/v1/completions"
    for body, needle in [({"prompt": "x", "n": 2}, "n"), ({"prompt": "x", "echo": True}, "echo"),
                         ({"max_tokens": 3}, "prompt"), ({"prompt": [1, 99999]}, "token ids")]:
        r = httpx.post(url, json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}
    r = httpx.post(url, content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    wait_idle(server)  # rejected requests hold nothing


def test_profile_window_writes_the_engine_threads_tables_and_trace(server, client):
    """vLLM's POST /start_profile and /stop_profile: the engine thread's torch.profiler window, its counters over
    the window, the engine's named phases in the host-time table, and a Chrome trace; a window out of order is a
    409 that names the other route."""
    url = server.url
    r = httpx.post(url + "/stop_profile")
    assert r.status_code == 409 and "/start_profile" in r.json()["error"]["message"]
    assert httpx.post(url + "/start_profile").json() == {"files": []}
    r = httpx.post(url + "/start_profile")
    assert r.status_code == 409 and "/stop_profile" in r.json()["error"]["message"]
    ids = [client.completions.create(model="tiny-target", prompt=p, max_tokens=12, **GREEDY).id
           for p in ["def f(a):", "import os"]]
    wait_idle(server)
    files = httpx.post(url + "/stop_profile", timeout=60).json()["files"]
    txt, trace = (open(f).read() for f in files)
    counters = json.loads(re.search(r"engine counters over the window: (\{.*\})", txt).group(1))
    outs = [o for o in server.app.state.runner.recent if o.request_id in ids]
    assert sum(counters["decode_steps_per_k"]) == sum(o.num_steps for o in outs) > 0
    assert counters["generation_tokens"] == 24 and counters["step_s"] > 0
    assert all(name in txt for name in ("engine.prefill", "engine.launch", "engine.read"))
    assert json.loads(trace)["traceEvents"]
    assert httpx.post(url + "/start_profile").status_code == 200  # a second window, then closed again
    assert httpx.post(url + "/stop_profile", timeout=60).json()["files"][0].endswith("engine-profile-2.txt")


def test_metrics_agree_with_requests(server, client):
    # what the k policy's choices to draft weighed, per k: on CPU it drafts the whole block without weighing, so a
    # k's sums are set here (the engine thread's snapshots after the requests' steps carry them)
    server.app.state.runner.engine.policy.weighed.setdefault(2, dict(zip(WEIGHED, (3, 0.36, 0.75, 4.5, 30, 0.33, 12))))
    before = metrics(server)
    ids = [client.completions.create(model="tiny-target", prompt=p, max_tokens=32, **GREEDY).id
           for p in ["for i in range(", "while True:", "x = [1, 2"]]
    after = wait_idle(server)
    outs = [o for o in server.app.state.runner.recent if o.request_id in ids]
    assert len(outs) == 3
    d = {k: after[k] - before.get(k, 0.0) for k in after}  # a counter with new labels starts at 0
    # a step that verified 0 drafts (the max_tokens budget ran out) is not a draft, as in vLLM
    assert d["vllm:spec_decode_num_drafts_total"] == sum(sum(n > 0 for n in o.num_drafts_per_step) for o in outs) > 0
    assert d["vllm:spec_decode_num_draft_tokens_total"] == sum(sum(o.num_drafts_per_step) for o in outs)
    assert d["vllm:spec_decode_num_accepted_tokens_total"] == sum(sum(o.accepted_per_step) for o in outs)
    for pos in range(4):
        assert d[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{pos}]"] == sum(
            sum(a > pos for a in o.accepted_per_step) for o in outs)
    assert d["vllm:generation_tokens_total"] == 96
    assert d["vllm:prompt_tokens_total"] == sum(len(o.prompt_token_ids) for o in outs)
    eng = server.app.state.runner.engine
    assert after["dspark:cache_blocks_free"] == eng.cache.pool.num_blocks
    # what the k policy weighs: its acceptance estimates per group and position, as the engine's policy holds them
    text, p = httpx.get(server.url + "/metrics").text, eng.policy
    for g in ("greedy", "sampled"):
        shown = [float(re.search(rf'dspark:policy_acceptance{{[^}}]*group="{g}",position="{j}"}} (\S+)', text)[1])
                 for j in range(eng.k)]
        assert shown == pytest.approx(p.acceptance(p.accepted[g], p.reached[g]))
    assert p.reached["greedy"][0] > 0
    # and the choices it made: the counter per (rows, k, mode, basis) as the engine's policy counts them
    shown = {m.groups()[:4]: float(m[5]) for m in re.finditer(
        r'dspark:policy_choices_total{[^}]*rows="(\d+)",k="(\d+)",mode="(\w+)",basis="(\w+)"} (\S+)', text)}
    assert shown and shown == {(str(r), str(k), m, b): n for (r, k, m, b), n in p.choices_made.items()}
    # and per k what its choices to draft weighed
    shown = {m.groups()[:2]: float(m[3]) for m in re.finditer(
        r'dspark:policy_draft_weighed_total{[^}]*k="(\d+)",what="(\w+)"} (\S+)', text)}
    assert shown and shown == {(str(k), w): v for k, ws in p.weighed.items() for w, v in ws.items()}
    # one row per step here; on CPU (no step times, so no k policy) each drafts the whole block
    steps = [d[f"dspark:decode_steps_total[{k}]"] for k in range(eng.k + 1)]
    assert sum(steps) == sum(len(o.num_drafts_per_step) for o in outs)
    if not eng.runner.graphs:
        assert steps[eng.k] == sum(steps)
    # the per-k step timing: only back-to-back graph steps (none on CPU, where steps run eagerly)
    cycles = [d[f"dspark:step_cycles_total[{k}]"] for k in range(eng.k + 1)]
    assert sum(cycles) <= sum(steps) and (sum(cycles) > 0) == eng.runner.graphs
    assert all((d[f"dspark:step_cycle_ms_total[{k}]"] > 0) == (n > 0) for k, n in enumerate(cycles))
    # of those the first timed steps of each run of a kind (the engine's own counts)
    early = [d[f"dspark:step_early_cycles_total[{k}]"] for k in range(eng.k + 1)]
    assert early == eng.policy.early_cycles and all(e <= n for e, n in zip(early, cycles))
    # graph steps timed on the device: every TIME_EVERY-th launch (none on CPU); the engine thread's time holds its
    # step()'s, which holds its waits for the device
    timed = [d[f"dspark:step_device_timed_total[{k}]"] for k in range(eng.k + 1)]
    if eng.runner.graphs:
        assert all(t <= n for t, n in zip(timed, steps))
        assert sum(steps) // TIME_EVERY <= sum(timed) <= -(-sum(steps) // TIME_EVERY)
    else:
        assert sum(timed) == 0
    assert all((d[f"dspark:step_device_ms_total[{k}]"] > 0) == (n > 0) for k, n in enumerate(timed))
    loop, step = d["dspark:engine_loop_seconds_total"], d["dspark:engine_step_seconds_total"]
    waits = d["dspark:step_read_wait_seconds_total"] + d["dspark:step_launch_wait_seconds_total"]
    assert loop >= step > waits >= 0
    # time to first token: one sample per request, split into the wait for admission and the prefill
    ttft = "vllm:time_to_first_token_seconds"
    assert d[f"{ttft}_count"] == d[f"{ttft}_bucket"] == d["vllm:request_queue_time_seconds_count"] == 3
    queue, prefill = d["vllm:request_queue_time_seconds_sum"], d["vllm:request_prefill_time_seconds_sum"]
    assert queue >= 0 and prefill > 0 and abs(queue + prefill - d[f"{ttft}_sum"]) < 1e-6


def test_disconnect_aborts_and_frees_cache(server, slow_engine):
    idle = wait_idle(server)
    body = {"model": "tiny-target", "prompt": "def main():", "max_tokens": 240, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()  # keep it referenced: a closed httpx line iterator closes the connection
        first = [ln for ln in (next(lines) for _ in range(6)) if ln]
        rid = json.loads(first[0][6:])["id"]
        m = metrics(server)
        assert m["dspark:num_requests_running"] == 1 and m["dspark:cache_blocks_used"] > 0
        time.sleep(0.1)  # still running while the client stays connected without reading
        assert metrics(server)["dspark:num_requests_running"] == 1
    after = wait_idle(server)  # closing the connection aborted the request
    assert after["dspark:cache_blocks_free"] == idle["dspark:cache_blocks_free"]
    out = next(o for o in server.app.state.runner.recent if o.request_id == rid)
    assert out.finish_reason == "abort" and len(out.token_ids) < 240


def test_nonstream_disconnect_aborts(server, slow_engine):
    cfg = server.app.state.cfg
    cfg.disconnect_poll_s = 0.05
    n_before = len(server.app.state.runner.recent)
    body = {"model": "tiny-target", "prompt": "def f():", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    try:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.1))
        wait_idle(server)
    finally:
        cfg.disconnect_poll_s = 0.5
    out = list(server.app.state.runner.recent)[n_before:]
    assert len(out) == 1 and out[0].finish_reason == "abort" and len(out[0].token_ids) < 240


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="tiny-target", prompt="def f(x):", max_tokens=24, temperature=0.9, top_p=0.95, seed=1234,
              extra_body={"ignore_eos": True, "top_k": 50})
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b
    others = {client.completions.create(**{**kw, "seed": s}).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a}) > 1  # the seed matters


def test_engine_error_is_500_and_server_survives(server, client, monkeypatch, caplog):
    eng = server.app.state.runner.engine
    launch, calls = eng._launch, []

    def broken(*a, **kw):  # the engine's own except-path finishes the batch with "error" and re-raises
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom in decode")
        return launch(*a, **kw)

    monkeypatch.setattr(eng, "_launch", broken)
    with caplog.at_level("ERROR", logger="serve"), pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="tiny-target", prompt="def f():", max_tokens=8, temperature=0)
    msg = e.value.body["message"]
    rid = re.search(r"request id (cmpl-[0-9a-f]+)", msg).group(1)
    assert "boom" not in msg and "RuntimeError" not in msg  # the details go to the server log only
    assert any(rid in r.getMessage() and "boom in decode" in r.getMessage() for r in caplog.records)
    wait_idle(server)
    assert client.completions.create(model="tiny-target", prompt="def f():", max_tokens=8,
                                     **GREEDY).usage.completion_tokens == 8
    assert httpx.get(server.url + "/health").status_code == 200


def test_concurrency_limit_429(server, slow_engine):
    cfg = server.app.state.cfg
    cfg.max_concurrent = 2
    body = {"model": "tiny-target", "prompt": "x", "max_tokens": 240, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as h:
            streams = [h.stream("POST", "/v1/completions", json=body) for _ in range(2)]
            lines = [s.__enter__().iter_lines() for s in streams]  # kept referenced: connections stay open
            for it in lines:  # both admitted and streaming
                assert next(it).startswith("data: {")
            c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.RateLimitError) as e:
                c.completions.create(model="tiny-target", prompt="x", max_tokens=4)
            assert e.value.status_code == 429 and "at most 2" in e.value.body["message"]
            for s in streams:
                s.__exit__(None, None, None)
        wait_idle(server)
        assert c.completions.create(model="tiny-target", prompt="x", max_tokens=4).usage.completion_tokens >= 1
    finally:
        cfg.max_concurrent = 64


def test_cli_bad_dirs(tmp_path, capsys, models):
    assert serve_main(["--target", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --target") and "\n" not in err
    assert serve_main(["--target", str(models[0]), "--drafter", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err
    assert serve_main(["--target", str(models[0]), "--drafter", str(models[1]), "--dry-run", "--port", str(free_port()),
                       "--max-model-len", str(MAX_LEN), "--num-speculative-tokens", "9"]) == 2
    assert "num_speculative_tokens" in capsys.readouterr().err


def test_cli_checks_every_option_before_loading(tmp_path, capsys, models, monkeypatch):
    import socket

    import serve.__main__ as cli

    def no_load(*a, **k):
        raise AssertionError("the models were loaded before the options were checked")

    monkeypatch.setattr(cli, "load_server", no_load)
    base = ["--target", str(models[0]), "--drafter", str(models[1]), "--dry-run"]
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    cases = [(["--dtype", "float8"], ["--dtype", "float8"]), (["--device", "tpu"], ["--device", "cuda:N"]),
             (["--port", "99999"], ["--port", "1..65535"]), (["--port", str(busy.getsockname()[1])], ["in use"]),
             (["--max-model-len", "100000"], ["--max-model-len", f"max_position_embeddings {MAX_LEN}"]),
             (["--max-concurrent", "0"], ["--max-concurrent", ">= 1"]), (["--max-batch-size", "0"], ["--max-batch-size"]),
             (["--max-prompt-bytes", "0"], ["--max-prompt-bytes"]), (["--num-speculative-tokens", "0"], ["--num-spec"]),
             (["--api-key", " "], ["--api-key"]), (["--max-batch-size", "x"], ["--max-batch-size"])]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], ["--device cuda", "no CUDA device"]))
    try:
        for extra, needles in cases:
            assert serve_main(base + extra) == 2, extra
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and err.startswith("error: ") and all(n in err for n in needles), err
    finally:
        busy.close()


@pytest.mark.timeout(900)  # on a GPU each dry run captures its step graphs, and the --compile one compiles them
def test_cli_defaults_and_host_warning(models, capsys, caplog):
    from dspark.device import resolve_dtype
    from serve.__main__ import parse_args

    a = parse_args(["--target", str(models[0])])
    assert (a.device, a.dtype) == ("auto", "auto")
    assert resolve_dtype("auto", "cuda") == "bfloat16" and resolve_dtype("auto", "cpu") == "float32"
    # one batch slot: on a GPU each dry run captures every step graph of its batch buckets
    base = ["--target", str(models[0]), "--drafter", str(models[1]), "--dry-run", "--max-model-len", str(MAX_LEN),
            "--max-batch-size", "1"]
    with caplog.at_level("WARNING", logger="serve"):
        assert serve_main(base + ["--host", "0.0.0.0", "--port", "0"]) == 2  # port 0 is not a port to serve on
        assert serve_main(base + ["--host", "0.0.0.0", "--port", str(free_port())]) == 0
    assert [r.getMessage() for r in caplog.records if "without --api-key" in r.getMessage()]
    want = "(cuda, bfloat16," if torch.cuda.is_available() else "(cpu, float32,"
    out = capsys.readouterr().out
    assert want in out  # and the engine in a process of its own by default on a GPU only
    assert f"engine_process={'on' if torch.cuda.is_available() else 'off'}" in out
    caplog.clear()
    with caplog.at_level("WARNING", logger="serve"):
        assert serve_main(base + ["--host", "0.0.0.0", "--port", str(free_port()), "--api-key", "k"]) == 0
        assert serve_main(base + ["--host", "127.0.0.1", "--port", str(free_port())]) == 0
    assert not [r for r in caplog.records if "without --api-key" in r.getMessage()]
    capsys.readouterr()
    graphs = "on" if torch.cuda.is_available() else "off"  # CUDA graphs by default where there is a GPU
    assert serve_main(base + ["--port", str(free_port()), "--compile"]) == 0
    assert f"graphs={graphs}, compiled=on, async_scheduling={graphs}" in capsys.readouterr().out
    assert serve_main(base + ["--port", str(free_port()), "--enforce-eager", "--async-scheduling"]) == 0
    assert "graphs=off, compiled=off, async_scheduling=on" in capsys.readouterr().out


def test_banner_shows_the_k_policys_step_times(server, monkeypatch):
    """The banner's view of the k policy: each candidate k's graph replay time at one row (graphs only)."""
    eng = server.app.state.runner.engine
    if not eng.runner.graphs:
        assert step_times(EngineInfo.of(eng)) == ""  # CPU: no graphs, no step times
    monkeypatch.setattr(eng.runner, "step_ms", lambda key: 0.1 * (key.k + 1))  # what replay timing gives on a GPU
    assert step_times(EngineInfo.of(eng)) == ", step ms at 1 row: " + " ".join(
        f"k={k} {0.1 * (k + 1):.3f}" for k in eng.policy.choices)


def test_short_prompts_are_tokenized_on_the_event_loop_long_ones_in_the_pool(server, client, monkeypatch):
    """A prompt up to inline_tokenize_bytes is tokenized where the request is handled (a hop to a tokenizer thread
    would cost more), a longer one in the tokenizer pool; the same prompt gives the same greedy text either way."""
    tok, threads = server.app.state.runner.tokenizer, []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a, **kw: (threads.append(threading.current_thread().name),
                                                         encode(*a, **kw))[1])
    texts = []
    for limit in (8, 4):  # the prompt's 6 bytes: on the event loop, then in the pool
        monkeypatch.setattr(server.app.state.cfg, "inline_tokenize_bytes", limit)
        texts.append(client.completions.create(model="tiny-target", prompt="def f(", max_tokens=8,
                                               **GREEDY).choices[0].text)
    assert not threads[0].startswith("dspark-tokenize") and threads[1].startswith("dspark-tokenize")
    assert texts[0] == texts[1] and texts[0]
