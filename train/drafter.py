"""Training a DSpark / DFlash drafter against a frozen target (`kind: drafter` recipes).

Data: sequences from a local dataset or the corpus (tokenised with the target's tokenizer); `regenerate` lets the
target write the continuations the drafter learns from. Each step computes the target features online (no disk),
picks `anchors_per_seq` anchors per sequence (train/anchors.py) and trains all their blocks in one block-sparse pass.
Under mixed_precision=bf16 the frozen target regenerates and gives the training features in bf16, as it is
served, and the drafter and its loss run under bf16 autocast.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from dspark.checkpoint import export_drafter, load_target
from dspark.checkpoint_io import read_config
from dspark.config import DrafterRecipe
from dspark.drafter_json import K3_DEFAULT_ROPE_THETA
from dspark.models.drafter import DrafterConfig, DSparkDrafter
from train.anchors import DecodeStarts, accepted_in_chunks, every_anchor, sample_anchors, to_device, walked_accepted
from train.data import rows_for_step, step_generator
from train.loop import LoopSpec, make_accelerator, run
from train.losses import LossWeights, drafter_loss
from train.outputs import preflight, start_run
from train.sequences import Sequences, check_chat_template, load_sequences

WALKED_ROWS = 16  # holdout rows the eval decodes greedily for tau_walked (all their anchors: a few steps of work)
log = logging.getLogger(__name__)


def default_layer_ids(num_layers: int) -> list[int]:
    """DFlash's spread (5 layers between the 2nd and the 3rd-to-last) for deep targets; for shallow ones, every
    other layer from layer 1 up to the last."""
    if num_layers >= 8:
        n = 5
        return sorted({round(1 + i * (num_layers - 4) / (n - 1)) for i in range(n)})
    return list(range(1, num_layers, 2)) if num_layers > 2 else [num_layers - 1]


def drafter_config(recipe: DrafterRecipe, target, tokenizer) -> DrafterConfig:
    """The drafter's config from the recipe and the target. backbone auto: qwen3 for Qwen3 targets and DFlash
    drafters, k3 (MLA, K3DSparkModel) for DSpark drafters of kimi_linear / kimi_k3 targets; k3 dims default to the
    target's MLA dims."""
    m, tc = recipe.drafter, target.config
    backbone = m.backbone if m.backbone != "auto" else (
        "qwen3" if getattr(tc, "model_type", None) == "qwen3" or m.mode == "dflash" else "k3")
    mask_id = tokenizer.convert_tokens_to_ids(tokenizer.mask_token) if tokenizer.mask_token else None
    if mask_id is None:
        raise ValueError(f"target tokenizer ({recipe.target}): no mask token; DSpark drafting needs one "
                         "(a tokenizer built by `python -m dspark.data tokenizer` has <|mask|>)")
    ids = m.target_layer_ids or default_layer_ids(tc.num_hidden_layers)
    common = dict(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, target_hidden_size=tc.hidden_size,
        target_layer_ids=ids, mask_token_id=mask_id, block_size=m.block_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads or tc.num_attention_heads,
        intermediate_size=m.intermediate_size or tc.intermediate_size, rms_norm_eps=tc.rms_norm_eps,
        max_position_embeddings=tc.max_position_embeddings, mode=m.mode,
        markov_rank=0 if m.mode == "dflash" else m.markov_rank,
        enable_confidence_head=m.enable_confidence_head and m.mode == "dspark",
        confidence_head_with_markov=m.confidence_head_with_markov)
    if backbone == "k3":
        return DrafterConfig(**common, **_k3_fields(m, tc), backbone="k3", num_target_layers=len(ids),
                             rope_theta=K3_DEFAULT_ROPE_THETA)
    # a Qwen3 drafter on a target without GQA dims (a DFlash drafter for a K3 target): all heads kv, hidden / heads
    heads = common["num_attention_heads"]
    return DrafterConfig(
        **common, num_target_layers=tc.num_hidden_layers,
        num_key_value_heads=m.num_kv_heads or getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=m.head_dim or getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        rope_theta=getattr(target, "rope_theta", 10000.0))


def _k3_fields(m, tc) -> dict:
    """MLA dims: the recipe's (when it has them), else the target's MLA dims, else DrafterConfig's defaults;
    q_lora_rank falls back to hidden_size // 2 (the drafter needs one; a target may have none)."""
    d = DrafterConfig.__dataclass_fields__
    dims = {k: getattr(m, k, None) or getattr(tc, k, None) or d[k].default
            for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    q_lora = getattr(m, "q_lora_rank", None) or getattr(tc, "q_lora_rank", None) or tc.hidden_size // 2
    return {**dims, "q_lora_rank": q_lora, "hidden_act": getattr(m, "hidden_act", None) or "silu",
            "logit_scale": float(getattr(m, "logit_scale", None) or 1.0)}


def block_targets(target_logits, input_ids, anchors, drafts: int, labels: str, with_logits: bool = True):
    """Per anchor a and draft d (predicting position a+1+d): the label and the target logits there ([B, A, D, V];
    None unless with_logits: only the terms that read the target's distribution need them)."""
    offs = anchors[..., None] + torch.arange(drafts, device=anchors.device)  # [B, A, D]: position a+d
    B = input_ids.shape[0]
    rows = torch.arange(B, device=anchors.device)[:, None, None]
    tl = target_logits[rows, offs] if with_logits else None  # [B, A, D, V]: target's distribution for a+d+1
    if labels == "target":
        lab = tl.argmax(-1) if tl is not None else target_logits.argmax(-1)[rows, offs]
    else:
        lab = input_ids[rows, offs + 1]
    return lab, tl


def target_for_training(target, recipe: DrafterRecipe, device):
    """The target that regenerates the sequences and gives the training features. mixed_precision=bf16: the target
    loaded again in bf16, as it is served (load_target keeps what each model keeps in fp32, e.g. K3's A_log), instead
    of an fp32 forward outside the drafter's autocast; the fp32 one is kept only for the drafter's embedding and LM
    head. Otherwise (no, fp16) the fp32 target as loaded."""
    if recipe.mixed_precision != "bf16":
        return target
    log.info("mixed_precision=bf16: the frozen target runs in bf16")
    return load_target(recipe.target, device=device, dtype="bfloat16").requires_grad_(False)


def train_drafter(recipe: DrafterRecipe) -> dict:
    if recipe.target_sharding == "fsdp" and recipe.data.regenerate.enabled:
        raise ValueError("target_sharding: fsdp cannot regenerate (one process would run the sharded target alone); "
                         "regenerate beforehand (e.g. vLLM: python -m serve --engine vllm) into data.dataset and set "
                         "data.regenerate.enabled=false")
    preflight(recipe)  # machine and output_dir, before any work
    read_config(recipe.target)  # the target dir exists and has a readable config.json
    torch.manual_seed(recipe.seed)
    accelerator = make_accelerator(recipe)
    shard = recipe.target_sharding == "fsdp" and accelerator.num_processes > 1  # 1 process: nothing to shard
    # a sharded target is loaded on the host and sharded layer by layer onto the devices (never whole on one GPU)
    target = load_target(recipe.target, device="cpu" if shard else accelerator.device)
    target.requires_grad_(False)
    tok = target.tokenizer
    check_chat_template(recipe, tok)
    cfg = drafter_config(recipe, target, tok)
    emb, head = target.model.embed_tokens.weight, target.lm_head.weight
    if shard:  # the drafter keeps whole copies of the frozen embedding and LM head; the target's get sharded
        emb, head = emb.detach().clone(), head.detach().clone()
    drafter = DSparkDrafter(cfg, emb, head)
    target = target_for_training(target, recipe, "cpu" if shard else accelerator.device)
    start_run(recipe, accelerator)  # overwrite=true clears the earlier run only now, with everything checked
    seqs: Sequences = load_sequences(recipe, target, tok, accelerator)  # regenerated by all processes, in parts
    if shard:
        shard_target(target, accelerator)
    D, A, ids = cfg.num_drafts, recipe.anchors_per_seq, cfg.target_layer_ids
    weights = LossWeights.from_recipe(recipe.loss)
    bs = recipe.optim.batch_size // accelerator.num_processes
    log.info("drafter (%s, block %d, %d layers, layer ids %s): %.2fM trainable params; %d train sequences",
             cfg.mode, cfg.block_size, cfg.num_hidden_layers, ids,
             sum(p.numel() for p in drafter.parameters()) / 1e6, len(seqs.train))

    mask = {"flex": True, "dense": False}.get(recipe.block_mask, accelerator.device.type == "cuda")

    def features(x):
        """x [B, T] -> the target's logits [B, T, V] and aux hidden states."""
        with torch.no_grad():
            return target(x, aux_layer_ids=ids)

    def step_loss(m, x, anchors, flex: bool):
        """-> (loss, metrics, accepted [B, A]): the target's features, the drafter's blocks, the loss."""
        return block_loss(m, x, *features(x), anchors, flex)

    def block_loss(m, x, logits, aux, anchors, flex: bool):
        """step_loss given the target's features of x."""
        lab, tl = block_targets(logits, x, anchors, D, recipe.data.labels, with_logits=weights.needs_target_logits)
        h = m(aux, x, anchors, flex=flex)  # through the DDP-wrapped module: synced grads
        # the loss under the drafter's autocast too: its LM-head GEMM over the vocabulary (the largest of the step)
        # in bf16 under mixed precision, its softmaxes and reductions in fp32 as autocast keeps them
        with torch.autocast(accelerator.device.type, torch.bfloat16, enabled=recipe.mixed_precision == "bf16"):
            return drafter_loss(accelerator.unwrap_model(m), h, x.gather(1, anchors), lab, tl, weights)

    # compile: one graph for the training step's forward, one for its backward; the holdout's no-grad pass stays
    # eager (a few batches per eval, and inductor's no-grad graph of this step faulted on CUDA)
    train_loss = torch.compile(step_loss) if recipe.compile else step_loss

    def forward(m, x, anchors, flex=None, loss_fn=train_loss):
        x, anchors = to_device(x, accelerator.device), to_device(anchors, accelerator.device)
        return loss_fn(m, x, anchors, mask if flex is None else flex)

    starts = None
    if recipe.anchors == "rejection":
        starts = DecodeStarts(len(seqs.train), seqs.train.shape[1], recipe.rejection_share, accelerator.device)
        accelerator.register_for_checkpointing(starts)  # a resume continues with the same starts

    def loss_step(m, step):
        """Rows and anchors are drawn for the global batch, then sliced per process: N processes see exactly the
        blocks one process would (data parallel == single process with the same global batch)."""
        g = step_generator(recipe.seed, step)
        idx = rows_for_step(len(seqs.train), step, recipe.optim.batch_size, recipe.seed, recipe.data.order, g)
        if starts is None:
            anchors = sample_anchors(seqs.train_mask[idx], A, D, g)
        else:
            anchors = starts.sample(idx, seqs.train_mask[idx], A, D, g)
        mine = slice(accelerator.process_index * bs, (accelerator.process_index + 1) * bs)
        loss, metrics, accepted = forward(m, seqs.train[idx][mine], anchors[mine])
        if starts is not None:
            starts.update(idx, anchors, accelerator.gather(accepted) if accelerator.num_processes > 1 else accepted)
        return loss, metrics

    if mask and recipe.block_mask == "auto":  # compile flex once (forward + backward) before training relies on it
        mask = _flex_compiles(lambda: forward(drafter, seqs.train[:bs], sample_anchors(
            seqs.train_mask[:bs], A, D, torch.Generator().manual_seed(0)), flex=True)[0], drafter, accelerator)

    def evaluate(m):
        g = torch.Generator().manual_seed(12345)
        anchors = sample_anchors(seqs.holdout_mask, A, D, g)
        out = [forward(m, seqs.holdout[i:i + bs], anchors[i:i + bs], loss_fn=step_loss)[1]
               for i in range(0, len(seqs.holdout), bs)]
        vals = torch.stack([torch.stack(list(o.values())) for o in out]).tolist()  # one read: [chunks][metrics]
        ev = {k: sum(v[j] for v in vals) / len(vals) for j, k in enumerate(out[0])}
        # tau_walked: the τ a greedy decode of the first WALKED_ROWS holdout rows gets (every anchor drafted, then
        # the blocks its walk visits); below tau, whose uniform anchors count each position of an easy stretch
        rows, every = seqs.holdout[:WALKED_ROWS], every_anchor(seqs.holdout_mask[:WALKED_ROWS], D)

        def prepare(x):  # the target once per chunk of rows: (x, logits, aux)
            x = to_device(x, accelerator.device)
            return x, *features(x)

        accepted_of = lambda xf, a: block_loss(m, *xf, to_device(a, accelerator.device), mask)[2]  # noqa: E731
        acc = accepted_in_chunks(prepare, accepted_of, rows, every, bs, A)
        walked = walked_accepted(every, acc)
        return {**ev, "tau_walked": 1 + sum(walked) / max(len(walked), 1)}

    def save_final(m, path: Path):
        export_drafter(m, path, layout=recipe.export.layout or cfg.mode, tokenizer=tok)

    return run(recipe, LoopSpec(drafter, loss_step, evaluate, save_final, extra_modules=[target],
                                info={"block_mask": "flex" if mask else "dense",
                                      "target_sharding": "fsdp" if shard else "none"}), accelerator)


def shard_target(target, accelerator) -> None:
    """target_sharding=fsdp: FSDP2 `fully_shard` of the frozen target over the data-parallel processes, one unit per
    decoder layer plus the root (embedding, final norm, LM head). Each process holds 1/N of the target and its forward
    all-gathers one layer at a time (every process runs the same forwards: training, evals, the flex probe)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    for layer in target.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(target, mesh=mesh)
    log.info("target sharded with FSDP over %d processes", accelerator.num_processes)


def _flex_compiles(loss_fn, drafter, accelerator) -> bool:
    """block_mask=auto on CUDA: one flex forward + backward; if the compiled kernel fails on this GPU / torch, train
    with the dense SDPA mask instead (a warning says why). All processes agree (any failure -> dense)."""
    drafter.to(accelerator.device)
    try:
        with accelerator.autocast():  # the dtype training will use (bf16 under mixed precision)
            loss = loss_fn()
        loss.backward()
        ok = 1.0
    except Exception as e:  # inductor lowering / Triton resource errors
        log.warning("block_mask=auto: flex attention failed on this device (%s: %s); using the dense SDPA mask",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        ok = 0.0
    drafter.zero_grad(set_to_none=True)
    ok = float(accelerator.reduce(torch.tensor(ok, device=accelerator.device), reduction="sum"))
    return ok == accelerator.num_processes
