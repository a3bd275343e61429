"""Host time per decode step of dspark.Engine at large batches: the engine's Python around the device step.

    python bench/host_step.py [--rows 512] [--prompts 4096] [--new-tokens 16] [--repeats 3] [--no-forward]

A tiny random Qwen3 target (the model costs little, so the host's share shows) continues --prompts prompts of 32-199
tokens through one Engine.generate call, AR, --rows at a time (continuous batching; the regeneration of a drafter's
training data is this call with 32768 prompts and 512 rows). Host time per decode step = the wall time of the
generate call minus the runner's forwards (its step function and its prefill forward; on a GPU these are graph
replays), over the decode steps: admission, the step's inputs, the read-back's unpacking, stop handling and emitting,
which Python does for every row. Reported: the median over --repeats runs, and the generate call's wall time.
--no-forward replaces the runner's step with a fixed output ([a=0, n=0, token 5] per row), so nothing but the engine's
Python runs and the host time is the generate call's wall time over its decode steps. --drafts K adds a tiny DSpark
drafter whose k policy drafts K tokens on every step (with --no-forward none is accepted: each step emits one token);
--drafts 0 decodes plainly on every step (what a GPU server does where drafting does not pay, as at T = 0.7), so
their host time per step compares with AR's; --mixed-context (with --drafts 0) samples at T = 0.7 and leaves to the k
policy which requests keep the drafter's context, as where its probes find plain decoding best for sampled rows (one
in CONTEXT_EVERY x running): the plain steps then mix the AR step and the stashing one, as a T = 0.7 server's do
(--temperature 0.7 gives AR the same requests); --accept (with --no-forward) accepts every draft, so each step emits
K + 1 tokens per row, as a drafting step that pays does. --overlap runs the engine's async scheduling as on
a GPU: each step is queued before the one before it is read, its inputs chained from that step's output (with a
fixed output, the host path of a server's step at one row). --graph-buckets keys the steps as CUDA graphs do (their
context buckets; nothing is captured), so the steps that stage their inputs anew (reported) are a GPU's. --server runs
the same requests through the engine process's loop (serve.engine_proc.PipeRunner: its commands read from a pipe,
each step's events sent back through serve.engine_proc.PipeSink, the pipe's other end read by a thread here), as
`python -m serve` on a GPU does: its host time per step is the loop's busy time (loop_s: steps and delivery) less the
runner's forwards.
"""
from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark.engine import Engine  # noqa: E402
from dspark.models.drafter import DrafterConfig, DSparkDrafter  # noqa: E402
from dspark.models.qwen3 import Qwen3ForCausalLM, qwen3_config  # noqa: E402
from dspark.policy import PROBE_EVERY  # noqa: E402
from dspark.request import SamplingParams  # noqa: E402
from serve.engine_proc import PipeRunner, PipeSink  # noqa: E402
from serve.runner import Event  # noqa: E402

VOCAB = 300


def timed(obj, name: str, total: list[float]):
    """Wrap obj.name so that its wall time adds to total[0]."""
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            total[0] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


def fixed_step(outs: dict, accept: bool = False):
    """A runner step that returns [a=0, n=0, token 5] per row (one tensor per step key) and computes nothing; accept:
    [a=k, n=k, token 5 x (k + 1)], every draft accepted (a drafting step's k + 1 tokens per row)."""
    def step(st):
        out = outs.get(st.key)
        if out is None:
            k = st.key.k
            out = outs[st.key] = torch.full((st.key.rows, k + 3), 5, dtype=torch.long)
            out[:, :2] = k if accept else 0
        return out
    return step


def tiny_drafter(target: Qwen3ForCausalLM) -> DSparkDrafter:
    """A tiny DSpark drafter (block 4, Markov rank 8) on the target's embedding and LM head."""
    c = target.config
    cfg = DrafterConfig(vocab_size=VOCAB, hidden_size=c.hidden_size, target_hidden_size=c.hidden_size,
                        target_layer_ids=[0, c.num_hidden_layers - 1], num_target_layers=c.num_hidden_layers,
                        mask_token_id=1, block_size=4, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=96, markov_rank=8)
    return DSparkDrafter(cfg, target.model.embed_tokens.weight, target.lm_head.weight).eval()


def serve_all(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> float:
    """The prompts through the engine process's loop (PipeRunner, on a thread here) from the pipe's other end, its
    events back through its PipeSink, until every request has sent its last event -> the loop's busy seconds
    (loop_s)."""
    left, failed, done = [len(prompts)], [], threading.Event()
    ours, theirs = mp.Pipe()

    def read():  # the server process's side: every message, counting the requests that ended
        while not done.is_set():
            msg = ours.recv()
            if msg[0] == "events":
                ended = [ev for ev in (Event(*w) for _, w in msg[1]) if ev.finish_reason is not None]
                failed.extend(ev.error for ev in ended if ev.finish_reason == "error")
                left[0] -= len(ended)
                if left[0] <= 0:
                    done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sink = PipeSink(theirs)
    runner = PipeRunner(engine, theirs, sink)
    loop = threading.Thread(target=runner.serve, daemon=True)
    for i, p in enumerate(prompts):  # each read from the pipe and admitted before the loop starts: the same batches
        ours.send(("add", f"r{i}", p, params))  # as generate (all sent first, they would fill the pipe's buffer)
        runner._handle(runner._next(block=True))
    loop.start()
    try:
        while not done.wait(1.0):
            if not loop.is_alive() or not reader.is_alive():
                raise RuntimeError(f"the engine loop or the pipe's reader stopped with {left[0]} requests open "
                                   f"({runner.error or 'reader'})")
    finally:
        ours.send(("stop",))
        loop.join(10)
        sink.close()
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed in the engine loop: {failed[0]}")
    return runner.loop_s


def run(rows: int, num_prompts: int, new_tokens: int, seed: int, forward: bool = True, drafts: int | None = None,
        overlap: bool = False, server: bool = False, accept: bool = False, context: bool = True,
        graph_buckets: bool = False, mixed: bool = False, temperature: float | None = None, switch_every: int = 0
        ) -> tuple[float, float, int, float]:
    """-> (host ms per decode step, the generate call's wall seconds, decode steps, the share of them whose inputs
    were staged anew). drafts: with a drafter whose policy drafts that many tokens every step (0: decodes plainly);
    server: through the engine process's loop (module doc); context=False: no request keeps the drafter's context;
    mixed: sampled requests, the policy's choice of which keep it (module doc); graph_buckets: step keys of the
    context buckets CUDA graphs use (powers of 2; nothing is captured); switch_every: k alternates between drafts
    and 0 every this many decode steps (each change of k a step of another kind, its inputs staged anew)."""
    torch.manual_seed(seed)
    cfg = qwen3_config(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=128, max_position_embeddings=512)
    target = Qwen3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(32, 200, (num_prompts,), generator=g).tolist()
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lens]
    engine = Engine(target, tiny_drafter(target) if drafts is not None else None, max_batch_size=rows,
                    max_model_len=512, prefill_chunk=512, overlap=overlap)
    if drafts is not None:
        picks = itertools.count()
        engine.policy.choose = lambda *a, **k: drafts if not switch_every or next(picks) // switch_every % 2 == 0 \
            else 0
        if mixed:  # as after probes that found plain decoding best for sampled rows
            engine.policy.probe_every["sampled"] = 2 * PROBE_EVERY
        else:
            engine.policy.context_for = lambda *a, **k: context
    if not forward:
        engine.runner._run = fixed_step({}, accept)
    if graph_buckets:
        graph_keys(engine.runner)
    engine.generate(prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True))  # first-call costs
    forwards, kept = [0.0], engine.runner.inputs_kept
    timed(engine.runner, "_run", forwards)
    timed(engine.runner, "_prefill_fn", forwards)
    if engine.runner.drafts is not None:  # a context flush's forward (eager here; a GPU replays its graph)
        timed(engine.runner.drafts, "flush_context", forwards)
    steps = engine.counters["decode_steps_per_k"]
    steps[:] = [0] * len(steps)
    if temperature is None:  # mixed: sampled requests, as where probes find plain decoding best for them
        temperature = 0.7 if mixed else 0.0
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=temperature)
    t0 = time.perf_counter()
    if server:
        busy = serve_all(engine, prompts, params)
    else:
        engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    n = sum(steps)
    staged = n - (engine.runner.inputs_kept - kept)  # each decode step's launch kept its inputs or staged them
    return ((busy if server else wall) - forwards[0]) / n * 1e3, wall, n, staged / n


def graph_keys(runner) -> None:
    """Make the runner's step keys those of CUDA graphs (their context buckets: powers of 2) without capturing: which
    steps stage their inputs anew then follows the block tables, as on a GPU (eager keys change with every block)."""
    key_for = runner.key_for

    def bucketed(*a, **kw):
        runner.graphs = True
        try:
            return key_for(*a, **kw)
        finally:
            runner.graphs = False

    runner.key_for = bucketed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--prompts", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-forward", action="store_true", help="a fixed output for every step: the engine's Python alone")
    p.add_argument("--drafts", type=int, help="a drafter whose k policy drafts this many tokens (0-3) every step")
    p.add_argument("--accept", action="store_true", help="with --no-forward: every draft accepted (k + 1 tokens per "
                   "step and row, as a drafting step that pays emits)")
    p.add_argument("--no-context", action="store_true", help="with --drafts 0: no request keeps the drafter's context "
                   "(every step the AR engine's step inside the DSpark engine)")
    p.add_argument("--mixed-context", action="store_true", help="with --drafts 0: sampled requests, the k policy "
                   "choosing which keep the drafter's context (one in CONTEXT_EVERY x running; module doc)")
    p.add_argument("--temperature", type=float, help="the requests' sampling temperature (default 0.7 with "
                   "--mixed-context, else 0: greedy)")
    p.add_argument("--overlap", action="store_true", help="async scheduling (each step queued before the last is read)")
    p.add_argument("--server", action="store_true", help="through the engine process's loop, driven over a pipe")
    p.add_argument("--switch-every", type=int, default=0, help="with --drafts K > 0: k alternates between K and 0 "
                   "every this many decode steps (the host's cost of a change of k)")
    p.add_argument("--graph-buckets", action="store_true", help="step keys of CUDA graphs' context buckets (powers of "
                   "2), nothing captured: the steps that stage their inputs anew are then a GPU's")
    a = p.parse_args(argv)
    if a.rows < 1 or a.prompts < a.rows or a.new_tokens < 2 or a.repeats < 1:
        p.error("--rows >= 1, --prompts >= --rows, --new-tokens >= 2 and --repeats >= 1 expected")
    if a.drafts is not None and not 0 <= a.drafts <= 3:
        p.error(f"--drafts {a.drafts}: expected 0-3 (the drafter's block is 4)")
    torch.set_num_threads(a.threads)
    if a.accept and not (a.no_forward and a.drafts):
        p.error("--accept: give it with --no-forward and --drafts K > 0")
    if a.mixed_context and (a.drafts != 0 or a.no_context):
        p.error("--mixed-context: give it with --drafts 0 and without --no-context")
    if a.temperature is not None and not 0 <= a.temperature <= 2:
        p.error(f"--temperature {a.temperature}: expected a number in [0, 2]")
    if a.mixed_context and a.temperature == 0:
        p.error("--mixed-context: the requests must sample (--temperature > 0)")
    if a.switch_every < 0 or (a.switch_every and not a.drafts):
        p.error("--switch-every: give a number of steps >= 1 with --drafts K > 0")
    if a.no_context and a.drafts != 0:
        p.error("--no-context: give it with --drafts 0 (a request without the drafter's context never drafts)")
    res = [run(a.rows, a.prompts, a.new_tokens, seed, not a.no_forward, a.drafts, a.overlap, a.server, a.accept,
               not a.no_context, a.graph_buckets, a.mixed_context, a.temperature, a.switch_every)
           for seed in range(a.repeats)]
    host, wall = statistics.median(r[0] for r in res), statistics.median(r[1] for r in res)
    print(f"{a.prompts} prompts, {a.rows} rows, {res[0][2]} decode steps per run, {a.repeats} runs: "
          f"host {host:.3f} ms per step (median), generate {wall:.1f} s, inputs staged anew on "
          f"{100 * statistics.median(r[3] for r in res):.1f} % of the steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
