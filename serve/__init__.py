"""`python -m serve`: an OpenAI-compatible server over dspark.Engine (app.py, runner.py), or the equivalent vLLM
command (vllm.py).

    from serve import load_server, ServerThread
    app = load_server("runs/qwen3-tiny/final", "runs/dspark-tiny/final", max_concurrent=64)
    with ServerThread(app, port=0) as srv:       # uvicorn in a background thread; srv.url
        ...
"""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from serve.app import ServerConfig, create_app, freeze_heap, shutdown
from serve.engine_client import EngineClient
from serve.engine_proc import build_engine, check_max_model_len
from serve.runner import EngineRunner


def load_server(target_dir: str | Path, drafter_dir: str | Path | None = None, *, num_speculative_tokens=None,
                max_batch_size: int = 32, max_model_len: int | None = None, adaptive_verification: bool = False,
                draft_top_k: int = 0, served_model_name: str | None = None, max_concurrent: int = 64,
                device: str = "auto", dtype: str = "auto", api_key: str | None = None,
                max_prompt_bytes: int | None = None, enforce_eager: bool = False, compile: bool = False,
                async_scheduling: bool | None = None, profile_dir: str | None = None, engine_process: bool = False):
    """Load the models, start the engine and return the FastAPI app (app.state.runner: the engine thread, or with
    engine_process the handle on the engine's own process, serve/engine_client.py). profile_dir: POST /start_profile
    and /stop_profile write the engine thread's profile there (serve/profile.py)."""
    check_max_model_len(max_model_len, target_positions(target_dir))
    load = dict(target_dir=str(target_dir), drafter_dir=None if drafter_dir is None else str(drafter_dir),
                num_speculative_tokens=num_speculative_tokens, max_batch_size=max_batch_size,
                max_model_len=max_model_len, adaptive_verification=adaptive_verification, draft_top_k=draft_top_k,
                device=device, dtype=dtype, enforce_eager=enforce_eager, compile=compile,
                async_scheduling=async_scheduling)
    if engine_process:
        runner = EngineClient(load, profile_dir=profile_dir)
    else:
        runner = EngineRunner(build_engine(**load), profile_dir=profile_dir).start()
    name = served_model_name or Path(target_dir).resolve().name
    app = create_app(runner, ServerConfig(name, max_concurrent=max_concurrent, api_key=api_key,
                                          max_prompt_bytes=max_prompt_bytes))
    freeze_heap(app)
    return app


def target_positions(target_dir: str | Path) -> int | None:
    """The target's max_position_embeddings from its config.json (K3's text_config too), without loading weights."""
    from dspark.checkpoint import read_config

    cfg = read_config(target_dir)
    cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    n = cfg.get("max_position_embeddings")
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` on host:port from a daemon thread; stops the server and the engine thread on exit."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0):
        import uvicorn

        self.app, self.host, self.port = app, host, port or free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.timeout = timeout

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if not self.thread.is_alive() or time.time() - t0 > self.timeout:
                raise RuntimeError(f"server on {self.url} did not start within {self.timeout:.0f} s")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(self.timeout)
        shutdown(self.app)


__all__ = ["load_server", "ServerThread", "ServerConfig", "EngineRunner", "EngineClient", "build_engine", "create_app",
           "shutdown", "free_port", "target_positions", "check_max_model_len"]
