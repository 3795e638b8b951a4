"""Without replica slots, a last pass over the placement priced as the layer runs (``R = 0``).

With no replica slot the placement is the whole plan: every expert runs on its owner only.
Reordering chooses it by proxies that are right where copies spread a node's work over its
GPUs: each node's busiest load and its cross-node send and receive over its ``g`` GPUs
(:mod:`~relibra_torch.planning.reorder_traffic`). Without copies each GPU computes, sends and
receives its own experts' tokens, and on the tiny instances of ``benchmarks/bound_gap.py``
(``R = 0``, 8,192 tokens per rank, where the all-to-all is most of the layer) the best
placement found was 1.06-1.22x faster than relibra's: the traffic search swapped the
load-first search's placement back because node totals over ``g`` GPUs hid the busiest GPU.

Here, per layer, steepest descent over swaps of two experts on different GPUs, each priced
exactly: the layer price the plain plan's check uses (:func:`~relibra_torch.planning.plain.layers_price`:
expert compute, all-to-all and its latency per micro-batch, as the cost model charges them
under flat dispatch; under hierarchical dispatch the planner's estimate of its rows, less
what the relays the plan then gets save: priced before relays, swaps lowered the estimate
while the relayed exchange the step runs rose, 1.016x on a tiny instance) plus
what the swap adds to the layer's own migration by the cost model's rule (per GPU, moves
across nodes at ``migration_s_per_expert`` plus moves over NVLink at
``intra_migration_s_per_expert``, of the busier of sending and receiving; the busiest GPU
counts). A fall of the layer's own migration is not counted as a saving: the step moves
every layer at once and its busiest GPU may be another layer's, while a rise can add up to
its whole size. So the layer price falls with every swap taken, by more than its migration.

Every pair of experts is a candidate, ``W = E (E - 1) / 2`` of them, all layers' swaps
priced in one call per round (a layer where no swap paid is not priced again); that limits
the pass to ``E <= MAX_EXPERTS`` (coarse MoE:
Mixtral's, Grok-1's and Switch-8's 8 experts), where a few hot experts make the placement
matter most. One thread from static placement, 8 micro-batches: 63 ms for 4 layers on 2 x 4
GPUs (hierarchical), 233 ms for 32 layers on one node of 8; 18-47 ms once polished. Per layer and from that layer's counts alone, so split planning gives the same
plans; not where co-activation is priced (the layer price does not see the pairs a swap
co-locates), as for ``plain.no_worse_than_keeping``.

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, g GPUs per node,
El native experts per GPU, W candidate swaps per layer.
"""

from __future__ import annotations

import torch

from .base import native_plan
from .plain import layers_price
from .plan import StepPlan
from .price import migration_seconds_L
from .relay_choice import relay_savings
from .topology import Topology

__all__ = ["MAX_EXPERTS", "polish_placement"]

#: Most experts for which every swap is priced each round (``W = 28`` at 8). At 16 (``W = 120``)
#: a hierarchical share of 4 layers on 2 x 8 GPUs took 2.2 s of one thread from static placement.
MAX_EXPERTS = 8
#: Most rounds (one swap per layer each); the descent stops sooner where no swap pays.
MAX_ROUNDS = 16


def _price_L(placement_LE: torch.Tensor, loads_MLSE: torch.Tensor, topology: Topology, config) -> torch.Tensor:
    """float64 ``[L]``: the layer price of each layer's native plan on ``placement_LE``, less
    what the relays that plan gets save (:func:`~relibra_torch.planning.relay_choice.relay_savings`:
    the all-to-all the step runs is the relayed one, and a swap changes which GPUs send most)."""
    L = placement_LE.shape[0]
    plan = native_plan(loads_MLSE, topology, placement_LE, "polish")
    price_L = layers_price(plan, torch.arange(L), loads_MLSE, config)
    relayed = relay_savings(plan, loads_MLSE, config)
    return price_L if relayed is None else price_L - relayed[0].sum(0)


def polish_placement(plan: StepPlan, loads_MLSE: torch.Tensor, config) -> StepPlan:
    """``plan`` (a plan without copies: ``R = 0``) on the placement the swaps reach (module
    docstring), every expert on its owner; ``plan`` itself where no swap pays, the topology
    has replica slots or more than :data:`MAX_EXPERTS` experts. ``loads_MLSE``: int
    ``[M, L, S, E]``; ``config``: a ``ReLibraConfig``."""
    topology = plan.topology
    E, El = topology.num_experts, topology.experts_per_gpu
    if topology.replica_slots or E > MAX_EXPERTS or topology.num_gpus < 2 or plan.num_layers == 0:
        return plan
    previous_LE = plan.previous_placement_LE if plan.previous_placement_LE is not None else plan.placement_LE
    placement_LE = plan.placement_LE.clone()
    L = placement_LE.shape[0]
    a_W, b_W = torch.triu_indices(E, E, 1)
    W = a_W.numel()
    price_L = _price_L(placement_LE, loads_MLSE, topology, config)
    moves_L = migration_seconds_L(placement_LE, previous_LE, topology, config)
    active = torch.arange(L)               # layers still descending: only they are priced again
    changed = False
    for _ in range(MAX_ROUNDS):
        A = active.numel()
        cand_AWE = placement_LE[active].unsqueeze(1).repeat(1, W, 1)
        slot_a, slot_b = cand_AWE[:, 0, a_W], cand_AWE[:, 0, b_W]           # [A, W]
        cand_AWE[:, torch.arange(W), a_W], cand_AWE[:, torch.arange(W), b_W] = slot_b, slot_a
        flat_XE = cand_AWE.reshape(A * W, E)
        cand_price = _price_L(flat_XE, loads_MLSE[:, active].repeat_interleave(W, dim=1), topology, config).view(A, W)
        cand_moves = migration_seconds_L(flat_XE, previous_LE[active].repeat_interleave(W, dim=0), topology,
                                         config).view(A, W)
        gain_AW = price_L[active].unsqueeze(1) - cand_price - (cand_moves - moves_L[active].unsqueeze(1)).clamp(min=0.0)
        gain_AW = gain_AW.masked_fill(slot_a // El == slot_b // El, -1.0)   # same GPU: nothing changes
        best_A, arg_A = gain_AW.max(1)
        take_A = best_A > 0
        if not bool(take_A.any()):
            break
        changed = True
        rows = take_A.nonzero().flatten()
        layers = active[rows]
        placement_LE[layers] = cand_AWE[rows, arg_A[rows]]
        price_L[layers] = cand_price[rows, arg_A[rows]]
        moves_L[layers] = cand_moves[rows, arg_A[rows]]
        active = layers
    if not changed:
        return plan
    return native_plan(loads_MLSE, topology, placement_LE, plan.planner, plan.previous_placement_LE)
