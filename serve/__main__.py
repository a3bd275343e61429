"""python -m serve --target DIR [--drafter DIR] [--host 127.0.0.1] [--port 8000] [--engine ours|vllm] ...

`--engine ours` (default): the OpenAI-compatible server over dspark.Engine (serve/app.py).
`--engine vllm`: print the equivalent vLLM command (env first, shell-quoted) and exec it; `--dry-run` only prints.
`--recipe FILE` reads the recipe's `serve:` section (keys in serve/vllm.py); flags given on the command line win.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serve", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target checkpoint dir (HF layout, with tokenizer)")
    p.add_argument("--drafter", help="drafter dir (vLLM dspark or dflash layout); omit for plain decoding")
    p.add_argument("--host", default=None, help="default 127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default 8000")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="default: the drafter's block")
    p.add_argument("--max-batch-size", type=int, default=32, help="engine batch slots (ours)")
    p.add_argument("--max-concurrent", type=int, default=64, help="open requests before answering 429 (ours)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the target's max_position_embeddings")
    p.add_argument("--adaptive-verification", action="store_true", help="verify as many drafts as the confidence "
                   "head suggests")
    p.add_argument("--draft-top-k", type=int, default=None, help="Markov term over the top-k base candidates only")
    p.add_argument("--served-model-name", default=None, help="default: the target dir's name")
    p.add_argument("--engine", choices=("ours", "vllm"), default="ours")
    p.add_argument("--tensor-parallel-size", type=int, default=None, help="vllm only (ours runs on one device)")
    p.add_argument("--enable-prefix-caching", action="store_true", help="vllm only")
    p.add_argument("--recipe", default=None, help="recipe YAML with a serve: section (e.g. recipes/k3.yaml)")
    p.add_argument("--device", default="cpu", help="ours: cpu or cuda")
    p.add_argument("--dtype", default="float32", help="ours: float32 or bfloat16")
    p.add_argument("--dry-run", action="store_true", help="vllm: print the command only; ours: load and exit")
    return p.parse_args(argv)


def _check_dir(path: str, what: str) -> None:
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"--{what} {path!r}: not a directory")
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"--{what} {path!r}: no config.json (expected an HF-style checkpoint dir)")


def _run_ours(args) -> int:
    import uvicorn

    from serve import load_server
    from serve.vllm import load_serve_section

    sec = load_serve_section(args.recipe) if args.recipe else {}
    if (args.tensor_parallel_size or 1) > 1:
        raise ValueError("--tensor-parallel-size: the dspark engine runs on one device; use --engine vllm")
    pick = lambda flag, key, default=None: flag if flag is not None else sec.get(key, default)  # noqa: E731
    app = load_server(args.target, args.drafter, num_speculative_tokens=pick(args.num_speculative_tokens,
                      "num_speculative_tokens"), max_batch_size=args.max_batch_size,
                      max_model_len=pick(args.max_model_len, "max_model_len"),
                      adaptive_verification=args.adaptive_verification or bool(sec.get("adaptive_verification")),
                      draft_top_k=pick(args.draft_top_k, "draft_top_k", 0) or 0,
                      served_model_name=pick(args.served_model_name, "served_model_name"),
                      max_concurrent=args.max_concurrent, device=args.device, dtype=args.dtype)
    cfg, eng = app.state.cfg, app.state.runner.engine
    host, port = pick(args.host, "host", "127.0.0.1"), int(pick(args.port, "port", 8000))
    print(f"serving {cfg.served_model_name!r} on http://{host}:{port}/v1 (k={eng.k}, max_model_len="
          f"{eng.max_model_len}, max_batch_size={eng.max_batch_size}, max_concurrent={cfg.max_concurrent})",
          flush=True)
    if args.dry_run:
        app.state.runner.stop()
        return 0
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        app.state.runner.stop()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        _check_dir(args.target, "target")
        if args.drafter is not None:
            _check_dir(args.drafter, "drafter")
        if args.engine == "vllm":
            from serve.vllm import main as vllm_main

            return vllm_main(args)
        return _run_ours(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
