"""Tiny random-weight targets of every kind the engine serves (shared by the engine/cache tests).
DSPARK_TEST_DEVICE=cuda runs the same engine tests on a GPU (fp32)."""
import os
import sysconfig
from pathlib import Path

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


def make_target(kind: str, vocab: int = 300, seed: int = 0, device: str | None = None):
    """A tiny random target on `device` (default DSPARK_TEST_DEVICE, else the CPU)."""
    torch.manual_seed(seed)
    model = TARGETS[kind](vocab).eval().to(device or os.environ.get("DSPARK_TEST_DEVICE", "cpu"))
    # sharpen the random model a little so greedy continuations are not dominated by near-ties
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


def device_of(model: torch.nn.Module) -> torch.device:
    """Where a model's parameters are: the tensors a test feeds it are made there."""
    return next(model.parameters()).device


def add_tokenizer(target_dir, vocab: int = 300):
    """Save a real byte-level BPE tokenizer (trained on a few stdlib files; `<|mask|>` is id 2) into a target dir,
    as every served target has one. Returns the tokenizer."""
    import sysconfig
    import tempfile
    from pathlib import Path

    from dspark.data.tokenizer import train_tokenizer

    texts = [f.read_text(errors="replace") for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:5]]
    with tempfile.TemporaryDirectory() as tmp:
        tok = train_tokenizer(texts, vocab, Path(tmp) / "tok")
    tok.save_pretrained(str(target_dir))
    return tok


def write_tiny_target_and_data(root):
    """A tiny random Qwen3 target dir with a real BPE tokenizer (incl. <|mask|>) and a local jsonl dataset of real
    stdlib code, for end-to-end `python -m train` runs: returns (target_dir, data_file)."""
    import json
    import sysconfig
    from pathlib import Path

    from dspark.data.tokenizer import train_tokenizer

    root = Path(root)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    texts = [f.read_text(errors="replace") for f in files]
    tok = train_tokenizer(texts, 400, root / "tok")
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(qwen3_config(vocab_size=len(tok), hidden_size=64, num_layers=2, num_heads=4,
                                           num_kv_heads=2, head_dim=16, intermediate_size=96,
                                           eos_token_id=tok.eos_token_id))
    target.save_pretrained(root / "target")
    tok.save_pretrained(str(root / "target"))
    with open(root / "data.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t[:3000]}) + "\n")
    return root / "target", root / "data.jsonl"


def propose_after_prefix(drafter, aux, input_ids, anchor: int, layer_offset: int = 0, confidence: bool = False):
    """Draft one block the way the engine does: the context rows of positions < anchor written into a fresh paged
    cache through a DraftRunner, then the block [x_anchor, mask...] proposed greedily through the device step's
    view of the cache (with the confidences when `confidence`). Returns (runner, Proposal)."""
    from dspark.cache.paged import PagedCache
    from dspark.spec.draft import DraftRunner

    dev = device_of(drafter)
    runner = DraftRunner(drafter, layer_offset=layer_offset)
    cache = PagedCache(runner.cache_layout(), {}, num_blocks=8, block_size=16, device=dev)
    cache.add_request("r")
    runner.write_context(cache.batch(["r"], [anchor]), aux[:, :anchor])
    cache.commit()
    num_cached, tables, slots = cache.step_rows(["r"], 1)
    tables = [(t + [cache.scratch_block] * 8)[:8] for t in tables]  # the step's width: 8 blocks
    view = cache.device_view(*(torch.tensor(x, device=dev) for x in (num_cached, [1], tables, slots)), 1, record=False)
    anchor_tok = input_ids[0, anchor:anchor + 1]
    return runner, runner.propose(view, anchor_tok, drafter.config.num_drafts, confidence=confidence)


SERVE_MAX_LEN = 256  # the tiny pair's context (tests/test_serve*.py)
STDLIB_FILES = ["json/encoder.py", "textwrap.py", "string.py", "bisect.py"]


def write_tiny_pair(out: Path, seed: int = 0) -> tuple[Path, Path]:
    """A 2-layer random Qwen3 target (+ BPE tokenizer, vocab 512) and a random 1-layer DSpark drafter (block 4)."""
    from dspark.checkpoint import export_drafter
    from dspark.data.tokenizer import train_tokenizer
    from dspark.models.drafter import DrafterConfig, DSparkDrafter
    from dspark.models.qwen3 import Qwen3ForCausalLM, qwen3_config

    std = Path(sysconfig.get_paths()["stdlib"])
    texts = [(std / f).read_text() for f in STDLIB_FILES if (std / f).is_file()]
    tdir, ddir = out / "tiny-target", out / "tiny-drafter"
    tok = train_tokenizer(texts, 512, tdir)
    torch.manual_seed(seed)
    cfg = qwen3_config(vocab_size=len(tok), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=128, max_position_embeddings=SERVE_MAX_LEN, eos_token_id=tok.eos_token_id,
                       bos_token_id=tok.eos_token_id)
    target = Qwen3ForCausalLM(cfg)
    target.save_pretrained(tdir)  # replaces the dir atomically: save the tokenizer after
    tok.save_pretrained(str(tdir))
    dcfg = DrafterConfig(vocab_size=len(tok), hidden_size=64, target_hidden_size=64, target_layer_ids=[0, 1],
                         num_target_layers=2, mask_token_id=tok.mask_token_id, block_size=4, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                         max_position_embeddings=SERVE_MAX_LEN)
    drafter = DSparkDrafter(dcfg, target.model.embed_tokens.weight, target.lm_head.weight)
    export_drafter(drafter, ddir, "dspark")
    return tdir, ddir
