"""Planner interface and the static (Megatron-style) baseline.

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots per GPU,
El native experts per GPU.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod

import torch

from ..checks import check_tensor
from .plan import StepPlan
from .topology import Topology

__all__ = ["Planner", "StaticPlanner", "check_loads", "check_placement", "join_layer_shares", "layer_share",
           "native_plan", "planner_digest", "static_plan"]


def check_loads(loads_MLSE: torch.Tensor, topology: Topology) -> None:
    """Raise ``ValueError``/``TypeError`` unless ``loads_MLSE`` fits ``topology``."""
    check_tensor("loads_MLSE", loads_MLSE, dtypes=(torch.int32, torch.int64))
    if loads_MLSE.dim() != 4:
        raise ValueError(f"loads_MLSE has shape {tuple(loads_MLSE.shape)}; allowed: [M, L, S, E]")
    _, _, S, E = loads_MLSE.shape
    if S != topology.num_gpus:
        raise ValueError(f"loads_MLSE has S={S} source ranks; allowed: S = the topology's "
                         f"{topology.num_gpus} GPUs (counts gathered over the EP group)")
    if E != topology.num_experts:
        raise ValueError(f"loads_MLSE has E={E} experts; allowed: E = the topology's {topology.num_experts}")
    if loads_MLSE.numel() and int(loads_MLSE.min()) < 0:  # one reduction: no [M, L, S, E] mask
        first = tuple(int(i) for i in (loads_MLSE < 0).nonzero()[0])
        raise ValueError(f"loads_MLSE{list(first)} = {int(loads_MLSE[first])} is negative; allowed: counts >= 0")


def check_placement(placement_xE: object, num_experts: int, name: str = "placement_E",
                    leading: tuple[int, ...] = ()) -> torch.Tensor:
    """int64 CPU ``[*leading, E]``: ``placement_xE`` checked, or ``TypeError``/``ValueError``.

    A placement maps each logical expert to its physical native slot, so every row must be a
    permutation of ``0..E-1``. The layer checks one layer's ``[E]``, the planner a step's
    ``[L, E]`` (``leading=(L,)``), with one sort for all rows. Messages name ``name``, spell the
    allowed shape with its suffix's dims (``previous_placement_LE``: ``[L, E]``) and, for a bad
    row, the first slot that is missing or taken twice.
    """
    p = check_tensor(name, placement_xE, dtypes=(torch.int32, torch.int64))
    want = (*leading, num_experts)
    if tuple(p.shape) != want:
        suffix = name.rsplit("_", 1)[-1]
        dims = f"[{', '.join(suffix)}] = " if len(suffix) == len(want) and suffix.isupper() else ""
        raise ValueError(f"{name} has shape {tuple(p.shape)}; allowed: {dims}{list(want)}")
    p = p.detach().to("cpu", torch.int64)
    sorted_xE = p.sort(-1).values
    wrong_xE = sorted_xE != torch.arange(num_experts)
    if bool(wrong_xE.any()):
        first = tuple(int(i) for i in wrong_xE.nonzero()[0])  # (*row, first sorted position off)
        row, slot = first[:-1], first[-1]
        seen = int(sorted_xE[first])   # below the position: a slot taken twice; above it: one missing
        what = (f"{seen} is no slot" if seen < 0 else f"slot {seen} taken more than once" if seen < slot
                else f"slot {slot} missing")
        raise ValueError(f"{name}{list(row) if row else ''} is not a permutation of 0..{num_experts - 1} "
                         f"({what}); allowed: each expert's physical native slot, every slot once "
                         "(topology.static_placement gives the native one)")
    return p


def check_previous_placement(previous_placement_LE, num_layers: int, topology: Topology) -> torch.Tensor:
    """int64 ``[L, E]``: ``previous_placement_LE`` checked by :func:`check_placement`."""
    return check_placement(previous_placement_LE, topology.num_experts, "previous_placement_LE", (num_layers,))


def native_plan(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor,
                planner: str, previous_placement_LE: torch.Tensor | None = None) -> StepPlan:
    """A plan that runs every expert on its owner only (replica slots empty).

    Args:
        loads_MLSE: int ``[M, L, S, E]``.
        placement_LE: int64 ``[L, E]`` physical native slot per expert.
    Returns:
        :class:`StepPlan` with ``slot_expert_MLGJ[..., :El]`` the native experts and the
        whole load of each expert on its native slot.
    """
    M, L, _, E = loads_MLSE.shape
    G, J, El = topology.num_gpus, topology.slots_per_gpu, topology.experts_per_gpu
    plan = StepPlan(topology, placement_LE.clone(), torch.full((M, L, G, J), -1, dtype=torch.int64),
                    torch.zeros(M, L, G, J, dtype=torch.int64), planner, previous_placement_LE)
    native_LGl = plan.native_experts_LGl()
    plan.slot_expert_MLGJ[..., :El] = native_LGl
    load_MLE = loads_MLSE.to(torch.int64).sum(2)
    plan.slot_tokens_MLGJ[..., :El] = load_MLE.gather(
        2, native_LGl.reshape(1, L, G * El).expand(M, L, G * El)).view(M, L, G, El)
    return plan


def static_plan(loads_MLSE: torch.Tensor, topology: Topology) -> StepPlan:
    """Megatron-LM / torchtitan placement: expert ``e`` on GPU ``e // El``, no replicas."""
    check_loads(loads_MLSE, topology)
    L = loads_MLSE.shape[1]
    placement_LE = topology.static_placement(L)
    return native_plan(loads_MLSE, topology, placement_LE, "static", placement_LE)


def layer_share(rank: int, ranks: int, num_layers: int) -> list[int]:
    """The layers EP rank ``rank`` of ``ranks`` plans under split planning: every
    ``ranks``-th layer from its own rank (the training hook and the simulator both use this)."""
    return list(range(rank, num_layers, ranks))


def join_layer_shares(parts: list[StepPlan], ranks: int, previous_placement_LE: torch.Tensor,
                      planner: str) -> StepPlan:
    """The step plan assembled from the ranks' shares (rank ``r`` planned
    ``layer_share(r, ranks, L)`` into ``parts[r]``; ranks without a layer are left out).

    Args:
        parts: one :class:`StepPlan` per rank that has layers, in rank order.
        previous_placement_LE: int64 ``[L, E]`` the placement before the step (gives ``L``).
    Returns:
        :class:`StepPlan` with ``L`` layers in layer order.
    """
    L = previous_placement_LE.shape[0]
    order_L = torch.tensor([l for r in range(len(parts)) for l in layer_share(r, ranks, L)], dtype=torch.int64)
    if order_L.numel() != L:
        raise ValueError(f"{len(parts)} shares of {ranks} ranks cover {order_L.numel()} of {L} layers")
    back_L = torch.empty_like(order_L)
    back_L[order_L] = torch.arange(L)
    cat = (lambda name, dim: torch.cat([getattr(p, name) for p in parts], dim).index_select(dim, back_L))
    relayed = any(p.relay_MLGg is not None for p in parts)  # relays (planning.relay) of the shares that have them
    relay = torch.cat([p.relays() for p in parts], 1).index_select(1, back_L) if relayed else None
    return StepPlan(parts[0].topology, cat("placement_LE", 0), cat("slot_expert_MLGJ", 1),
                    cat("slot_tokens_MLGJ", 1), planner, previous_placement_LE.clone(), relay)


class Planner(ABC):
    """A planner used step after step: remembers what the pure function needs from the past.

    :meth:`plan` is deterministic given the planner's state and the loads; :meth:`commit`
    advances the state once the step has run with the plan (placement adopted, loads
    observed). The simulator and the training hook call ``plan`` then ``commit``.
    """

    name: str = ""

    def __init__(self, topology: Topology):
        self.topology = topology
        self.placement_LE: torch.Tensor | None = None

    @abstractmethod
    def plan(self, loads_MLSE: torch.Tensor) -> StepPlan:
        """Plan the step whose per-micro-batch loads are ``loads_MLSE`` ``[M, L, S, E]``."""

    #: Whether :meth:`plan_layers` plans any subset of layers exactly as :meth:`plan` would
    #: (layers planned independently), so that EP ranks can share the planning work.
    splits_layers: bool = False

    #: Attributes that, under split planning, hold state only for the layers this EP rank
    #: plans (so they differ between ranks); the ranks' agreement on the planner's inputs
    #: (the training hook's digest) leaves them out.
    rank_local_state: tuple[str, ...] = ()

    def plan_layers(self, loads_MLSE: torch.Tensor, layers: list[int]) -> StepPlan:
        """Plan only ``layers`` (the ``L'`` entries of the result, in that order).

        Equal to ``plan(loads_MLSE)`` restricted to those layers when ``splits_layers``.
        ``loads_MLSE`` holds every layer (planners may read other layers' state).
        """
        raise NotImplementedError(f"planner {self.name!r} plans all layers at once")

    def finish(self, plan: StepPlan, loads_MLSE: torch.Tensor, split_MLSGJ: torch.Tensor | None = None,
               total_layers: int | None = None) -> StepPlan:
        """The plan (or a share of it) once its token splits are known (``split_MLSGJ``, the
        ones the hook computes for the layers' schedules; ``None``: not computed): what a
        planner adds from them (relibra: relays). ``total_layers``: the step's layer count
        when ``plan`` is a share (split planning). Default: ``plan`` itself."""
        return plan

    def commit(self, plan: StepPlan, loads_MLSE: torch.Tensor) -> None:
        """Record that ``plan`` ran on ``loads_MLSE``."""
        self.placement_LE = plan.placement_LE.clone()

    def previous_placement(self, num_layers: int) -> torch.Tensor:
        """``[L, E]`` the placement in force before this step (static at the start)."""
        if self.placement_LE is None:
            return self.topology.static_placement(num_layers)
        return self.placement_LE


class StaticPlanner(Planner):
    name = "static"
    splits_layers = True

    def plan_layers(self, loads_MLSE: torch.Tensor, layers: list[int]) -> StepPlan:
        return static_plan(loads_MLSE[:, layers], self.topology)

    def plan(self, loads_MLSE: torch.Tensor) -> StepPlan:
        return static_plan(loads_MLSE, self.topology)


def planner_digest(planner, topology) -> int:
    """62-bit digest of what a planner holds on each EP rank: its type, name, topology and
    state (``vars``, minus the ``rank_local_state`` a rank keeps of its own layers only). The
    ranks agree on it before split planning (the training hook; the simulator times it). The
    counts it plans from are not hashed: the ranks all-gather them (loads) or all-reduce
    them (pairs) in the same step, so they are equal on every rank by construction."""
    h = hashlib.sha256()
    h.update(repr((type(planner).__qualname__, planner.name, topology)).encode())
    for key, value in sorted(vars(planner).items()):
        if key in getattr(planner, "rank_local_state", ()):
            continue
        h.update(key.encode())
        for v in value if isinstance(value, (list, tuple)) else [value]:
            h.update(v.contiguous().numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
    return int(h.hexdigest()[:16], 16) & ((1 << 62) - 1)
