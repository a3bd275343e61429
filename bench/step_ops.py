"""Kernel launches per static decode step, counted on CPU: the launch-bound cost model of a tiny pair on the GPU.

    python bench/step_ops.py [--target-recipe recipes/targets/k3-mini.yaml] [--drafter-recipe recipes/k3-mini.yaml]
        [--interpret]     # TRITON_INTERPRET=1: the K3 kernels (KDA step, AttnRes mix, Markov loop) run as on CUDA

Builds the recipes' target and drafter with random weights (fp32, CPU), prefills a 64-token prompt on the static
path (dspark/static_spec.py) and runs one AR step and one speculative step under a TorchDispatchMode that counts
every aten op that launches work (views, reshapes and other metadata ops are free), plus every Triton launch.
Each op is charged to the innermost module class (or step phase) that issued it. On a GPU a CUDA graph replays the
same ops, one kernel each (a few µs each on an H200 when the tensors are tiny), so the ratio of the two columns is
the step-cost ratio of a launch-bound pair.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FREE = {"view", "_unsafe_view", "slice", "select", "expand", "t", "transpose", "permute", "unsqueeze", "squeeze",
        "as_strided", "alias", "detach", "lift_fresh", "unbind", "split", "split_with_sizes", "chunk", "narrow",
        "_reshape_alias", "view_as_real", "view_as_complex", "diagonal", "unfold", "empty", "empty_like",
        "empty_strided", "new_empty", "new_empty_strided", "size", "stride",
        "sym_size", "is_same_size", "_local_scalar_dense", "item", "result_type", "dim", "numel"}


ACTIVE: list[Counter] = []  # the Counter now counting (Triton launches are charged to it)


class Counter(TorchDispatchMode):
    def __init__(self, stack):
        super().__init__()
        self.stack, self.ops = stack, collections.Counter()
        self.names = collections.defaultdict(collections.Counter)

    def __enter__(self):
        ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        ACTIVE.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if self.stack and self.stack[-1].endswith("_triton"):  # inside a Triton launcher: one launch, counted there
            return func(*args, **(kwargs or {}))
        if name not in FREE:
            where = self.stack[-1] if self.stack else "step"
            self.ops[where] += 1
            self.names[where][name] += 1
        return func(*args, **(kwargs or {}))


def label_modules(model: torch.nn.Module, stack: list, prefix: str) -> None:
    """Forward pre/post hooks push / pop `prefix.ClassName` (innermost module wins)."""
    for m in model.modules():
        if m is model:
            continue
        lbl = f"{prefix}.{type(m).__name__}"
        m.register_forward_pre_hook(lambda mod, inp, lbl=lbl: stack.append(lbl))
        m.register_forward_hook(lambda mod, inp, out: stack.pop() and None)  # None: keep the output


LAUNCHES = {"kda_decode_triton": 2}  # Triton launches per launcher call (the delta rule, then the gated norm)


def label_functions(stack: list, table: dict) -> None:
    """Wrap module-level functions {module: [names]} so their ops (and Triton launches) are charged to them."""
    for mod, names in table.items():
        for n in names:
            fn = getattr(mod, n)

            def wrapped(*a, __fn=fn, __n=n, **k):
                if __n.endswith("_triton") and ACTIVE:
                    ACTIVE[-1].ops[__n] += LAUNCHES.get(__n, 1)
                    ACTIVE[-1].names[__n]["launch"] += LAUNCHES.get(__n, 1)
                stack.append(__n)
                try:
                    return __fn(*a, **k)
                finally:
                    stack.pop()

            setattr(mod, n, wrapped)


def build(target_recipe: str, drafter_recipe: str):
    import yaml
    from transformers import PreTrainedTokenizerFast

    from dspark.config import load_recipe
    from dspark.models.drafter import DSparkDrafter
    from train.drafter import drafter_config
    from train.target import build_target

    tr = yaml.safe_load(open(target_recipe))
    tok = PreTrainedTokenizerFast.from_pretrained(tr["data"]["tokenizer_dir"])
    torch.manual_seed(0)
    target = build_target(tr.get("arch", "qwen3"), tr["model"], tok).eval()
    recipe = load_recipe(drafter_recipe)
    cfg = drafter_config(recipe, target, tok)
    drafter = DSparkDrafter(cfg, target.model.embed_tokens.weight, target.lm_head.weight).eval()
    return target, drafter


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target-recipe", default="recipes/targets/k3-mini.yaml")
    ap.add_argument("--drafter-recipe", default="recipes/k3-mini.yaml")
    ap.add_argument("--interpret", action="store_true", help="run the Triton kernels (interpreter), as on CUDA")
    ap.add_argument("--top", type=int, default=6, help="op names listed per row")
    a = ap.parse_args()
    if a.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
    torch.set_num_threads(2)
    from dspark import static_spec
    from dspark.kernels import attn_res, decode_gemv, kda_decode, markov_sample
    from dspark.models.k3.moe import set_static_moe
    from dspark.static_spec import StaticGenerator

    target, drafter = build(a.target_recipe, a.drafter_recipe)
    stack: list[str] = []
    label_modules(target, stack, "target")
    label_modules(drafter, stack, "drafter")
    # the launchers are looked up in their modules at call time, so wrapping them there counts every launch
    label_functions(stack, {attn_res: ["attn_res_mix_triton"], kda_decode: ["kda_decode_triton"],
                            markov_sample: ["markov_sample_triton"], decode_gemv: ["grouped_gemv_triton"],
                            static_spec: ["propose_static", "verify_greedy"]})
    prompt = torch.randint(10, target.config.vocab_size, (64,)).tolist()
    rows = {}
    for mode, d in (("AR", None), ("DSpark", drafter)):
        gen = StaticGenerator(target, d, max_len=256)
        gen.generate(prompt, 4)  # prefill + a few steps (anything lazy happens here)
        set_static_moe(target, gen.moe_tokens)  # generate() sets it for its own calls only
        with Counter(stack) as c:
            gen.step.run()
        set_static_moe(target, 0)
        rows[mode] = c
    labels = sorted(set(rows["AR"].ops) | set(rows["DSpark"].ops), key=lambda x: -rows["DSpark"].ops[x])
    print("| where | AR step ops | DSpark step ops | top ops (DSpark) |\n|---|--:|--:|---|")
    for lbl in labels:
        top = ", ".join(f"{n} {k}" for n, k in rows["DSpark"].names[lbl].most_common(a.top))
        print(f"| {lbl} | {rows['AR'].ops[lbl]} | {rows['DSpark'].ops[lbl]} | {top} |")
    ar, ds = sum(rows["AR"].ops.values()), sum(rows["DSpark"].ops.values())
    print(f"| **total** | **{ar}** | **{ds}** | DSpark / AR = {ds / ar:.2f} |")


if __name__ == "__main__":
    main()
