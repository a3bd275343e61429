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
