"""Acceptance evaluation: `python -m eval` (see eval/__main__.py).

- `eval.tasks`: task suites from real offline prompt sets (HumanEval, Spec-Bench/MT-Bench, held-out corpus files).
- `eval.entropy`: the target's teacher-forced per-token entropy on generated text.
- `eval.measure`: tau, alpha, per-position acceptance, entropy bins, Spearman; Prometheus counters of a server.
- `eval.report`: report.json (schema in its docstring, SCHEMA_VERSION), report.md and the PNG plots.

Nothing heavy is imported here.
"""
