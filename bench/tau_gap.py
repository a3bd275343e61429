"""Why the trainer's holdout τ is above the engine's τ on the same text: anchor selection, not a train/serve mismatch.

    python bench/tau_gap.py --target runs/quickstart/target/final --drafter runs/quickstart/drafter/final \
        --sequences runs/quickstart/drafter/sequences.pt [--n 16] [--device cuda --dtype bfloat16]
                                                         (CPU, ~10 s for the quickstart pair)

On the drafter's regenerated holdout sequences (prompt + the target's own greedy continuation; labels = the target's
argmax), τ (mean accepted drafts + 1 per block) three ways, and the walked one over a task's decode length (--head):
  uniform   the training pass (train_forward, teacher-forced Markov head) at every anchor of the continuation, each
            block counted: what the trainer's holdout metric estimates (it samples anchors uniformly)
  walked    the same per-anchor accepted counts, but visiting only the anchors a greedy speculative decode visits
            (start after the prompt, next anchor = anchor + accepted + 1)
  engine    dspark.Engine generating from the prompt with every step verifying the whole block (k pinned: the
            drafter's τ; checked token-for-token against the stored continuation); --policy adds the engine with its
            k policy (the served default: on a GPU it verifies fewer drafts where that pays, which caps τ)
engine == walked means the serving path drafts exactly what training measures; uniform > walked is selection: a
decode step starts right after a rejection, where the text is harder than at a random position. The continuations'
4-gram repeat share (eval.measure.repeat_share) says how much of them loops, which a drafter accepts easily; the
share of blocks whose first draft is accepted, at uniform and at walked anchors, says how much harder a decode's
starts are; uniform anchors weighted by 1 / (accepted + 1) (the share of positions a block covers, as a walk passes
an easy stretch in one block) show how much of uniform > walked is that counting alone. Beside
a task's τ from `python -m eval` on the same pair (its report has the outputs' repeat share too), walked τ over the
task's decode length against the task's τ is what the prompts themselves change.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark import Engine, SamplingParams, load_drafter, load_target  # noqa: E402
from dspark.device import resolve_device, resolve_dtype  # noqa: E402
from dspark.policy import REPICK_EVERY  # noqa: E402
from dspark.spec.draft import sample_markov  # noqa: E402
from eval.measure import repeat_share  # noqa: E402
from train.anchors import decode_walk  # noqa: E402


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--sequences", required=True, help="the drafter run's sequences.pt (holdout + holdout_mask)")
    ap.add_argument("--n", type=int, default=16, help="holdout sequences used")
    ap.add_argument("--head", type=int, default=96, help="also τ walked over the blocks that start within the first "
                    "this many continuation tokens (a task's decode length)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, auto")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on a GPU, float32 on CPU")
    ap.add_argument("--eager", action="store_true", help="also decode with an engine without CUDA graphs")
    ap.add_argument("--policy", action="store_true", help="also decode with the engine's k policy (not pinned)")
    a = ap.parse_args()
    torch.set_num_threads(2)
    device = resolve_device(a.device, "--device")
    t = load_target(a.target, device=device, dtype=resolve_dtype(a.dtype, device, "--dtype"))
    d = load_drafter(a.drafter, t)
    s = torch.load(a.sequences, weights_only=False)
    rows, masks = s["holdout"][: a.n], s["holdout_mask"][: a.n]
    D = d.config.num_drafts
    uniform, walked, head, repeats, prompts, walks = [], [], [], [], [], []
    for row, mask in zip(rows, masks):
        P = int(mask.float().argmax())  # first continuation position = prompt length
        T = int(mask.sum()) + P
        prompts.append(row[:P].tolist())
        x = row[None, :T].to(device)
        logits, aux = t(x, aux_layer_ids=d.config.target_layer_ids)
        lab = logits[0].argmax(-1)  # lab[p]: the target's token at p + 1
        anchors = torch.arange(P, T - D, device=x.device)
        h = d.train_forward(aux, x, anchors[None])[0]  # [A, D, H]
        drafts = sample_markov(d, h, x[0, anchors]).draft_ids
        want = lab[anchors[:, None] + torch.arange(D, device=x.device)]  # [A, D]: the target's tokens per block
        acc = (drafts == want).long().cumprod(1).sum(1).tolist()
        uniform += acc
        steps = decode_walk(dict(zip(anchors.tolist(), acc)), P)
        walked += [n for _, n in steps]
        walks.append([n for _, n in steps])
        head += [n for p, n in steps if p - P < a.head]
        repeats.append(repeat_share(row[P:T].tolist()))  # the stored continuation
    n_new = min(int(m.sum()) for m in masks) - 1
    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    stored = [r[len(p):len(p) + n_new].tolist() for r, p in zip(rows, prompts)]
    outs = Engine(t, d, num_speculative_tokens=D).generate(prompts, params)
    print(f"holdout rows: prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, {n_new} new tokens each")
    eng = [x for o in outs for x in o.accepted_per_step]
    same = sum(o.token_ids == want for o, want in zip(outs, stored))
    print(f"| sequences | block drafts | τ uniform anchors (trainer) | τ walked anchors | τ walked, first {a.head} "
          f"tokens | τ engine | engine == stored continuation | 4-gram repeats |\n|--:|--:|--:|--:|--:|--:|--:|--:|\n"
          f"| {len(rows)} | {D} | {tau(uniform):.3f} | {tau(walked):.3f} | {tau(head):.3f} | {tau(eng):.3f} | "
          f"{same}/{len(rows)} | {sum(repeats) / len(repeats):.1%} |")
    first = lambda xs: sum(x > 0 for x in xs) / len(xs)  # share of blocks whose first draft is accepted
    print(f"first draft accepted: uniform anchors {first(uniform):.1%}, walked anchors {first(walked):.1%}; "
          f"τ at uniform anchors weighted by 1 / (accepted + 1): {len(uniform) / sum(1 / (x + 1) for x in uniform):.3f}")
    print(same_text("engine", outs, stored, walks))
    if a.eager:
        outs = Engine(t, d, num_speculative_tokens=D, graphs=False).generate(prompts, params)
        print(f"engine without CUDA graphs: τ {tau([x for o in outs for x in o.accepted_per_step]):.3f}; "
              + same_text("it", outs, stored, walks))
    if a.policy:
        engine = Engine(t, d)
        outs = engine.generate(prompts, params)
        ks = {}
        for (_, k, _, _), n in engine.policy.choices_made.items():
            ks[k] = ks.get(k, 0) + n
        print(f"engine with its k policy: τ {tau([x for o in outs for x in o.accepted_per_step]):.3f} (choices of k, "
              f"each reused up to {REPICK_EVERY} steps: {dict(sorted(ks.items()))}); "
              + same_text("it", outs, stored, walks))


def tau(accepted: list[int]) -> float:
    """Mean accepted drafts + 1 per block."""
    return 1 + sum(accepted) / len(accepted)


def same_text(name: str, outs, stored: list[list[int]], walks: list[list[int]]) -> str:
    """On the rows an engine reproduced (the same text), its steps against the walk's: serving drafts what training
    measures when every step accepts what the walk's block at that anchor did (bf16 rounds a few near-ties apart)."""
    pairs = [(o.accepted_per_step, w) for o, want, w in zip(outs, stored, walks) if o.token_ids == want]
    if not pairs:
        return f"{name} reproduced no stored continuation"
    # the walk stops D tokens before the end; an engine's last step stops at max_tokens
    steps = [(e, w) for eng, walk in pairs for e, w in zip(eng[:-1], walk)]
    return (f"on the {len(pairs)} rows {name} reproduced: τ engine {tau([e for e, _ in steps]):.3f} against walked "
            f"{tau([w for _, w in steps]):.3f} over their first {len(steps)} steps, {sum(e == w for e, w in steps)} "
            f"of them accepting as many drafts as the walk")


if __name__ == "__main__":
    main()
