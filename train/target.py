"""Training a target from scratch on the corpus (`kind: target` recipes)."""
from __future__ import annotations

import inspect
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from dspark.config import RecipeError, TargetRecipe
from dspark.models.k3.config import K3TextConfig
from dspark.models.k3.model import K3ForCausalLM
from dspark.models.qwen3 import Qwen3ForCausalLM, qwen3_config
from train.data import TokenData, batch_for_step, prepare_tokens
from train.loop import LoopSpec, make_accelerator, run
from train.outputs import preflight, start_run
from train.sync import main_process_first

log = logging.getLogger(__name__)


QWEN3_FIELDS = [p for p in inspect.signature(qwen3_config).parameters if p not in ("vocab_size", "special")]


def target_config(arch: str, fields: dict, vocab_size: int, special: dict | None = None):
    """The model config of a target recipe (`arch` + `model` fields); RecipeError naming the field when invalid."""
    if arch == "qwen3":
        unknown = sorted(set(fields) - set(QWEN3_FIELDS))
        if unknown:
            raise RecipeError(f"model.{unknown[0]}: unknown field for arch qwen3; valid fields: "
                              f"{', '.join(QWEN3_FIELDS)}")
    try:
        if arch == "qwen3":
            return qwen3_config(vocab_size=vocab_size, **fields, **(special or {}))
        return K3TextConfig.from_dict({**fields, "vocab_size": vocab_size, **(special or {})})
    except TypeError as e:  # a required field missing
        raise RecipeError(f"model: {e}") from None
    except ValueError as e:  # the config's own check names the field
        raise RecipeError(f"model.{e}") from None


def build_target(arch: str, fields: dict, tokenizer) -> torch.nn.Module:
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
               "pad_token_id": tokenizer.pad_token_id}
    cfg = target_config(arch, fields, len(tokenizer), special)
    return Qwen3ForCausalLM(cfg) if arch == "qwen3" else K3ForCausalLM(cfg)


def holdout_loss(model, rows: torch.Tensor, batch_size: int, device) -> float:
    """Mean next-token cross-entropy (nats/token) over the holdout rows."""
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        x = rows[i:i + batch_size].to(device)
        logits = model(x[:, :-1]).float()
        total += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    return total / max(1, count)


def train_target(recipe: TargetRecipe) -> dict:
    preflight(recipe)  # machine and output_dir, before any work
    target_config(recipe.arch, recipe.model, recipe.data.vocab_size)  # the model fields, before the corpus is built
    torch.manual_seed(recipe.seed)
    accelerator = make_accelerator(recipe)
    start_run(recipe, accelerator)
    with main_process_first(accelerator):  # rank 0 builds corpus/tokenizer/packed rows, the others reuse them
        data: TokenData = prepare_tokens(recipe.data)
    torch.manual_seed(recipe.seed)  # same initial weights on every rank and however the data was prepared
    model = build_target(recipe.arch, recipe.model, data.tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("%s target: %.2fM params, %d train rows x %d tokens", recipe.arch, n_params / 1e6,
             len(data.train), recipe.data.seq_len)
    bs = recipe.optim.batch_size // accelerator.num_processes

    def loss_step(m, step):
        x = batch_for_step(data.train, step, recipe.optim.batch_size, recipe.seed)
        x = x[accelerator.process_index * bs:(accelerator.process_index + 1) * bs].to(accelerator.device)
        logits = m(x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        return loss, {"tokens": (step + 1) * recipe.optim.batch_size * recipe.data.seq_len}

    def evaluate(m):
        return {"loss": holdout_loss(m, data.holdout, recipe.optim.batch_size, accelerator.device)}

    def save_final(m, path: Path):
        m.save_pretrained(path)
        data.tokenizer.save_pretrained(str(path))

    summary = run(recipe, LoopSpec(model, loss_step, evaluate, save_final), accelerator)
    summary["params"] = n_params
    tokens = summary["steps"] * recipe.optim.batch_size * (recipe.data.seq_len - 1)
    summary["train_tokens"] = tokens
    summary["train_tokens_per_s"] = tokens / max(1e-9, summary["train_minutes"] * 60)
    if accelerator.is_main_process:  # the loop wrote final_metrics.json before these were known
        import json

        (Path(recipe.output_dir) / "final_metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
