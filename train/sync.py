"""Barriers between the data-parallel processes that also hold for CPU processes on a machine with GPUs.

accelerate's wait_for_everyone (and main_process_first, built on it) calls torch.distributed.barrier with
device_ids=[local rank]; a CUDA build of torch then puts the barrier's tensor on cuda:<local rank>, also for CPU
(gloo) processes, so the second process fails where only one GPU is visible. CPU processes barrier on the CPU here.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def wait_for_everyone(accelerator) -> None:
    """Every process waits here until all have arrived."""
    if accelerator.num_processes > 1 and accelerator.device.type == "cpu":
        torch.distributed.barrier()  # gloo: the group's object-collective device, the CPU
    else:
        accelerator.wait_for_everyone()


@contextmanager
def main_process_first(accelerator) -> Iterator[None]:
    """The main process runs the block first (e.g. builds a cache), then the others (which reuse it)."""
    if not accelerator.is_main_process:
        wait_for_everyone(accelerator)
    yield
    if accelerator.is_main_process:
        wait_for_everyone(accelerator)
