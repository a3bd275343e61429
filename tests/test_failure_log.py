"""tests/conftest.py's failure log (DSPARK_FAILURE_LOG): bench/run_gpu.sh's CUDA runs read why a test failed there
even when the run is stopped before pytest's summary."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_failure_is_logged_as_it_happens(tmp_path):
    (tmp_path / "test_probe.py").write_text("def test_ok():\n    pass\n\n"
                                            "def test_bad():\n    assert 1 + 1 == 3, 'the reason'\n")
    log = tmp_path / "failures.txt"
    env = dict(os.environ, DSPARK_FAILURE_LOG=str(log), PYTHONPATH=str(ROOT))
    for key in [k for k in env if k.startswith("PYTEST_XDIST")]:  # under xdist: the probe is no worker of ours
        env.pop(key)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                        str(tmp_path / "test_probe.py")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 1, p.stdout[-2000:]
    text = log.read_text()
    assert text.count("=== ") == 1  # the failure only, once
    assert "test_probe.py::test_bad (call)" in text and "the reason" in text
