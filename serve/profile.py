"""The engine thread under torch.profiler between POST /start_profile and POST /stop_profile (vLLM's routes, on when
the server has a profile dir: `--profile-dir DIR` or VLLM_TORCH_PROFILER_DIR).

What it writes for each window, in DIR: `engine-profile-N.txt`, the engine's counters over the window (decode steps
per k, generated tokens, the engine thread's time) and two tables of torch.profiler's key averages: by the host's
own time (CUDA API calls such as graph launches and synchronisations, eager ops, and the engine's named phases:
`engine.prefill`, `engine.launch`, `engine.read`, `engine.flush_context`) and by device time; and
`engine-profile-N.json`, the Chrome trace (chrome://tracing, Perfetto)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

COUNTERS = ("decode_steps_per_k", "generation_tokens", "step_s", "read_wait_s", "launch_wait_s", "loop_s")


class EngineProfile:
    """One profiling window at a time; start() and stop() run on the engine thread."""

    def __init__(self, out_dir: str | Path):
        self.dir = Path(out_dir)
        self.prof: torch.profiler.profile | None = None
        self.before: dict | None = None
        self.n = 0

    @property
    def active(self) -> bool:
        return self.prof is not None

    def start(self, counters: dict) -> None:
        if self.prof is not None:
            raise RuntimeError("a profile is already running: POST /stop_profile first")
        self.dir.mkdir(parents=True, exist_ok=True)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts)
        self.prof.__enter__()
        self.before = {k: counters.get(k) for k in COUNTERS}

    def stop(self, counters: dict) -> list[str]:
        """End the window; -> the paths written."""
        if self.prof is None:
            raise RuntimeError("no profile is running: POST /start_profile first")
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self.n += 1
        txt, trace = self.dir / f"engine-profile-{self.n}.txt", self.dir / f"engine-profile-{self.n}.json"
        delta = {k: _minus(counters.get(k), self.before.get(k)) for k in COUNTERS}
        avg = prof.key_averages()
        parts = [f"engine counters over the window: {json.dumps(delta)}",
                 "by the host's own time:\n" + avg.table(sort_by="self_cpu_time_total", row_limit=50)]
        if torch.cuda.is_available():
            parts.append("by device time:\n" + avg.table(sort_by="self_device_time_total", row_limit=30))
        txt.write_text("\n\n".join(parts) + "\n")
        prof.export_chrome_trace(str(trace))
        return [str(txt), str(trace)]


def _minus(after, before):
    if isinstance(after, list):
        return [a - b for a, b in zip(after, before)]
    return None if after is None or before is None else after - before
