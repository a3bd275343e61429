"""bench/step_ops.py: the device ops of a decode step counted by the part of the step that issues them (a CPU proxy for
a step graph's kernels)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import step_ops  # noqa: E402

from dspark import Engine, SamplingParams, load_drafter, load_target  # noqa: E402


def _count(models, k, temperature=0.0, steps=3):
    target = load_target(models[0])
    drafter = load_drafter(models[1], target)
    engine = Engine(target, drafter if k else None, num_speculative_tokens=k or None, max_batch_size=1,
                    max_model_len=128)
    prompts = [list(range(5, 25)), list(range(40, 52))]
    params = SamplingParams(max_tokens=10, temperature=temperature, seed=1, ignore_eos=True)
    return step_ops.step_ops(engine, prompts, params, steps), target


def test_parts_of_plain_and_drafting_steps(models):
    ar, target = _count(models, 0)
    assert ar["steps"] == 3 and ar["keys"] == {"rows=1 k=0 mode=greedy": 3}
    assert set(ar["parts"]) <= {"target forward", "verify", "other"}
    # each RMSNorm counts once (4 per layer here, the per-head q / k norms' torch path among them, and the final
    # one), whatever the CPU computes inside it
    assert ar["ops"]["target forward / rms_norm"] == 4 * target.config.num_hidden_layers + 1
    assert ar["ops"]["target forward / mm"] >= 4 * target.config.num_hidden_layers  # qkv, o, gate_up, down
    spec, _ = _count(models, 4)
    assert spec["keys"] == {"rows=1 k=4 mode=greedy": 3}
    assert {"draft: pass", "draft: sampling", "context write"} <= set(spec["parts"])
    assert spec["ops_per_step"] > ar["ops_per_step"] + spec["parts"]["draft: pass"] - 1
    assert abs(sum(spec["parts"].values()) - spec["ops_per_step"]) < 1e-9


def test_counting_stops_after_its_steps_and_restores_the_engine(models):
    target = load_target(models[0])
    engine = Engine(target, None, max_batch_size=1, max_model_len=128)
    forward, body, rms_norm = engine.runner.forward, engine.runner._step_fn, torch.nn.functional.rms_norm
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with step_ops.counting(engine, 2) as (counter, keys):
        engine.generate([list(range(5, 15))], params)
    assert sum(keys.values()) == 2 and sum(counter.per_part().values()) > 0
    assert engine.runner.forward == forward and engine.runner._step_fn == body
    assert torch.nn.functional.rms_norm is rms_norm
