"""Fixtures several test modules share (one instance per module: scope="module")."""
import os

import pytest
import torch

# fp32 tests compare against plain torch: on a GPU, Triton's fp32 dots (ours and fla's) default to TF32, whose
# rounding flips greedy near-ties of the tiny random models. Run them in IEEE fp32, as fla's own tests do. (Read when
# a kernel compiles, so set before any test runs one.)
if os.environ.get("DSPARK_TEST_DEVICE", "cpu").startswith("cuda"):
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    torch.backends.cudnn.allow_tf32 = False  # cuDNN convs (the KDA short conv) likewise; matmuls are fp32 already

from tests.targets import write_tiny_pair, write_tiny_target_and_data

FAILURE_LOG = os.environ.get("DSPARK_FAILURE_LOG")  # where each failure's report goes the moment it happens

# Under pytest-xdist the workers share the machine's cores: each takes its share for torch's CPU threads, and so do
# the processes its tests start (OMP_NUM_THREADS). With every worker on all the cores, OpenMP's barriers in the
# oversubscribed cores stretch a CPU test of a minute past its time limit.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_runtest_logreport(report):
    """With DSPARK_FAILURE_LOG set, append each failed test's id and report to that file as it fails (under xdist in
    the controller, which receives every worker's reports): a run stopped before pytest's summary still says why."""
    if FAILURE_LOG and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(FAILURE_LOG, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target dir, drafter dir): a tiny Qwen3 target with a real BPE tokenizer and a random DSpark drafter."""
    return write_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A dir with a tiny random Qwen3 target (real BPE tokenizer) and a local jsonl dataset of real stdlib code."""
    root = tmp_path_factory.mktemp("run")
    write_tiny_target_and_data(root)
    return root
