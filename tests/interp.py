"""Run a test module's Triton-interpreter checks in a subprocess: triton reads TRITON_INTERPRET when a kernel is
decorated (module import), so the checks need a process that sets it before importing anything."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def interpreter_checks(module: str) -> dict:
    """`module._interp_checks()` under TRITON_INTERPRET=1 -> its {name: [error, tolerance]}."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    code = f"import json, {module} as t; print('RESULT' + json.dumps(t._interp_checks()))"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.split("RESULT", 1)[1])
