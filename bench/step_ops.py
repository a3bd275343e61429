"""Device ops per decode step, by part of the step: a CPU proxy for the CUDA kernels a step's graph replays.

    TRITON_INTERPRET=1 python3 bench/step_ops.py --target runs/quickstart/target/final \
        --drafter runs/quickstart/drafter/final [--runs ar,plain,nocontext,k4] [--temperatures 0,0.7] \
        [--steps 4] [--ops] [--out F]

At batch 1 on an H200 a small pair's decode step is a chain of tiny kernels of some 1.8 µs each, so its time follows
its kernel count (bench/RESULTS.md, "Where a decode step's time goes"). This counts, over a few decode steps of
Engine.generate at batch 1 on the CPU, every aten op that computes (views and allocations left out) and every Triton
launch, by the part of the step that issued it: the drafter's parallel pass (`draft: pass`), the rest of its drafting
(`draft: sampling`: the context rows' gathers, the LM head, the Markov loop), the target forward, the drafter's
context write (or, in plain steps, its stash), verification and the rest of the step. F.rms_norm, one fused kernel
on CUDA and six ops on the CPU, counts once; the Markov kernel runs as one launch of one program, as on CUDA (the
interpreter's default is a launch per draft). Under TRITON_INTERPRET=1 the engine takes the Triton paths a GPU takes;
without it, the torch references. A proxy: on CUDA some ops launch more than one kernel and SDPA picks other kernels,
so compare counts of one run, and check them against `bench/run_gpu.sh timeline --kernels 8`.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
from pathlib import Path
from unittest import mock

import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pair_decode import encode  # noqa: E402  (bench/pair_decode.py: prompts encoded as python -m eval does)

import dspark.runner as runner_mod  # noqa: E402
from dspark import Engine, SamplingParams, load_drafter, load_target  # noqa: E402
from dspark.kernels import HAS_TRITON, interpreting  # noqa: E402
from dspark.kernels import markov_sample as markov_mod  # noqa: E402
from eval.tasks import build_task  # noqa: E402

if HAS_TRITON:
    from triton.runtime.interpreter import GridExecutor

# ops that make a view of the same memory or only allocate: no kernel on any device
NO_KERNEL = {"view", "_unsafe_view", "as_strided", "expand", "slice", "select", "t", "transpose", "permute",
             "unsqueeze", "squeeze", "detach", "alias", "split", "split_with_sizes", "unbind", "narrow", "reshape",
             "view_as", "_reshape_alias", "lift_fresh", "unfold", "diagonal", "expand_as", "sym_size", "sym_stride",
             "sym_numel", "sym_storage_offset", "_local_scalar_dense", "empty", "empty_strided", "empty_like",
             "new_empty", "new_empty_strided"}


class OpCounter(TorchDispatchMode):
    """Counts computing aten ops (and launches reported by `one_op`) per part label and per (part, op)."""

    def __init__(self):
        super().__init__()
        self.parts: list[str] = ["other"]
        self.ops: collections.Counter = collections.Counter()  # (part, op) -> count
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and name not in NO_KERNEL:
            self.ops[(self.parts[-1], name)] += 1
        return func(*args, **(kwargs or {}))

    def per_part(self) -> dict[str, int]:
        out: collections.Counter = collections.Counter()
        for (part, _), n in self.ops.items():
            out[part] += n
        return dict(out)


def one_op(name: str, fn):
    """fn counted as one op named `name` under an active OpCounter, whatever it runs inside."""
    def wrapper(*a, **kw):
        counter = _get_current_dispatch_mode()
        if not isinstance(counter, OpCounter) or counter.paused:
            return fn(*a, **kw)
        counter.ops[(counter.parts[-1], name)] += 1
        counter.paused += 1
        try:
            return fn(*a, **kw)
        finally:
            counter.paused -= 1
    return wrapper


def labelled(counter: OpCounter, label: str, fn):
    """fn with the ops it issues counted under `label`."""
    def wrapper(*a, **kw):
        counter.parts.append(label)
        try:
            return fn(*a, **kw)
        finally:
            counter.parts.pop()
    return wrapper


@contextlib.contextmanager
def counting(engine: Engine, steps: int):
    """Counts the ops of engine's next `steps` decode steps -> (OpCounter, the step keys seen)."""
    counter, keys = OpCounter(), collections.Counter()
    runner, drafts = engine.runner, engine.drafts
    step_fn = runner._step_fn  # the step as a graph captures it: chain_inputs, the body, the copy to carry

    def step(st):
        if sum(keys.values()) >= steps:
            return step_fn(st)
        keys[f"rows={st.key.rows} k={st.key.k} mode={st.key.mode}"] += 1
        with counter:
            return step_fn(st)

    with contextlib.ExitStack() as stack:
        patch = stack.enter_context
        patch(mock.patch.object(runner, "_step_fn", step))
        patch(mock.patch.object(runner, "forward", labelled(counter, "target forward", runner.forward)))
        for name in ("greedy_step", "verify_sampled", "pack_step"):
            patch(mock.patch.object(runner_mod, name, labelled(counter, "verify", getattr(runner_mod, name))))
        patch(mock.patch.object(F, "rms_norm", one_op("rms_norm", F.rms_norm)))
        if HAS_TRITON and interpreting():
            patch(mock.patch.object(markov_mod, "markov_sample_triton", _one_launch(markov_mod.markov_sample_triton)))
            patch(mock.patch.object(GridExecutor, "__call__", _launch_counted(GridExecutor.__call__)))
        if drafts is not None:
            for name, label in (("write_context", "context write"), ("stash_context", "context stash"),
                                ("hidden", "draft: pass"), ("propose", "draft: sampling")):
                patch(mock.patch.object(drafts, name, labelled(counter, label, getattr(drafts, name))))
        yield counter, keys


def _one_launch(markov_sample_triton):
    """The Markov kernel as CUDA runs it, one launch (the interpreter's default is one per draft: its programs run one
    after another, so it cannot wait at a grid barrier; one program can)."""
    def one_launch(*a, **kw):
        return markov_sample_triton(*a, **(kw | {"one_launch": True, "programs": 1}))
    return one_launch


def _launch_counted(call):
    def launch(self, *a, **kw):  # one interpreted Triton launch = one op, named after its kernel
        return one_op("triton:" + getattr(self.fn, "__name__", "kernel"), call)(self, *a, **kw)
    return launch


def print_counts(r: dict, ops: bool) -> None:
    """A count's ops per step by part, then (ops) by part and op."""
    for p, c in r["parts"].items():
        print(f"      {p:<24} {c:6.1f}")
    for o, c in (r["ops"].items() if ops else ()):
        print(f"        {o:<60} {c:5.1f}")


def step_ops(engine: Engine, prompts: list[list[int]], params: SamplingParams, steps: int) -> dict:
    """Ops per decode step of engine at batch 1: prompts[0] decodes first (uncounted: graphs, first flushes), then
    prompts[1], whose first `steps` decode steps are counted. -> {keys, steps, ops_per_step, parts, ops}."""
    engine.generate([prompts[0]], params)
    with counting(engine, steps) as (counter, keys):
        engine.generate([prompts[1]], params)
    n = max(sum(keys.values()), 1)
    parts = {p: c / n for p, c in sorted(counter.per_part().items())}
    return {"keys": dict(keys), "steps": sum(keys.values()), "ops_per_step": sum(parts.values()), "parts": parts,
            "ops": {f"{p} / {o}": c / n for (p, o), c in sorted(counter.ops.items())}}


def engine_for(run: str, target, drafter, max_model_len: int, max_batch_size: int = 1) -> Engine:
    """A run's engine: ar (no drafter), auto (the k policy), plain (the drafter loaded, every step k = 0: what the k
    policy runs where drafting does not pay), nocontext (plain, its requests keeping no drafter context: what sampled
    requests run while plain decoding is the sampled rows' choice, the AR step inside the DSpark engine) or kN (N
    drafts pinned)."""
    k = None if run in ("ar", "auto", "plain", "nocontext") else int(run.removeprefix("k"))
    engine = Engine(target, None if run == "ar" else drafter, num_speculative_tokens=k, max_batch_size=max_batch_size,
                    max_model_len=max_model_len)
    if run in ("plain", "nocontext"):
        engine.policy.choose = lambda *a, **kw: 0
        engine._keeps_context = lambda params: run == "plain"  # (a seeded sampled request keeps none either)
    return engine


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--runs", default="ar,k4", help="ar, plain (the drafter loaded, every step k = 0), nocontext "
                    "(plain, keeping no drafter context) and/or kN (N drafts pinned)")
    ap.add_argument("--temperatures", default="0")
    ap.add_argument("--steps", type=int, default=4, help="decode steps counted per run")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--task", default="humaneval")
    ap.add_argument("--ops", action="store_true", help="print each op's count per part too")
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args(argv)
    target = load_target(a.target)
    drafter = load_drafter(a.drafter, target)
    prompts = encode(build_task(a.task), target.tokenizer, 2, 256)
    rows = []
    for name in a.runs.split(","):
        for t in (float(x) for x in a.temperatures.split(",")):
            engine = engine_for(name, target, drafter, max(map(len, prompts)) + a.max_tokens + 16)
            params = SamplingParams(max_tokens=a.max_tokens, temperature=t, seed=0, ignore_eos=True)
            r = {"run": name, "temperature": t} | step_ops(engine, prompts, params, a.steps)
            rows.append(r)
            print(f"{name:>4} T={t:g}: {r['ops_per_step']:.1f} ops per step over {r['steps']} steps {r['keys']}")
            print_counts(r, a.ops)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
