"""Device and dtype names as the CLIs take them: `auto` means the GPU when there is one, and bf16 there (fp32 on CPU);
and values between the host and a device without waiting for the device.

The two resolvers raise ValueError naming the flag, so a CLI can check them before it loads anything.
"""
from __future__ import annotations

import re

import torch

DTYPES = ("auto", "float32", "bfloat16")


def resolve_device(name: str, flag: str = "--device") -> str:
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' -> a device string that exists on this machine."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    m = re.fullmatch(r"cuda(?::(\d+))?", name)
    if m is None:
        raise ValueError(f"{flag} {name!r}: expected auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"{flag} {name}: no CUDA device is available here (use --device cpu or auto)")
    if m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
        raise ValueError(f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return name


def resolve_dtype(name: str, device: str, flag: str = "--dtype") -> str:
    """'auto' | 'float32' | 'bfloat16' -> 'bfloat16' on a GPU and 'float32' on the CPU for 'auto'."""
    if name not in DTYPES:
        raise ValueError(f"{flag} {name!r}: expected one of {', '.join(DTYPES)}")
    if name == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    return name


def queued_copy(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`. To CUDA it goes through pinned memory as a queued copy: the host does not wait for
    the work already queued on the stream (a copy from pageable memory would), so the launches after it queue too."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def host_copy(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A device tensor's copy on the host, queued: (pinned tensor, event that fires once it is there), so the host
    may queue more work before it waits; on the CPU the tensor itself and None."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done
