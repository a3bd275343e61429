"""DSpark: speculative decoding with DSpark drafters for hybrid (Kimi K3) and dense (Qwen3) targets.

Public API: load_target, load_drafter, Engine, SamplingParams (imported lazily, so `python -m dspark.<module>`
runs each module once)."""

__all__ = ["load_target", "load_drafter", "Engine", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"

_WHERE = {"load_target": "dspark.checkpoint", "load_drafter": "dspark.checkpoint", "Engine": "dspark.engine",
          "SamplingParams": "dspark.request", "RequestOutput": "dspark.request"}


def __getattr__(name):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'dspark' has no attribute {name!r}")
