"""The one training loop (targets and drafters): accelerate for devices/precision/data parallel, AdamW (or Muon for
the hidden matrices, train.optim) with warmup + cosine, tqdm, wandb (offline unless configured), periodic resumable
checkpoints, holdout evals."""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from train.optim import build_optimizers
from train.outputs import latest_checkpoint
from train.sync import wait_for_everyone

log = logging.getLogger(__name__)


@dataclass
class LoopSpec:
    """What differs between a target run and a drafter run."""

    model: torch.nn.Module  # the trainable module
    loss_step: Callable[[torch.nn.Module, int], tuple[torch.Tensor, dict]]  # (model, step) -> (loss, metrics)
    evaluate: Callable[[torch.nn.Module], dict]  # holdout metrics
    save_final: Callable[[torch.nn.Module, Path], None]
    extra_modules: list = field(default_factory=list)  # frozen modules moved to the device (e.g. the target)
    info: dict = field(default_factory=dict)  # facts about the run added to final_metrics.json (e.g. block_mask)


def out_of_time(max_minutes: float | None, t_budget: float | None, accelerator) -> bool:
    """max_minutes passed since t_budget on any process: one decision for all of them. Each process reads its own
    clock, and a process that stopped one step before the others would leave them waiting in that step's gradient
    all-reduce."""
    if max_minutes is None or t_budget is None:  # the same on every process
        return False
    over = (time.time() - t_budget) / 60 > max_minutes
    if accelerator.num_processes > 1:
        flag = torch.tensor(float(over), device=accelerator.device)
        over = accelerator.reduce(flag, reduction="sum").item() > 0
    return over


class Deadline:
    """max_minutes in the loop: out_of_time's one decision for all processes, without a host sync per step. With
    several processes each step all-reduces the processes' clock flags and the loop reads the flag of two steps
    earlier (complete by then; reading this step's would make the host wait for the device every step). Every process
    reads the same flags at the same step, so all stop together, at most two steps after the first clock passed."""

    def __init__(self, max_minutes: float | None, accelerator):
        self.max_minutes, self.accelerator, self.flags = max_minutes, accelerator, []

    def passed(self, t_budget: float | None) -> bool:
        acc = self.accelerator
        if self.max_minutes is None or t_budget is None or acc.num_processes == 1:
            return out_of_time(self.max_minutes, t_budget, acc)
        over = (time.time() - t_budget) / 60 > self.max_minutes
        flag = torch.full((), float(over), device=acc.device)  # a fill, not a host->device copy (which syncs)
        self.flags.append(acc.reduce(flag, reduction="sum"))
        return len(self.flags) > 2 and self.flags.pop(0).item() > 0


def make_accelerator(recipe):
    from accelerate import Accelerator

    cpu = recipe.device == "cpu" or (recipe.device == "auto" and not torch.cuda.is_available())
    if recipe.num_threads:
        torch.set_num_threads(recipe.num_threads)
    return Accelerator(cpu=cpu, mixed_precision=recipe.mixed_precision,
                       gradient_accumulation_steps=recipe.optim.grad_accum)


def run(recipe, spec: LoopSpec, accelerator) -> dict:
    """Train spec.model per recipe.optim/log; returns the final metrics. Resumes when recipe.resume."""
    out = Path(recipe.output_dir)
    ckpt_root = out / "checkpoints"
    oc = recipe.optim
    model = spec.model
    opts, scheds = build_optimizers(model, oc, recipe.max_steps)
    model, *opts = accelerator.prepare(model, *opts)
    for sched in scheds:
        accelerator.register_for_checkpointing(sched)
    for m in spec.extra_modules:
        m.to(accelerator.device)

    start_step, history, best = 0, [], None
    if recipe.resume:  # train.outputs.check_output_dir has matched the recipe with the checkpoint's
        last = latest_checkpoint(ckpt_root)
        if last is None:
            log.warning("resume=true but no checkpoint under %s: starting from step 0", ckpt_root)
        else:
            try:
                accelerator.load_state(str(last))
            except (RuntimeError, KeyError, ValueError) as e:  # e.g. a checkpoint that recorded no recipe
                raise ValueError(f"resume: the checkpoint {last} does not fit this recipe's model or optimizer "
                                 f"({str(e).splitlines()[0][:300]}); resume with the recipe it was trained with, or "
                                 "set overwrite=true to start over") from None
            state = json.loads((last / "trainer_state.json").read_text())
            start_step, history, best = state["step"], state.get("history", []), state.get("best")
            log.info("resumed from %s (step %d)", last, start_step)
    step_log = None
    if accelerator.is_main_process:  # one line per step: the loss averaged over all processes (the global batch)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "train_log.jsonl"
        kept = [ln for ln in (path.read_text().splitlines() if path.is_file() else [])
                if json.loads(ln)["step"] <= start_step]  # a resumed run rewrites the steps after its checkpoint
        path.write_text("".join(ln + "\n" for ln in kept))
        step_log = open(path, "a")

    wandb_run = _init_wandb(recipe, accelerator)
    # max_minutes counts from the end of this run's first step: that step compiles and autotunes (fla's KDA kernels
    # took 256 s of it on a fresh H200), a one-off that would otherwise eat a short run's budget
    t0, metrics, step = time.time(), {}, start_step
    t_budget, prof, deadline = None, None, Deadline(recipe.max_minutes, accelerator)
    pending = None  # the last step's (step, loss, metrics, seconds, lr): read once the next step is queued

    def record(step_, loss_, values, seconds, lr) -> dict:
        """One step's line in train_log.jsonl, the bar and wandb; its tensors read in one device->host copy."""
        out = _read_values({"loss": loss_, "lr": lr, **values})
        if step_log is not None:
            step_log.write(json.dumps({"step": step_, "loss": out["loss"], "seconds": seconds}) + "\n")
            step_log.flush()
        bar.set_postfix(loss=f"{out['loss']:.3f}")
        if step_ % recipe.log.log_every == 0 and wandb_run is not None:
            wandb_run.log({f"train/{k}": v for k, v in out.items()}, step=step_)
        return out

    bar = tqdm(total=recipe.max_steps, initial=start_step, desc=f"train {Path(recipe.output_dir).name}",
               disable=not accelerator.is_main_process, dynamic_ncols=True)
    model.train()
    while step < recipe.max_steps:
        if deadline.passed(t_budget):
            log.info("max_minutes=%s reached at step %d", recipe.max_minutes, step)
            break
        for micro in range(oc.grad_accum):
            with accelerator.accumulate(model):
                loss, step_metrics = spec.loss_step(model, step * oc.grad_accum + micro)
                accelerator.backward(loss)
                if accelerator.sync_gradients and oc.grad_clip > 0:
                    accelerator.clip_grad_norm_(model.parameters(), oc.grad_clip)
                for opt in opts:
                    opt.step()
                for sched in scheds if accelerator.sync_gradients else ():
                    sched.step()
                for opt in opts:
                    opt.zero_grad(set_to_none=True)
        hook = getattr(accelerator.unwrap_model(model), "on_step_end", None)
        if hook is not None:
            hook()
        step += 1
        if t_budget is None:
            t_budget = time.time()
            log.info("first step took %.1f s (compile, autotune); max_minutes counts from here", t_budget - t0)
            if recipe.log.profile_steps and accelerator.is_main_process:
                prof = _StepProfile(accelerator.device, step + 1, recipe.log.profile_steps)
        elif prof is not None and prof.done(step, out):
            prof = None
        # the step's loss and metrics stay on the device until the next step is queued: reading them now would make
        # the host wait for this step before it can prepare the next one
        global_loss = accelerator.reduce(loss.detach().float(), reduction="mean")
        if pending is not None:
            metrics = record(*pending)
        pending = (step, global_loss, step_metrics, time.time() - t0, scheds[0].get_last_lr()[0])
        bar.update(1)
        evaluate_now = step % recipe.log.eval_every == 0 or step == recipe.max_steps
        if evaluate_now or step % recipe.log.save_every == 0:  # the log is complete up to an eval or checkpoint
            metrics, pending = record(*pending), None
        if evaluate_now:
            ev = _evaluate(spec, model, accelerator)
            history.append({"step": step, "minutes": (time.time() - t0) / 60, **ev})
            bar.write(f"step {step}: " + " ".join(f"{k}={v:.4f}" for k, v in ev.items()))
            if wandb_run is not None:
                wandb_run.log({f"holdout/{k}": v for k, v in ev.items()}, step=step)
            if recipe.log.keep_best:
                best = _keep_best(recipe, spec, model, accelerator, ev, step, best)
        if step % recipe.log.save_every == 0 and step < recipe.max_steps:
            _save_checkpoint(accelerator, ckpt_root, step, {"history": history, "best": best,
                                                            "recipe": asdict(recipe)})
    if pending is not None:  # stopped by max_minutes
        metrics = record(*pending)
    bar.close()
    if prof is not None:  # training ended before the last profiled step
        prof.done(step, out, end=True)
    if step_log is not None:
        step_log.close()
    if not history or history[-1]["step"] != step:
        history.append({"step": step, "minutes": (time.time() - t0) / 60, **_evaluate(spec, model, accelerator)})
        if recipe.log.keep_best:
            best = _keep_best(recipe, spec, model, accelerator, history[-1], step, best)
    wait_for_everyone(accelerator)
    summary = {"steps": step, "train_minutes": (time.time() - t0) / 60, "final": history[-1], "history": history,
               "last_train_metrics": metrics, "num_processes": accelerator.num_processes, **spec.info}
    if best is not None:
        summary["best"] = best
    if accelerator.is_main_process:
        spec.save_final(accelerator.unwrap_model(model), out / "final")
        (out / "final_metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
        (out / "recipe.json").write_text(json.dumps(asdict(recipe), indent=2) + "\n")
    if wandb_run is not None:
        wandb_run.summary.update({f"final/{k}": v for k, v in history[-1].items()})
        wandb_run.finish()
    accelerator.end_training()  # data parallel: destroys the process group, so no process exits mid-teardown
    return summary


def _read_values(values: dict) -> dict:
    """The tensor values (0-d) as floats, read in one device->host copy; other values kept as they are."""
    keys = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    if not keys:
        return values
    got = torch.stack([values[k].detach().float().reshape(()) for k in keys]).tolist()
    return {**values, **dict(zip(keys, got))}


def _evaluate(spec: LoopSpec, model, accelerator) -> dict:
    model.eval()
    with torch.no_grad():
        ev = spec.evaluate(accelerator.unwrap_model(model))
    model.train()
    return ev


class _StepProfile:
    """log.profile_steps: torch.profiler over the n steps after the first (which compiles), on this process; after
    the last of them (or at the end of training), <output_dir>/profile.txt gets the wall ms per step and the top ops
    by device (else host) time."""

    def __init__(self, device: torch.device, first_step: int, n: int):
        from torch.profiler import ProfilerActivity, profile

        self.cuda, self.first, self.last = device.type == "cuda", first_step, first_step + n - 1
        self.prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else []))
        self.prof.__enter__()
        self.t0 = time.time()

    def done(self, step: int, out: Path, end: bool = False) -> bool:
        """Call after each step (end: training stopped); True once the profiler is closed."""
        if step < self.last and not end:
            return False
        if step < self.first:  # ended before any profiled step: nothing to write
            self.prof.__exit__(None, None, None)
            return True
        if self.cuda:
            torch.cuda.synchronize()
        n = step - self.first + 1
        ms = (time.time() - self.t0) * 1e3 / max(1, n)
        self.prof.__exit__(None, None, None)
        table = self.prof.key_averages().table(sort_by="cuda_time_total" if self.cuda else "cpu_time_total",
                                               row_limit=30)
        (out / "profile.txt").write_text(f"{ms:.1f} ms per step (wall, steps {self.first}-{step}, profiler on)\n"
                                         f"{table}\n")
        log.info("profile of steps %d-%d (%.1f ms each) in %s", self.first, step, ms, out / "profile.txt")
        return True


def _keep_best(recipe, spec: LoopSpec, model, accelerator, ev: dict, step: int, best: dict | None) -> dict:
    """log.keep_best: when this evaluation's value of the metric beats every earlier one, the model goes to
    <output_dir>/best (written to a temp dir, then renamed). -> {"step", metric: value} of the best so far."""
    name = recipe.log.keep_best
    if name not in ev:
        raise ValueError(f"log.keep_best: {name!r} is not a holdout metric of this run; it has {', '.join(ev)}")
    sign = 1.0 if name == "tau" else -1.0  # tau: higher is better; ce, loss: lower
    if best is not None and sign * ev[name] <= sign * best[name]:
        return best
    if accelerator.is_main_process:
        out = Path(recipe.output_dir)
        tmp = out / ".best.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        spec.save_final(accelerator.unwrap_model(model), tmp)
        shutil.rmtree(out / "best", ignore_errors=True)
        os.replace(tmp, out / "best")
    wait_for_everyone(accelerator)
    return {"step": step, name: ev[name]}


def _save_checkpoint(accelerator, ckpt_root: Path, step: int, state: dict) -> None:
    """accelerate state (model, optimizer, scheduler, RNG) into a temp dir, renamed when complete; keep 2."""
    final = ckpt_root / f"step-{step}"
    tmp = ckpt_root / f".step-{step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    wait_for_everyone(accelerator)
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **state}) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(ckpt_root.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
    wait_for_everyone(accelerator)


def _init_wandb(recipe, accelerator):
    if recipe.log.wandb_mode == "disabled" or not accelerator.is_main_process:
        return None
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    mode = recipe.log.wandb_mode
    if mode == "online" and not (os.environ.get("WANDB_API_KEY") or Path.home().joinpath(".netrc").exists()):
        log.warning("wandb_mode=online but wandb is not configured (no WANDB_API_KEY): logging offline")
        mode = "offline"
    Path(recipe.output_dir).mkdir(parents=True, exist_ok=True)
    return wandb.init(project=recipe.log.wandb_project, name=Path(recipe.output_dir).name, mode=mode,
                      dir=recipe.output_dir, config=asdict(recipe), reinit="finish_previous")
