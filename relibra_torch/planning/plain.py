"""relibra's plain plan: traffic replicas, then balancing copies, on a fixed placement, with
the number of traffic slots chosen per layer at the exact step price.

Traffic replicas (:func:`relibra_torch.planning.traffic.traffic_replicas`) take the first
``R // 2`` replica slots of every GPU and balancing (:func:`relibra_torch.planning.balance.replicate_step`)
the rest. Each is priced by its own rule (a remote expert's demand against one inter-node
fill; a copy's saved compute against its fills), neither by the whole step: traffic replicas
can cost more than they save where the all-to-all they cut is not the busiest link, or where
the slots they hold would balance better; and with ``R = 1`` they get no slot at all, so a
collapsed router's hot expert stays on one node however much of every token crosses to it.
So per layer these plans are priced and the cheapest kept, ties to the first:

* ``R // 2`` traffic slots (the default; with ``R = 1`` none);
* no traffic replica, balancing on every slot (also where the first planned none: their
  reserved slots would stay empty);
* with ``R = 1``, the one slot for traffic replicas (only where they plan one);
* with ``R = 1``, that plan with traffic slots per GPU rather than per node (only where
  they plan one): a GPU's slot that holds no traffic replica in a micro-batch is free for
  balancing (``balance.replicate(free_empty=True)``). On a node where one GPU's slot holds a
  hot remote expert, the other GPUs' slots then hold its two-hop copies
  (``planning.two_hop``), so a collapsed router's hot expert spreads over both nodes (1.44x
  online-global-planned before on ``switch-8/collapsed/t64x64/2x4``, 0.997x now). With
  ``R >= 2`` it was never cheaper on the default scoreboard (the same 6.9382 s) and added
  planner time: not weighed;
* each of those without balancing's copies, its traffic replicas kept, in the layers where
  the copies' fills and returns cost more than the expert compute they save
  (:func:`_without_copies`): copies admitted by their own rule (a copy's compute saved
  against its own fill) can cost more than they save (``mixtral/domains/t16x64/1x8`` on
  H800 was 1.025x static); the per-GPU plan's variant is the per-node plan above;
* where the first plan has no traffic slots, the step-long sets with at most ``c`` copies
  filled from one GPU (:func:`relibra_torch.planning.step_set.step_long_sets`) that
  ``balance.replicate_step`` hands over where its own step price puts them below its
  choice in some layer.

A layer's plan depends on that layer alone (EP ranks plan layer shares,
``planning.base.layer_share``): every candidate is built and weighed per layer, and the
``R = 1`` traffic candidates only in the layers where traffic replicas plan one.

The price is :mod:`relibra_torch.planning.price`'s per layer: expert compute, all-to-all,
replica fills and returns with their latency, summed over micro-batches; that is the cost
model's step minus attention and dense layers (``tests/test_relibra_choose.py``), and every
candidate has the same placement, so the migration is the same. A plan with no traffic
replica is built only from a traffic plan that made some, so where the fast path
(:mod:`relibra_torch.planning.fastpath`) proves that none pays, the plain plan is the one
plan it was before.

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots per GPU,
P candidate plans.
"""

from __future__ import annotations

import dataclasses

import torch

from .balance import cheapest_per_layer, replicate_step
from .fill_spread import spread_args
from .plan import StepPlan
from .price import compute_seconds_ML, exchange_latency_s, moe_seconds_ML, replica_seconds_ML
from .topology import Topology
from .traffic import traffic_replicas

__all__ = ["layers_price", "no_worse_than_keeping", "plain_plan"]


def plain_plan(loads_MLSE: torch.Tensor, topology: Topology, previous_placement_LE: torch.Tensor,
               placement_LE: torch.Tensor, config) -> StepPlan:
    """Traffic replicas, then balancing copies, on ``placement_LE`` (int64 ``[L, E]``), with
    the cheapest number of traffic slots per layer (module docstring). ``loads_MLSE``: int
    ``[M, L, S, E]``; ``config``: a ``ReLibraConfig``."""
    R, N = topology.replica_slots, topology.num_nodes
    traffic = config.cross_node_replicas and N > 1 and R

    # (prefilled traffic slots, traffic slots per GPU, layers weighed: None = all)
    if traffic and R // 2:
        prefilled = _traffic(loads_MLSE, topology, placement_LE, R // 2, config)
        prefills = [(prefilled, False, None), (None, False, None)]
    else:
        prefills = [(None, False, None)]
        if traffic:   # R = 1: the one slot for traffic replicas, where they plan one
            prefilled = _traffic(loads_MLSE, topology, placement_LE, 1, config)
            made_L = (prefilled[0] >= 0).flatten(2).any(2).any(0)
            if bool(made_L.any()):
                prefills += [(prefilled, False, made_L), (prefilled, True, made_L)]
    # balance.replicate_step's capped step-long sets, for the exact price: where the first
    # choice has no traffic slots (as its set balanced on step totals; planning time)
    capped: list = []
    plans = [_balanced(loads_MLSE, topology, previous_placement_LE, placement_LE, pre, config, free,
                       capped if k == 0 and pre is None else None) for k, (pre, free, _) in enumerate(prefills)]
    masks = [mask for _, _, mask in prefills]
    if config.balance:   # each plan without balancing's copies (its traffic replicas kept)
        plain = dataclasses.replace(config, balance=False)
        for (pre, free, mask), p in zip(prefills, list(plans)):
            q = _without_copies(p, _balanced(loads_MLSE, topology, previous_placement_LE, placement_LE, pre, plain,
                                             free), config) if _has_copies(p, pre) else None
            if q is not None:
                plans.append(q)
                masks.append(mask)
    for se, st in capped:
        plans.append(StepPlan(topology, placement_LE, se, st, "relibra", previous_placement_LE.clone()))
        masks.append(None)
    return plans[0] if len(plans) == 1 else _cheapest_per_layer(plans, loads_MLSE, config, masks)


def _without_copies(plan: StepPlan, bare: StepPlan, config) -> StepPlan | None:
    """``plan`` with ``bare``'s layers (the same without balancing's copies) where those
    copies' fills and returns cost more than the expert compute they save (the rule that
    admitted them counts a copy's own fill, not the busiest link's, nor the residencies'
    latency; the all-to-all is left to the exact price), ``None`` where they never do: the
    layers the exact price then weighs (a cheap filter, keeping planning in its window)."""
    saved_L = (compute_seconds_ML(bare.slot_tokens_MLGJ, config)
               - compute_seconds_ML(plan.slot_tokens_MLGJ, config)).sum(0)
    fills_L = (replica_seconds_ML(plan, config) - replica_seconds_ML(bare, config)).sum(0)
    weigh = (fills_L >= saved_L).view(1, -1, 1, 1)
    if not bool(weigh.any()):
        return None
    return StepPlan(plan.topology, plan.placement_LE, torch.where(weigh, bare.slot_expert_MLGJ, plan.slot_expert_MLGJ),
                    torch.where(weigh, bare.slot_tokens_MLGJ, plan.slot_tokens_MLGJ), plan.planner,
                    plan.previous_placement_LE)


def _has_copies(plan: StepPlan, prefilled) -> bool:
    """Whether a slot after ``prefilled``'s traffic slots holds an expert in ``plan``: a copy
    balancing made. A copy balancing put in a free traffic slot (``free_empty``, only at
    ``R = 1``) is not seen, so that plan's variant without copies is not built: it is the
    per-node traffic plan (no GPU has a free slot there), weighed in the same layers
    (``tests/test_plain_plan.py``)."""
    first = plan.topology.experts_per_gpu + (0 if prefilled is None else prefilled[0].shape[-1])
    return bool((plan.slot_expert_MLGJ[..., first:] >= 0).any())


def _traffic(loads_MLSE, topology: Topology, placement_LE, r0: int, config):
    g = topology.gpus_per_node
    return traffic_replicas(loads_MLSE, topology, placement_LE, r0, config.cross_node_s_per_token / g,
                            config.cross_replica_fill_s_per_expert, spread=spread_args(config))


def _balanced(loads_MLSE, topology: Topology, previous_placement_LE, placement_LE, prefilled, config,
              free_empty: bool = False, extra: list | None = None) -> StepPlan:
    # balance=False: no copy can take enough tokens to be made, so only traffic replicas remain
    N, never = topology.num_nodes, torch.iinfo(torch.int64).max
    slot_expert, slot_tokens = replicate_step(
        loads_MLSE, topology, placement_LE, config.min_replica_tokens_on(N) if config.balance else never, prefilled,
        config.min_cross_replica_tokens if config.balance else never, int(config.two_hop),
        (config.saved_s_per_token(N), config.replica_fill_s_per_expert, config.fill_latency_s(N)), free_empty,
        extra)
    return StepPlan(topology, placement_LE, slot_expert, slot_tokens, "relibra", previous_placement_LE.clone())


def _cheapest_per_layer(plans: list[StepPlan], loads_MLSE: torch.Tensor, config,
                        masks: list[torch.Tensor | None]) -> StepPlan:
    """Per layer the plan of ``plans`` (same placement) with the lowest price, ties to the
    first; plan ``k`` only in the layers ``masks[k]`` (bool ``[L]``; ``None``: every layer).
    Layers are priced apart: residencies, second hops and the all-to-all are per layer."""
    first = plans[0]
    kept = [(p, m) for p, m in zip(plans[1:], masks[1:])
            if not (torch.equal(p.slot_expert_MLGJ, first.slot_expert_MLGJ)
                    and torch.equal(p.slot_tokens_MLGJ, first.slot_tokens_MLGJ))]
    distinct = [first] + [p for p, _ in kept]
    if len(distinct) == 1:
        return first
    # Each plan is priced only on the layers where it differs from the first (elsewhere the
    # first keeps the layer), the first on any of those; and not where its expert compute and
    # exchange latency alone (its price less the all-to-all and replicas, both >= 0) reach
    # the first's price there: it cannot be cheaper (ties keep the first).
    differs_PL = torch.stack([((p.slot_expert_MLGJ != first.slot_expert_MLGJ)
                               | (p.slot_tokens_MLGJ != first.slot_tokens_MLGJ)).transpose(0, 1).flatten(1).any(-1)
                              for p in distinct])
    for k, (_, mask) in enumerate(kept, 1):
        if mask is not None:
            differs_PL[k] &= mask
    differs_PL[0] = differs_PL[1:].any(0)
    price_PL = torch.full(differs_PL.shape, float("inf"), dtype=torch.float64)
    price_PL[0] = 0.0
    idx = differs_PL[0].nonzero().squeeze(1)
    price_PL[0, idx] = layers_price(first, idx, loads_MLSE, config)
    latency = exchange_latency_s(first.topology, config) * loads_MLSE.shape[0]
    for k, p in enumerate(distinct[1:], 1):
        floor_L = compute_seconds_ML(p.slot_tokens_MLGJ, config).sum(0) + latency
        idx = (differs_PL[k] & (floor_L < price_PL[0])).nonzero().squeeze(1)
        price_PL[k, idx] = layers_price(p, idx, loads_MLSE, config)
    se, st = cheapest_per_layer([(p.slot_expert_MLGJ, p.slot_tokens_MLGJ) for p in distinct], price_PL)
    return StepPlan(first.topology, first.placement_LE, se, st, first.planner, first.previous_placement_LE)


def layers_price(plan: StepPlan, layers: torch.Tensor, loads_MLSE: torch.Tensor, config) -> torch.Tensor:
    """float64 ``[L']``: the price of ``plan``'s layers ``layers`` (each priced apart)."""
    if not layers.numel():
        return torch.zeros(0, dtype=torch.float64)
    part = plan.layers(layers)
    return (moe_seconds_ML(part, loads_MLSE[:, layers], config) + replica_seconds_ML(part, config)).sum(0)


def no_worse_than_keeping(plan: StepPlan, loads_MLSE: torch.Tensor, topology: Topology,
                          previous_placement_LE: torch.Tensor, config, coactivation_w: float = 0.0) -> StepPlan:
    """``plan`` with, in every layer whose placement it changes, the plain plan on the
    previous placement instead (:func:`plain_plan`) where that prices no higher without the
    move than the layer's plan with it (expert compute, all-to-all, replicas: the layer
    price). Reordering chooses the placement on loads before replication; the copies made
    after it can reach the same balance without the move, which then costs its migration
    for nothing (a tiny instance of ``benchmarks/bound_gap.py``: 1.30x the best plan found).
    The migration a kept layer saves is not counted: the cost model moves all layers at
    once, so one layer's share of it is not known per layer (and a layer's choice must
    depend on that layer alone, for split planning); leaving it out keeps the rule safe,
    since the step's migration can only fall when a layer keeps its placement: the cost
    model's step is never higher than with the reordered plan where the layer price is the
    cost model's (count-only loads, no ``--refetch-replicas``; ``tests/test_keep_placement.py``).
    Where it is an estimate (hierarchical dispatch on one node with per-token routing: exact
    rows, no pairs priced) or the option is unpriced, keeping can cost a little more (seen:
    1.0002x and 1.002x). Not where co-activation is priced (``coactivation_w > 0``): the layer
    price does not see the pairs a move co-locates."""
    moved_L = (plan.placement_LE != previous_placement_LE).any(1)
    if coactivation_w or not bool(moved_L.any()):
        return plan
    idx = moved_L.nonzero().flatten()
    prev_LE = previous_placement_LE[idx]
    kept = plain_plan(loads_MLSE[:, idx], topology, prev_LE, prev_LE.clone(), config)
    keep = (layers_price(kept, torch.arange(len(idx)), loads_MLSE[:, idx], config)
            <= layers_price(plan, idx, loads_MLSE, config))
    return plan.with_layers(idx[keep], kept.layers(keep)) if bool(keep.any()) else plan

