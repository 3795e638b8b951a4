"""One thread's CPU time of a call, as the simulator charges host work and ``moe.host_speed``
calibrates the guard against it: the same clock, thread count and garbage-collector pause."""

from __future__ import annotations

import gc
import time
from typing import Callable

import torch

__all__ = ["one_thread_cpu"]


def one_thread_cpu(fn: Callable[[], object]) -> tuple[object, float]:
    """``fn()`` and this thread's CPU seconds in it, torch on one thread and Python's garbage
    collector paused as ``timeit`` pauses it (a full collection walks the simulator's whole
    heap, ~0.1 s, and landed at random in one system's planning)."""
    threads, collecting = torch.get_num_threads(), gc.isenabled()
    torch.set_num_threads(1)
    gc.disable()
    t0 = time.thread_time()
    try:
        out = fn()
    finally:
        secs = time.thread_time() - t0
        torch.set_num_threads(threads)
        gc.enable() if collecting else None
    return out, secs
