"""A speculators DSpark checkpoint in speculators' own model and in ours: the same block logits (Markov bias
included), confidence logits and Markov bias on the same target features, as max abs differences.

    python3 bench/speculators_parity.py SPEC_DIR --target TARGET_DIR --sequences SEQUENCES_PT [--rows 4]
        [--dtypes float32,bfloat16] [--out parity.json]

The rows are the first --rows holdout rows of a drafter run's sequences.pt. Every anchor of a row is scored (speculators
leaves out the last block_size positions), the Markov head teacher-forced on the block's tokens in both. Speculators'
model runs as `from_pretrained` builds it (flex attention on a GPU; SDPA on the CPU, where flex is not compiled);
tests/test_speculators_format.py uses the same two passes on checkpoints written by speculators' classes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

import speculators.models.dspark.core as spec_core
import torch
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dspark.checkpoint import load_drafter, load_target  # noqa: E402
from train.speculators_data import features  # noqa: E402


def speculators_outputs(model, aux, last, x, block: int):
    """speculators' DSpark training forward on target features, its loss replaced by one that keeps the
    (Markov-corrected) logits and confidence logits. aux [1, T, k*H], last [1, T, H], x [1, T]
    -> logits [T-N, N, V], confidence logits [T-N, N]."""
    seen = {}

    def keep(logits, targets, confidence_logits, loss_mask, *args, **kwargs):
        seen.update(logits=logits, confidence=confidence_logits)
        return logits.sum() * 0, {}

    T = x.shape[1]
    with mock.patch.object(spec_core, "compute_metrics", keep), torch.no_grad():
        model(hidden_states=aux, input_ids=x, loss_mask=torch.ones_like(x), verifier_last_hidden_states=last,
              document_ids=torch.zeros_like(x), max_anchors=T - block)
    return seen["logits"].view(T - block, block, -1), seen["confidence"].view(T - block, block)


def ours_outputs(drafter, aux, x):
    """Our training pass on the same blocks. aux [1, T, k*H], x [1, T] -> logits [T-N, N, V], confidence logits
    [T-N, N], Markov bias [T-N, N, V]."""
    T, N = x.shape[1], drafter.config.block_size
    anchors = torch.arange(T - N, device=x.device)[None]
    with torch.no_grad():
        h = drafter.train_forward(aux, x, anchors)  # [1, A, N, H]
        prev = x[0, anchors[0, :, None] + torch.arange(N, device=x.device)][None]  # [1, A, N]: anchor, then the block
        bias, m = drafter.markov(prev)
        return (drafter.base_logits(h) + bias)[0], drafter.confidence(h, m)[0], bias[0]


def max_diffs(model, drafter, target, x, dtype) -> dict:
    """Max abs differences on one row x [1, T] (and the largest |logit|, for scale)."""
    with torch.no_grad():
        feats = features(target, x, drafter.config.target_layer_ids).to(dtype)  # [1, T, k+1, H]: aux, last pre-norm
    aux, last = feats[:, :, :-1].flatten(2), feats[:, :, -1]
    s_logits, s_conf = speculators_outputs(model, aux, last, x, drafter.config.block_size)
    o_logits, o_conf, o_bias = ours_outputs(drafter, aux, x)
    N = drafter.config.block_size
    prev = x[0, torch.arange(x.shape[1] - N, device=x.device)[:, None] + torch.arange(N, device=x.device)]
    with torch.no_grad():
        s_bias = model.markov_head.block_bias(prev_token_ids=prev, hidden_states=None)
    diff = lambda a, b: float((a.float() - b.float()).abs().max())
    return {"logits": diff(s_logits, o_logits), "confidence": diff(s_conf, o_conf), "markov_bias": diff(s_bias, o_bias),
            "max_abs_logit": float(s_logits.float().abs().max())}


def parity(spec_dir: str, target_dir: str, rows: torch.Tensor, dtypes: list[str], device: str) -> dict:
    """{dtype: {logits, confidence, markov_bias, max_abs_logit}}: the max over rows [R, T]."""
    target = load_target(target_dir, device=device)
    out = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        cfg = DSparkSpeculatorConfig.from_pretrained(spec_dir)
        if device == "cpu":
            cfg.transformer_layer_config._attn_implementation = "sdpa"
        model = DSparkDraftModel.from_pretrained(spec_dir, config=cfg).to(device, dtype)
        model.load_verifier_weights()  # after the cast: the target's embedding and LM head at `dtype`, as ours reads
        model.eval()
        drafter = load_drafter(spec_dir, target, device=device, dtype=dtype)
        per_row = [max_diffs(model, drafter, target, r[None].to(device), dtype) for r in rows]
        out[name] = {key: max(d[key] for d in per_row) for key in per_row[0]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec_dir", help="a speculators DSpark checkpoint dir (config.json + model.safetensors)")
    ap.add_argument("--target", required=True)
    ap.add_argument("--sequences", required=True, help="a drafter run's sequences.pt (its holdout rows are scored)")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", help="write the result here as JSON")
    a = ap.parse_args(argv)
    seqs = torch.load(a.sequences)
    rows = seqs["holdout"][: a.rows]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res = {"rows": len(rows), "row_len": rows.shape[1], "device": device,
           **parity(a.spec_dir, a.target, rows, a.dtypes.split(","), device)}
    text = json.dumps(res, indent=2)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
