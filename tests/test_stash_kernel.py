"""A plain step's context stash in one kernel (dspark/kernels/project_rows.py): the kernel against its torch definition,
the targets' aux parts, and the engine's plain and drafting steps with the kernel on.

CPU: the kernel runs under TRITON_INTERPRET=1 in a subprocess (triton reads the variable when a kernel is decorated,
as in tests/test_kernels.py). CUDA (skipped without a GPU): decode-sized rows in fp32 and bf16.
"""
import pytest
import torch

from dspark.kernels.project_rows import MAX_PARTS, MAX_ROWS, project_rows_, project_rows_ref
from tests.interp import interpreter_checks
from tests.targets import device_of, make_target

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# (rows, part widths, outputs, dtype): one row (a decode step at batch 1), ragged widths, four and eight parts, the
# most rows
SHAPES = {"one_row": (1, (64, 64), 48, torch.float32), "ragged": (5, (100, 30, 17), 70, torch.float32),
          "four_parts": (17, (32, 32, 32, 32), 40, torch.float32), "bf16": (MAX_ROWS, (64, 64), 96, torch.bfloat16),
          "eight_parts": (3, (16,) * MAX_PARTS, 24, torch.float32)}


def _project_checks(kernel, device="cpu") -> dict:
    """name -> [max error against the torch definition, tolerance]; the parts are column slices of a wider tensor
    (read in place through their row stride), the destination rows scattered over a larger pool, the other pool rows
    left as they were (fp32: 1e-5 of the largest output; bf16: one bf16 rounding of it)."""
    g = torch.Generator().manual_seed(5)
    res = {}
    for name, (M, widths, N, dtype) in SHAPES.items():
        parts = [torch.randn(M, k + 3, generator=g).to(device, dtype)[:, :k] for k in widths]
        w = (torch.randn(N, sum(widths), generator=g) * 0.1).to(device, dtype)
        pool = torch.randn(3 * M + 7, N, generator=g).to(device, dtype)
        dest = torch.randperm(pool.shape[0], generator=g)[:M].to(device)
        want, got = pool.clone(), pool.clone()
        with torch.no_grad():
            project_rows_ref(parts, w, want, dest)
            kernel(parts, w, got, dest)
        scale = want[dest].float().abs().max().item()
        tol = (1e-5 if dtype == torch.float32 else 1e-2) * scale
        res[name] = [(want.float() - got.float()).abs().max().item(), tol]
    return res


def _plain_stash_check(kind: str, calls: list, n_prompts: int = 2, new_tokens: int = 12) -> float:
    """Mismatches (0 = none) of the engine under a k schedule of plain runs and drafting steps with the kernel on:
    every output the target's greedy, the drafter rows of every committed position those of one plain forward."""
    from dspark.engine import Engine
    from dspark.request import SamplingParams
    from tests.test_drafter_k3 import make_k3_drafter
    from tests.test_engine import make_drafter, reference_greedy
    from tests.test_runner import _context_rows_match

    target = make_target(kind)
    drafter = (make_k3_drafter if kind == "k3" else make_drafter)(target)
    engine = Engine(target, drafter, max_batch_size=2, prefill_chunk=8)
    schedule = iter([0, 0, 0, engine.k, 0, engine.k, 0, 0] * 10)
    engine.policy.choose = lambda *a: next(schedule)
    prompts = [list(range(5, 16)), list(range(40, 47))][:n_prompts]
    reqs = [engine.add_request(p, SamplingParams(max_tokens=new_tokens, ignore_eos=True)) for p in prompts]
    before, bad, checked = len(calls), 0, 0
    while engine.has_work():
        engine.step()
        for r in reqs:
            try:
                checked += _context_rows_match(engine, target, drafter, r)
            except AssertionError:
                bad += 1
    bad += sum(r.output().token_ids != reference_greedy(target, p, new_tokens) for r, p in zip(reqs, prompts))
    return float(bad + (len(calls) == before) + (checked < 2))  # the stash went through the kernel, rows checked


def _plain_step_extra_ops() -> float:
    """Device ops of a plain step (the drafter loaded, k = 0) less those of an AR step, counted as
    bench/step_ops.py counts them (every Triton launch one op): the stash's one launch."""
    import sys
    from pathlib import Path

    from dspark.request import SamplingParams
    from tests.test_engine import make_drafter

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import step_ops

    target = make_target("qwen3")
    drafter = make_drafter(target)
    prompts, params = [list(range(5, 25)), list(range(40, 52))], SamplingParams(max_tokens=8, ignore_eos=True)
    ar, plain = (step_ops.step_ops(step_ops.engine_for(run, target, drafter, 128), prompts, params, 3)
                 for run in ("ar", "plain"))
    assert plain["keys"] == {"rows=1 k=0 mode=greedy": 3}, plain["keys"]
    return plain["ops_per_step"] - ar["ops_per_step"]


def _interp_checks() -> dict:
    """Runs with TRITON_INTERPRET=1: name -> [error, tolerance]."""
    import dspark.kernels.project_rows as pr
    from dspark.kernels import interpreting

    assert interpreting()
    res = _project_checks(pr.project_rows_triton)
    calls = []
    kernel = pr.project_rows_triton
    pr.project_rows_triton = lambda *a: (calls.append(1), kernel(*a))[-1]
    res["qwen3_engine_plain_stash"] = [_plain_stash_check("qwen3", calls), 0.0]
    # K3 (its aux parts from the AttnRes stream): one short request, the interpreted KDA kernels being slow
    res["k3_engine_plain_stash"] = [_plain_stash_check("k3", calls, n_prompts=1, new_tokens=9), 0.0]
    res["plain_step_one_op_more_than_ar"] = [abs(_plain_step_extra_ops() - 1.0), 0.0]
    return res


@pytest.fixture(scope="module")
def interp():
    pytest.importorskip("triton")
    return interpreter_checks("tests.test_stash_kernel")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU box tests the compiled kernel (test_cuda_*)")
@pytest.mark.parametrize("name", [*SHAPES, "qwen3_engine_plain_stash", "k3_engine_plain_stash",
                                  "plain_step_one_op_more_than_ar"])
def test_triton_interpreter_matches_reference(interp, name):
    err, tol = interp[name]
    assert err <= tol, f"{name}: {err} > {tol}"


@pytest.mark.parametrize("kind", ["qwen3", "k3"])
def test_aux_parts_are_the_concatenated_aux(kind):
    """aux_parts=True gives one [B, T, hidden] tensor per aux layer, in order, whose concatenation is the aux."""
    target = make_target(kind)
    ids = torch.randint(2, 100, (2, 6), generator=torch.Generator().manual_seed(1)).to(device_of(target))
    layers = [0, target.config.num_hidden_layers - 1]
    with torch.no_grad():
        logits, aux = target(ids, aux_layer_ids=layers)
        logits2, parts = target(ids, aux_layer_ids=layers, aux_parts=True)
    assert len(parts) == 2 and all(p.shape == (2, 6, target.config.hidden_size) for p in parts)
    assert torch.equal(torch.cat(parts, -1), aux) and torch.equal(logits, logits2)


def test_dispatch_leaves_a_prefill_sized_stash_to_torch():
    """More rows than MAX_ROWS (a prefill's) or a pool of the wrong width take the torch definition, same result."""
    g = torch.Generator().manual_seed(2)
    parts = [torch.randn(MAX_ROWS + 1, 8, generator=g) for _ in range(2)]
    w, dest = torch.randn(4, 16, generator=g), torch.arange(MAX_ROWS + 1)
    want, got = torch.zeros(MAX_ROWS + 1, 4), torch.zeros(MAX_ROWS + 1, 4)
    project_rows_ref(parts, w, want, dest)
    with torch.no_grad():
        project_rows_(parts, w, got, dest)
    torch.testing.assert_close(got, want)
    assert torch.equal(want, torch.cat(parts, -1) @ w.T)


@cuda
def test_cuda_project_rows():
    from dspark.kernels.project_rows import project_rows_triton

    for name, (err, tol) in _project_checks(project_rows_triton, "cuda").items():
        assert err <= tol, f"{name}: {err} > {tol}"
