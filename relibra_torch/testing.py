"""Run functions on N gloo ranks on CPU, for tests and examples.

Three entry points:

* :func:`run_on_ranks` spawns ``world_size`` processes, runs ``fn(*args)`` on each with an
  initialised gloo process group, and returns the per-rank results.
* :class:`RankPool` keeps the processes (and their process group) alive across calls, so a
  test module pays for start-up once and runs many hypothesis cases inside it.
* :func:`run_plan_transfers` executes a :class:`~relibra_torch.planning.StepPlan` with the
  real layer and ``ReplayBalancer`` on a pool's ranks and returns what the layer counted
  (the layer side of ``relibra_torch.sim.transfer_counts``).

A failure on any rank raises :class:`RankFailure` in the caller with every failed rank's
traceback. Ranks that are still blocked in a collective after a failure are killed after a
short grace period and reported as such: a failing distributed test never hangs CI.

``fn`` and its arguments must be picklable (module-level functions), as with
``torch.multiprocessing.spawn``. Inside ``fn``, ``torch.distributed`` is initialised
(``dist.get_rank()``, ``dist.get_world_size()``) and torch uses one intra-op thread.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankFailure", "RankPool", "run_on_ranks", "run_plan_transfers"]

_STOP = "__stop__"


class RankFailure(RuntimeError):
    """One or more ranks raised (or hung) while running a function."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, timeout_s: float, tasks, results) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, False, traceback.format_exc()))
        return
    while True:
        item = tasks.get()
        if item == _STOP:
            # Exit without destroy_process_group: its gloo teardown takes seconds, and the
            # process ends here anyway.
            return
        fn, args, kwargs = item
        try:
            out = fn(*args, **kwargs)
            results.put((rank, True, out))
        except BaseException:  # noqa: BLE001 - reported to the parent, which raises
            results.put((rank, False, traceback.format_exc()))


class RankPool:
    """``world_size`` persistent gloo ranks on CPU.

    Args:
        world_size: number of ranks (processes).
        timeout_s: how long one :meth:`run` may take before the pool is killed and
            :class:`RankFailure` raised; also the gloo collective timeout.
        grace_s: after one rank fails, how long to wait for the others before killing them
            (they are usually blocked in a collective the failed rank never joined).

    Use as a context manager, or call :meth:`close`. After a failure the pool is closed;
    the next :meth:`run` starts fresh processes.
    """

    def __init__(self, world_size: int, timeout_s: float = 300.0, grace_s: float = 5.0):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self._procs: list[mp.Process] = []
        self._tasks: list[Any] = []
        self._results: Any = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, self.timeout_s, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        try:  # the queue pickles in a feeder thread: a failure there would only show as a timeout
            pickle.dumps((fn, args, kwargs))
        except Exception as exc:  # noqa: BLE001 - pickling raises many types
            raise TypeError(f"RankPool.run: fn and its arguments must be picklable (a module-level function, "
                            f"no lambdas or open files): {type(exc).__name__}: {exc}") from None
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        outputs: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = self.timeout_s
        while len(outputs) + len(failures) < self.world_size:
            try:
                rank, ok, payload = self._results.get(timeout=deadline)
            except queue.Empty:
                break
            (outputs if ok else failures)[rank] = payload
            if failures:
                deadline = self.grace_s
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()
                    and r not in outputs and r not in failures]
            for r in dead:
                failures[r] = f"process exited with code {self._procs[r].exitcode}"
        if failures or len(outputs) < self.world_size:
            missing = [r for r in range(self.world_size) if r not in outputs and r not in failures]
            self.close(kill=True)
            lines = [f"{len(failures)} of {self.world_size} ranks failed running "
                     f"{getattr(fn, '__qualname__', fn)!s}"]
            for r in sorted(failures):
                lines.append(f"--- rank {r} ---\n{failures[r]}")
            if missing:
                lines.append(f"ranks {missing} did not finish (blocked in a collective or "
                             f"past the {self.timeout_s:.0f} s timeout) and were killed")
            raise RankFailure("\n".join(lines))
        return [outputs[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        """Stop the ranks (politely unless ``kill``)."""
        if not self._procs:
            return
        if not kill:
            for q in self._tasks:
                q.put(_STOP)
            # Results are already received; a rank still tearing down (interpreter and
            # gloo shutdown take seconds) is killed after a short wait.
            deadline = time.monotonic() + 2.0
            for p in self._procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs, self._tasks, self._results = [], [], None

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(kill=exc[0] is not None)


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
                 timeout_s: float = 300.0, **kwargs: Any) -> list[Any]:
    """Spawn ``world_size`` gloo ranks, run ``fn(*args, **kwargs)`` on each, return results.

    Raises :class:`RankFailure` with every failed rank's traceback if any rank raises or
    does not finish within ``timeout_s``.
    """
    with RankPool(world_size, timeout_s=timeout_s) as pool:
        return pool.run(fn, *args, **kwargs)


# ---------------------------------------------------------------------------- plan runner

def routing_from_loads(loads_MLSE: torch.Tensor, top_k: int) -> list[list[torch.Tensor]]:
    """``[m][s]`` int64 ``[T, L, K]`` ids whose counts are exactly ``loads_MLSE`` (``-1`` pads
    where a layer has fewer pairs than ``T * K``)."""
    M, L, S, E = loads_MLSE.shape
    out = []
    for m in range(M):
        per_rank = []
        for s in range(S):
            T = int(max((-(-int(loads_MLSE[m, l, s].sum()) // top_k) for l in range(L)), default=0))
            ids = torch.full((T, L, top_k), -1, dtype=torch.int64)
            for l in range(L):
                pairs = torch.repeat_interleave(torch.arange(E), loads_MLSE[m, l, s].to(torch.int64))
                i = torch.arange(pairs.numel())
                ids[i % max(T, 1), l, i // max(T, 1)] = pairs  # spread an expert over tokens
            per_rank.append(ids)
        out.append(per_rank)
    return out


def _plan_transfers_rank(plan, loads_MLSE, routed, top_k, dim, hidden, refetch, check_plan, dispatch) -> dict:
    """Rank side of :func:`run_plan_transfers`."""
    from torch.distributed.device_mesh import init_device_mesh

    from .hook import ReplayBalancer
    from .moe import ReplayBalancedMoE
    from .planning.base import Planner

    class _Given(Planner):
        name = "given"

        def plan(self, loads):
            return plan

    topo = plan.topology
    r = dist.get_rank()
    key = (topo.num_nodes, topo.gpus_per_node)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", key, mesh_dim_names=("node", "gpu"))
    torch.manual_seed(7)
    layers = torch.nn.ModuleList(
        ReplayBalancedMoE(dim, hidden, topo.num_experts, top_k, mesh=_MESHES[key],
                          replica_slots=topo.replica_slots, refetch_replicas=refetch, check_plan=check_plan,
                          dispatch=dispatch)
        for _ in range(plan.num_layers))
    if plan.previous_placement_LE is not None:
        for l, layer in enumerate(layers):
            layer.apply_placement(plan.previous_placement_LE[l])
    balancer = ReplayBalancer(list(layers), planner=_Given(topo))
    balancer.plan_step(counts_MLE=loads_MLSE[:, :, r])
    gen = torch.Generator().manual_seed(100 + r)
    for m in range(plan.num_micro_batches):
        balancer.install(m)
        ids = routed[m][r]
        h = torch.randn(ids.shape[0], dim, generator=gen, requires_grad=True)
        out = h
        for l, layer in enumerate(layers):
            out = out + layer(out, ids[:, l])
        out.sum().backward()
    return {k: v.numpy() for k, v in balancer.transfer_counts().items()}


_MESHES: dict = {}


def run_plan_transfers(pool: RankPool, plan, loads_MLSE: torch.Tensor, routed_ids=None, dispatch: str = "flat",
                       refetch: bool = False, *, top_k: int = 2, dim: int = 16, hidden: int = 8,
                       check_plan: bool = True) -> dict[str, torch.Tensor]:
    """Execute ``plan`` with the layer on ``pool``'s gloo ranks; return what the layer counted.

    One ``ReplayBalancedMoE`` (fp32, ``dim x hidden`` experts) per plan layer, stacked with
    residuals, on a ``(node, gpu)`` mesh of the plan's topology (``pool.world_size`` must be
    its GPU count). The layers start at ``plan.previous_placement_LE`` (if set); a
    ``ReplayBalancer`` whose planner returns ``plan`` runs ``plan_step`` (migration included)
    and installs every micro-batch, which runs forward and backward.

    Args:
        routed_ids: ``[m][s]`` int ``[T, L, K]`` routing; ``None``: made from ``loads_MLSE``
            (each rank's pairs spread over ``ceil(pairs / K)`` tokens, ``-1`` pads).
        dispatch: the layers' ``dispatch`` (``"flat"`` or ``"hierarchical"``).

    Returns:
        int64 ``[M, L, G]`` per key of ``relibra_torch.moe.counters.COUNT_KEYS`` and
        ``step_collectives`` ``[G]``: the keys of ``relibra_torch.sim.transfer_counts``.
    """
    if dispatch not in ("flat", "hierarchical"):
        raise ValueError(f"dispatch={dispatch!r}; allowed: flat, hierarchical")
    if pool.world_size != plan.topology.num_gpus:
        raise ValueError(f"the pool has {pool.world_size} ranks but the plan is for "
                         f"{plan.topology.num_gpus} GPUs")
    routed = routed_ids if routed_ids is not None else routing_from_loads(loads_MLSE, top_k)
    results = pool.run(_plan_transfers_rank, plan, loads_MLSE, routed, top_k, dim, hidden, refetch, check_plan,
                       dispatch)
    # [M, L] per GPU -> [M, L, G]; the step scalar -> [G]
    return {k: torch.stack([torch.from_numpy(res[k]) for res in results], -1) for k in results[0]}
