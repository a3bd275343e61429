"""A drafter run's training rows (`<output_dir>/sequences.pt`: the regenerated sequences and loss masks) with the
target's features, written in the data format `speculators` trains from (`python -m speculators.train --data-path
DIR --on-missing raise`), so both trainers learn from the same rows and features.

    python -m train.speculators_data RUN_DIR_OR_SEQUENCES_PT --target TARGET_DIR --layer-ids 1 3 --out DIR

DIR holds
- a `datasets.save_to_disk` dataset (torch format) with columns input_ids [T] int64, loss_mask [T] int64 (1 on the
  tokens to learn, i.e. the response, as speculators' prepare_data writes it) and seq_len;
- hidden_states/hs_{row}.safetensors = {"hidden_states": [T, k+1, H] bf16, "token_ids": [T] int64}: the target's
  hidden state after each of the k aux layers (ascending; our 0-based "after layer i" ids, which are speculators'
  `--target-layer-ids` minus one), then after its last layer, before the final norm (speculators applies the
  target's norm and LM head to it for its soft targets);
- export.json: the rows, the ids in both numberings and the `train_data_ratio` that splits the rows back into ours.
Rows: the train split, then the holdout split. Each row ends at its last loss token (sequences.pt pads its rows).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import datasets
import torch
from safetensors.torch import save_file

from dspark.checkpoint import load_target
from dspark.checkpoint_io import atomic_dir
from train.sequences import Sequences

HS_DIR = "hidden_states"
INFO = "export.json"


def row_lengths(mask: torch.Tensor) -> torch.Tensor:
    """[N, T] bool -> [N]: the length up to and including each row's last loss token (0 when it has none)."""
    T = mask.shape[1]
    last = torch.where(mask, torch.arange(T), torch.full_like(mask, -1, dtype=torch.long)).amax(1)
    return last + 1


def load_sequences_file(path: str | Path) -> Sequences:
    """sequences.pt, given as the file or the drafter run dir holding it."""
    p = Path(path)
    p = p / "sequences.pt" if p.is_dir() else p
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file; expected a drafter run's sequences.pt (or its output_dir)")
    data = torch.load(p)
    missing = [k for k in ("train", "train_mask", "holdout", "holdout_mask") if k not in data]
    if missing:
        raise ValueError(f"{p}: missing {missing}; expected the sequences.pt a drafter run writes")
    return Sequences(**data)


@torch.no_grad()
def features(target, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """[B, T] -> [B, T, k+1, H]: the hidden states after each of `layer_ids`, then after the last layer (pre-norm)."""
    last = target.config.num_hidden_layers - 1
    want = list(layer_ids) + [last]
    asked = sorted(set(want))
    _, aux = target(ids, aux_layer_ids=asked)
    aux = aux.view(*ids.shape, len(asked), -1)
    return aux[:, :, [asked.index(i) for i in want]]


def export(seqs: Sequences, target, layer_ids: list[int], out: str | Path, batch_size: int = 8,
           target_ref: str = "", overwrite: bool = False) -> dict:
    """Write `seqs` (train, then holdout) with `target`'s features into `out`, whole (a temp dir beside it, renamed
    when complete). layer_ids: our 0-based "after layer i" ids, strictly increasing. Returns export.json's dict."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise ValueError(f"--out {out}: exists; pass --overwrite to replace it")
    ids = list(layer_ids)
    L = target.config.num_hidden_layers
    if not ids or ids != sorted(set(ids)) or not 0 <= ids[0] <= ids[-1] < L:
        raise ValueError(f"--layer-ids: {ids}: expected strictly increasing 0-based layer ids in 0..{L - 1}")
    if batch_size < 1:
        raise ValueError(f"--batch-size: expected >= 1, got {batch_size}")
    rows = torch.cat([seqs.train, seqs.holdout])
    masks = torch.cat([seqs.train_mask, seqs.holdout_mask]).bool()
    lens = row_lengths(masks)
    keep = (lens > 0).nonzero().flatten().tolist()
    n_train = sum(1 for i in keep if i < len(seqs.train))
    if n_train == 0 or n_train == len(keep):
        raise ValueError(f"sequences: {n_train} train and {len(keep) - n_train} holdout rows have loss tokens; "
                         "speculators needs both splits non-empty")
    dev = next(target.parameters()).device
    with atomic_dir(out) as tmp:
        (tmp / HS_DIR).mkdir()
        cols: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
        for start in range(0, len(keep), batch_size):
            idx = keep[start:start + batch_size]
            T = int(lens[idx].max())
            feats = features(target, rows[idx, :T].to(dev), ids).to("cpu", torch.bfloat16)  # [B, T, k+1, H]
            for j, i in enumerate(idx):
                n = int(lens[i])
                tokens = rows[i, :n].long()
                save_file({"hidden_states": feats[j, :n].contiguous(), "token_ids": tokens.contiguous()},
                          str(tmp / HS_DIR / f"hs_{start + j}.safetensors"))
                cols["input_ids"].append(tokens.tolist())
                cols["loss_mask"].append(masks[i, :n].long().tolist())
                cols["seq_len"].append(n)
        ds = datasets.Dataset.from_dict(cols)
        ds.set_format(type="torch")
        ds.save_to_disk(str(tmp))
        info = {"rows": len(keep), "train_rows": n_train, "holdout_rows": len(keep) - n_train,
                "train_data_ratio": (n_train + 0.5) / len(keep), "target": target_ref,
                "target_layer_ids": ids, "speculators_target_layer_ids": [i + 1 for i in ids],
                "hidden_size": target.config.hidden_size, "tokens": int(lens[keep].sum()),
                "max_seq_len": int(lens[keep].max()),
                "loss_tokens": int(masks[keep].sum())}
        (tmp / INFO).write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.speculators_data",
                                 description="a drafter run's sequences.pt + the target's features -> speculators' "
                                             "training data format")
    ap.add_argument("sequences", help="a drafter run's output_dir, or its sequences.pt")
    ap.add_argument("--target", required=True, help="the target dir the sequences were regenerated with")
    ap.add_argument("--layer-ids", type=int, nargs="+", required=True,
                    help="the drafter's target_layer_ids (ours: 0-based 'after layer i')")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu or cuda")
    ap.add_argument("--dtype", default="auto", help="the target's compute dtype: auto (bf16 on GPU, fp32 on CPU)")
    ap.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)
    try:
        seqs = load_sequences_file(a.sequences)
        device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
        dtype = ("bfloat16" if device == "cuda" else "float32") if a.dtype == "auto" else a.dtype
        target = load_target(a.target, device=device, dtype=dtype)
        info = export(seqs, target, a.layer_ids, a.out, a.batch_size, str(a.target), a.overwrite)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
