"""bench/host_step.py: the engine's host time per decode step, through generate (with and without async scheduling)
and through the engine process's loop driven over a pipe; every mode decodes every request to its end."""
import itertools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import host_step  # noqa: E402


@pytest.mark.parametrize("drafts", [None, 0, 2])
def test_every_mode_runs_the_same_decode_steps(drafts):
    """With no drafter, one decoding plainly and one drafting 2 tokens a step (the fixed output accepts none)."""
    runs = {mode: host_step.run(rows=2, num_prompts=6, new_tokens=9, seed=0, forward=False, drafts=drafts, **kw)
            for mode, kw in {"generate": {}, "overlap": {"overlap": True},
                             "server": {"overlap": True, "server": True}}.items()}
    steps = {mode: r[2] for mode, r in runs.items()}
    # 6 requests of 8 decoded tokens each (the first comes from the prefill), two rows a step
    assert steps["generate"] == 6 * 8 // 2 and len(set(steps.values())) == 1, steps
    assert all(r[0] > 0 and r[1] > 0 for r in runs.values()), runs


def test_accept_emits_every_draft():
    """--accept: each step of 2 drafts emits 3 tokens per row, so 8 tokens after the prefill's take 3 steps (3 + 3 +
    the 2 a request has room for), in every mode."""
    for kw in ({}, {"overlap": True}, {"overlap": True, "server": True}):
        host, wall, steps, _ = host_step.run(rows=2, num_prompts=6, new_tokens=9, seed=0, forward=False, drafts=2,
                                             accept=True, **kw)
        assert steps == 6 * 3 // 2 and host > 0, (kw, steps)


def test_the_server_mode_takes_more_requests_than_the_pipe_buffers():
    """256 prompts of up to 199 tokens are more than a pipe's buffer holds (64 KiB): each is admitted as it is sent,
    so none waits on a pipe nobody reads yet, and all are decoded."""
    host, wall, steps, _ = host_step.run(rows=16, num_prompts=256, new_tokens=3, seed=0, forward=False, overlap=True,
                                         server=True)
    assert steps == 256 * 2 // 16 and host > 0, steps


def test_the_server_mode_raises_when_requests_fail(monkeypatch):
    warm = host_step.Engine.generate

    def generate_then_fail(self, *a, **kw):  # the warm-up call runs; the server's steps then fail
        out = warm(self, *a, **kw)
        monkeypatch.setattr(self, "_queue_step", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("step failed")))
        return out

    monkeypatch.setattr(host_step.Engine, "generate", generate_then_fail)
    with pytest.raises(RuntimeError, match="2 requests failed in the engine loop: .*step failed"):
        host_step.run(rows=2, num_prompts=2, new_tokens=4, seed=0, forward=False, overlap=True, server=True)


def test_no_context_runs_the_ar_step_inside_the_dspark_engine(monkeypatch):
    """--no-context (with --drafts 0): no request keeps the drafter's context, so every decode step is the AR step
    (key.context False); without it every plain step stashes the context; with --mixed-context the steps are of both
    kinds. Any other --drafts is refused."""
    keys, real = set(), host_step.fixed_step

    def spy(outs, accept=False):
        step = real(outs, accept)

        def recorded(st):
            keys.add((st.key.k, st.key.context))
            return step(st)
        return recorded

    monkeypatch.setattr(host_step, "fixed_step", spy)
    for context in (False, True):
        keys.clear()
        host_step.run(rows=2, num_prompts=6, new_tokens=9, seed=0, forward=False, drafts=0, overlap=True,
                      server=True, context=context)
        assert keys == {(0, context)}, (context, keys)
    keys.clear()  # --mixed-context: the policy's choice, one sampled request in CONTEXT_EVERY x running keeps it
    host_step.run(rows=2, num_prompts=24, new_tokens=4, seed=0, forward=False, drafts=0, overlap=True, mixed=True)
    assert keys == {(0, False), (0, True)}
    for bad in (["--drafts", "1", "--no-context"], ["--drafts", "1", "--mixed-context"],
                ["--drafts", "0", "--mixed-context", "--temperature", "0"], ["--temperature", "3"]):
        with pytest.raises(SystemExit):
            host_step.main([*bad, "--no-forward"])


def test_temperature_samples_the_requests_of_any_mode(monkeypatch):
    """--temperature: AR's requests sample as the DSpark engine's mixed-context ones do (the same requests for both);
    greedy by default."""
    seen = []
    real = host_step.Engine.generate

    def spy(self, prompts, params, *a, **kw):
        seen.append(params.temperature)
        return real(self, prompts, params, *a, **kw)

    monkeypatch.setattr(host_step.Engine, "generate", spy)
    host_step.run(rows=2, num_prompts=4, new_tokens=4, seed=0, forward=False, temperature=0.7)
    host_step.run(rows=2, num_prompts=4, new_tokens=4, seed=0, forward=False)
    host_step.run(rows=2, num_prompts=4, new_tokens=4, seed=0, forward=False, drafts=0, mixed=True)
    assert seen[1::2] == [0.7, 0.0, 0.7], seen  # each run's timed call (the first of each pair warms up)


def test_graph_buckets_stage_inputs_only_where_a_block_table_changes():
    """--graph-buckets: the step keys of CUDA graphs (powers of 2), nothing captured. Eager keys change with every
    cache block a row grows into, and each new key stages its inputs; under graph keys a chained step stages them
    only where its rows' block tables change, which a step that needs a block does every ALLOC_BLOCKS blocks."""
    kw = dict(rows=1, num_prompts=4, new_tokens=120, seed=0, forward=False, drafts=3, accept=True, overlap=True)
    eager, graphs = host_step.run(**kw)[3], host_step.run(**kw, graph_buckets=True)[3]
    assert 0 < graphs < eager / 2, (graphs, eager)


def test_switch_every_alternates_k_and_each_change_stages_its_inputs(monkeypatch):
    """--switch-every N (with --drafts K > 0): k alternates between K and 0 every N decode steps; each change of k is
    a step of another kind, whose inputs are staged anew (and a change to K flushes the stashed context first)."""
    ks, real = [], host_step.fixed_step

    def spy(outs, accept=False):
        step = real(outs, accept)

        def recorded(st):
            ks.append(st.key.k)
            return step(st)
        return recorded

    monkeypatch.setattr(host_step, "fixed_step", spy)
    kw = dict(rows=1, num_prompts=2, new_tokens=40, seed=0, forward=False, drafts=3, overlap=True, graph_buckets=True)
    steady = host_step.run(**kw)[3]
    ks.clear()
    switching = host_step.run(**kw, switch_every=4)[3]
    changes = sum(a != b for a, b in zip(ks, ks[1:]))
    assert set(ks) == {0, 3} and changes >= 8
    runs = [len(list(g)) for _, g in itertools.groupby(ks)]
    assert set(runs[1:-1]) == {4}  # runs of 4 steps of one k (the first may continue the warm-up's)
    assert switching > steady  # each change stages its step's inputs anew
    for bad in (["--switch-every", "4"], ["--drafts", "0", "--switch-every", "4"], ["--drafts", "2", "--switch-every",
                                                                                   "-1"]):
        with pytest.raises(SystemExit):
            host_step.main([*bad, "--no-forward"])
