"""One thread's CPU time of a call, as the simulator charges host work and ``moe.host_speed``
calibrates the guard against it: the same clock, thread count and garbage-collector pause;
and :func:`one_thread`, the thread count the hook plans with (``hook.ReplayBalancer.plan_step``)."""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable, Iterator

import torch

__all__ = ["one_thread", "one_thread_cpu"]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op pool at one thread inside the block, the caller's count restored after.

    The planner's tensors are small (a layer's ``[M, S, G, J]`` splits, kilobytes to a few
    megabytes), and the eight ranks of a node planning at once oversubscribe its cores, where
    every op on more threads waits for the pool's threads to get a core. A share planned on the
    2-core machine took 2.4-2.9x the wall time on two threads as on one while two other
    processes ran, and the same time on the idle machine (``switch-8/collapsed/t32x8/1x8``,
    ``olmoe/zipf/t32x8/2x8`` of ``benchmarks/never_behind.py``). The simulator charges, and the
    guard is calibrated on, one thread's time; the hook plans on one thread too, whatever the
    process's setting (``torchrun`` sets ``OMP_NUM_THREADS=1``; other launchers do not)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def one_thread_cpu(fn: Callable[[], object]) -> tuple[object, float]:
    """``fn()`` and this thread's CPU seconds in it, torch on one thread (:func:`one_thread`)
    and Python's garbage collector paused as ``timeit`` pauses it (a full collection walks the
    simulator's whole heap, ~0.1 s, and landed at random in one system's planning)."""
    collecting = gc.isenabled()
    gc.disable()
    with one_thread():
        t0 = time.thread_time()
        try:
            out = fn()
        finally:
            secs = time.thread_time() - t0
            gc.enable() if collecting else None
    return out, secs
