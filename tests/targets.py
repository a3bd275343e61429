"""Tiny random-weight targets of every kind the engine serves (shared by the engine/cache tests).
DSPARK_TEST_DEVICE=cuda runs the same engine tests on a GPU (fp32)."""
import os

import torch

from dspark.models.qwen3 import Qwen3ForCausalLM, qwen3_config


def _qwen3(vocab):
    cfg = qwen3_config(vocab_size=vocab, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=96, max_position_embeddings=512)
    return Qwen3ForCausalLM(cfg)


def _k3(vocab):
    from dspark.models.k3.config import k3_tiny_config
    from dspark.models.k3.model import K3ForCausalLM

    return K3ForCausalLM(k3_tiny_config(vocab_size=vocab, max_position_embeddings=512))


TARGETS = {"qwen3": _qwen3, "k3": _k3}


def make_target(kind: str, vocab: int = 300, seed: int = 0):
    torch.manual_seed(seed)
    model = TARGETS[kind](vocab).eval().to(os.environ.get("DSPARK_TEST_DEVICE", "cpu"))
    # sharpen the random model a little so greedy continuations are not dominated by near-ties
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model
