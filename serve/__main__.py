"""python -m serve --target DIR [--drafter DIR] [--host 127.0.0.1] [--port 8000] [--engine ours|vllm] ...

`--engine ours` (default): the OpenAI-compatible server over dspark.Engine (serve/app.py).
`--engine vllm`: print the equivalent vLLM command (env first, shell-quoted) and exec it; `--dry-run` only prints.
`--recipe FILE` reads the recipe's `serve:` section (keys in serve/vllm.py); flags given on the command line win.
Every option is checked before any model loads; a bad one is a one-line error and exit status 2.
"""
from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from dspark.device import DTYPES, resolve_device, resolve_dtype
from dspark.fields import check_int
from serve import check_max_model_len, load_server, shutdown, target_positions
from serve.engine_proc import SWITCH_INTERVAL_S
from serve.runner import EngineInfo
from serve.vllm import load_serve_section

log = logging.getLogger("serve")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line (argparse would print the usage first)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(prog="python -m serve", description=__doc__.split("\n\n")[1],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target checkpoint dir (HF layout, with tokenizer)")
    p.add_argument("--drafter", help="drafter dir (vLLM dspark or dflash layout); omit for plain decoding")
    p.add_argument("--host", default=None, help="default 127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default 8000")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="pin k drafts per step (default: the engine picks 0 .. the drafter's block each step, and "
                        "decodes seeded sampled requests plainly so that their seed fixes their text)")
    p.add_argument("--max-batch-size", type=int, default=32, help="engine batch slots (ours)")
    p.add_argument("--max-concurrent", type=int, default=64, help="open requests before answering 429 (ours)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the target's max_position_embeddings")
    p.add_argument("--max-prompt-bytes", type=int, default=None, help="ours: longest prompt in UTF-8 bytes, checked "
                   "before tokenizing (default: max_model_len x 32)")
    p.add_argument("--api-key", default=None, help="ours: require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--adaptive-verification", action="store_true", help="verify as many drafts as the confidence "
                   "head suggests")
    p.add_argument("--draft-top-k", type=int, default=None, help="Markov term over the top-k base candidates only")
    p.add_argument("--served-model-name", default=None, help="default: the target dir's name")
    p.add_argument("--engine", choices=("ours", "vllm"), default="ours")
    p.add_argument("--tensor-parallel-size", type=int, default=None, help="vllm only (ours runs on one device)")
    p.add_argument("--enable-prefix-caching", action="store_true", help="vllm only")
    p.add_argument("--recipe", default=None, help="recipe YAML with a serve: section (e.g. recipes/k3.yaml)")
    p.add_argument("--device", default="auto", help="ours: auto (the GPU when there is one), cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="ours: auto (bfloat16 on a GPU, float32 on CPU)")
    p.add_argument("--enforce-eager", action="store_true", help="ours: no CUDA graphs (vLLM's flag; for debugging: "
                   "much slower on a GPU)")
    p.add_argument("--compile", action="store_true", help="ours: torch.compile the decode step before its graphs are "
                   "captured (a longer start: bench/RESULTS.md)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="ours: queue each decode step before the previous one is read, so the host's work overlaps "
                   "the device (vLLM's flag; default: on with CUDA graphs)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="ours: run the engine in a process of its own, so that the HTTP side and the engine do not "
                   "share a GIL (vLLM's multiprocessing front end; default: on with a GPU)")
    p.add_argument("--profile-dir", default=os.environ.get("VLLM_TORCH_PROFILER_DIR"),
                   help="enable POST /start_profile and /stop_profile, which write the engine's torch.profiler "
                   "tables and trace here (default: $VLLM_TORCH_PROFILER_DIR; with --engine vllm it sets that)")
    p.add_argument("--dry-run", action="store_true", help="vllm: print the command only; ours: load and exit")
    return p.parse_args(argv)


def _check_dir(path: str, what: str) -> None:
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"--{what} {path!r}: not a directory")
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"--{what} {path!r}: no config.json (expected an HF-style checkpoint dir)")


@dataclass
class Options:
    """`--engine ours` options after the recipe merge, all checked."""
    host: str
    port: int
    device: str
    dtype: str
    num_speculative_tokens: int | None
    max_model_len: int | None
    draft_top_k: int
    served_model_name: str | None
    adaptive_verification: bool
    engine_process: bool = False


def _check_listen(host: str, port: int) -> None:
    """Bind host:port once so that a bad host or a busy port fails now, not after the models load."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot resolve ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            why = "the port is in use" if e.errno == errno.EADDRINUSE else e.strerror
            raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({why})") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_options(args, sec: dict) -> Options:
    """Every `--engine ours` option, merged with the recipe's serve: section and checked before any loading."""
    pick = lambda flag, key, default=None: flag if flag is not None else sec.get(key, default)  # noqa: E731
    if (args.tensor_parallel_size or 1) > 1:
        raise ValueError("--tensor-parallel-size: the dspark engine runs on one device; use --engine vllm")
    o = Options(host=str(pick(args.host, "host", "127.0.0.1")), port=pick(args.port, "port", 8000),
                device=resolve_device(args.device), dtype="", num_speculative_tokens=pick(
                    args.num_speculative_tokens, "num_speculative_tokens"),
                max_model_len=pick(args.max_model_len, "max_model_len"),
                draft_top_k=pick(args.draft_top_k, "draft_top_k", 0) or 0,
                served_model_name=pick(args.served_model_name, "served_model_name"),
                adaptive_verification=args.adaptive_verification or bool(sec.get("adaptive_verification")))
    o.dtype = resolve_dtype(args.dtype, o.device)
    o.engine_process = o.device.startswith("cuda") if args.engine_process is None else args.engine_process
    if isinstance(o.port, bool) or not isinstance(o.port, int) or not 1 <= o.port <= 65535:
        raise ValueError(f"--port: expected an integer in 1..65535, got {o.port!r}")
    for flag, value, lo in [("--max-batch-size", args.max_batch_size, 1), ("--max-concurrent", args.max_concurrent, 1),
                            ("--num-speculative-tokens", o.num_speculative_tokens, 1),
                            ("--max-model-len", o.max_model_len, 1), ("--draft-top-k", o.draft_top_k, 0),
                            ("--max-prompt-bytes", args.max_prompt_bytes, 1)]:
        if value is not None:
            check_int(flag, value, lo)
    check_max_model_len(o.max_model_len, target_positions(args.target), "--max-model-len")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key: empty; give a key or leave the flag out")
    if o.served_model_name is not None and not str(o.served_model_name).strip():
        raise ValueError("--served-model-name: empty")
    _check_listen(o.host, o.port)
    if args.api_key is None and not _is_loopback(o.host):
        log.warning("serving on %s without --api-key: anyone who can reach this address can use the server", o.host)
    return o


def step_times(info: EngineInfo) -> str:
    """The k policy's view, for the banner: each candidate k's graph replay time for one row at full context."""
    ms = info.step_ms
    return "" if ms is None else ", step ms at 1 row: " + " ".join(f"k={k} {v:.3f}" for k, v in ms.items())


def _run_ours(args) -> int:
    import uvicorn

    o = check_options(args, load_serve_section(args.recipe) if args.recipe else {})
    app = load_server(args.target, args.drafter, num_speculative_tokens=o.num_speculative_tokens,
                      max_batch_size=args.max_batch_size, max_model_len=o.max_model_len,
                      adaptive_verification=o.adaptive_verification, draft_top_k=o.draft_top_k,
                      served_model_name=o.served_model_name, max_concurrent=args.max_concurrent, device=o.device,
                      dtype=o.dtype, api_key=args.api_key, max_prompt_bytes=args.max_prompt_bytes,
                      enforce_eager=args.enforce_eager, compile=args.compile,
                      async_scheduling=args.async_scheduling, profile_dir=args.profile_dir,
                      engine_process=o.engine_process)
    cfg, info = app.state.cfg, app.state.runner.info
    on = lambda x: "on" if x else "off"  # noqa: E731
    print(f"serving {cfg.served_model_name!r} on http://{o.host}:{o.port}/v1 ({o.device}, {o.dtype}, k={info.k}, "
          f"max_model_len={info.max_model_len}, max_batch_size={info.max_batch_size}, "
          f"max_concurrent={cfg.max_concurrent}, auth={on(cfg.api_key)}, graphs={on(info.graphs)}, "
          f"compiled={on(info.compiled)}, async_scheduling={on(info.overlap)}, "
          f"engine_process={on(o.engine_process)}{step_times(info)})", flush=True)
    if args.dry_run:
        shutdown(app)
        return 0
    # an engine thread in this process shares the GIL with the event loop: when the loop holds it (streaming to many
    # clients), the engine thread, whose device step has finished, waits up to the switch interval to go on
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        uvicorn.run(app, host=o.host, port=o.port, log_level="info")
    finally:
        shutdown(app)
    return 0


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad flag (2, already printed)
        return e.code if isinstance(e.code, int) else 2
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
