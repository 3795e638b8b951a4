"""relibra's light plan: one step-long replica set on the kept placement, for the layers
where the full search cannot repay its host time but a far cheaper plan can.

The guard (:mod:`relibra_torch.planning.worth`) keeps a layer's placement where the full
search (reordering, traffic replicas, per-micro-batch balancing, every candidate built and
priced) costs more host time than the layer's window and gain bound. On small models across
8-16 EP ranks a rank's share is one or two layers and that search's fixed part alone is
40-140 ms of one thread, against windows of 10-50 ms; yet a collapsed router's hot expert
leaves a one-node layer 3x slower than balanced, which a GPU-side planner fixes for free.
The light plan is relibra's step-long set (:func:`relibra_torch.planning.step_set.step_long_set`:
every free slot of a node given to its experts with the most step tokens per instance, the
same copies all step, so each fills once, with per-micro-batch quotas from replay) on the
placement the guard keeps, no reordering. Across nodes a second candidate puts step-long
traffic replicas in the first ``R // 2`` slots first (:func:`relibra_torch.planning.traffic.step_replicas`:
per node the remote experts with the most step demand whose saved crossings beat one
inter-node fill), then the step-long set shares them over their node as two-hop copies: a
collapsed router's hot expert then spreads over both nodes for one inter-node fill
(``switch-8/collapsed/t16x64/2x4``: 1.048x online-global-planned with the first candidate
alone, 0.999x with both). Per layer the cheaper candidate is priced
against the kept plan with the plain plan's exact price (:func:`relibra_torch.planning.plain.layers_price`:
expert compute, all-to-all, fills and returns with their latency) and kept only where it
is cheaper (by more than the charge the guard says its schedules add), so
it never prices above keeping in that price, which is the cost model's with kept replica
buffers (one fill per residency): with ``--refetch-replicas`` (a fill per micro-batch) the
simulator and the hook turn the light tier off. Its host time with its share's token
splits: 4-6 ms plus 0.4-1.6 ms per layer on one node, 8-12 ms plus 0.5-10 ms per layer
across nodes without the traffic candidate (1.3-2.7x that where traffic replicas pay), on a
2-core machine that ran the full search in 0.7x of its fitted floors
(``planning.worth.light_floor_s``). Layer-local, so split planning gives the same plan (where
every layer sees the step's tokens per source, as replay gives them: the hierarchical price
reads them from a share's first layer).

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots per GPU.
"""

from __future__ import annotations

import torch

from .plain import layers_price
from .plan import StepPlan
from .price import moe_seconds_ML
from .step_set import step_long_set
from .traffic import step_replicas

__all__ = ["light_plan"]


def light_plan(loads_MLSE: torch.Tensor, kept: StepPlan, config, min_saving_L: torch.Tensor | None = None) -> StepPlan:
    """``kept`` (the kept plan of these layers, :func:`~relibra_torch.planning.fastpath.keep_plan`)
    with, in each layer where it prices lower by more than ``min_saving_L`` (float64 ``[L]``
    seconds, the charge its schedules add, ``worth.Tiers.light_saving_L``; default 0), the
    cheaper step-long set on the same placement, with or (across nodes) without traffic
    replicas first (module docstring). ``loads_MLSE``: int ``[M, L, S, E]``; ``config``:
    a ``ReLibraConfig``."""
    topology, L = kept.topology, loads_MLSE.shape[1]
    min_tokens = config.min_replica_tokens_on(topology.num_nodes)
    if not config.balance or L == 0 or topology.replica_slots == 0 or min_tokens == torch.iinfo(torch.int64).max:
        return kept   # (the last: no token saves anything, so no copy can pay its fill)
    El = topology.experts_per_gpu
    candidates = []
    traffic = _traffic_set(loads_MLSE, kept, config)
    for prefilled in (None,) if traffic is None else (None, traffic):
        se, tok = step_long_set(loads_MLSE, topology, kept.placement_LE, min_tokens, prefilled,
                                int(config.two_hop) if prefilled is not None else 0)
        if bool((se[..., El:] >= 0).any()):  # some copy made
            candidates.append(StepPlan(topology, kept.placement_LE, se, tok, kept.planner, kept.previous_placement_LE))
    if not candidates:
        return kept
    idx = torch.arange(L)
    # the kept plan holds no copy: its price is its MoE time alone (no fill, no return, no latency)
    price_PL = torch.stack([layers_price(c, idx, loads_MLSE, config) for c in candidates])
    best_L = price_PL.argmin(0)
    saving_L = moe_seconds_ML(kept, loads_MLSE, config).sum(0) - price_PL.gather(0, best_L.view(1, L))[0]
    cheaper_L = saving_L > (0.0 if min_saving_L is None else min_saving_L.clamp(min=0.0))
    plan = kept
    for k, c in enumerate(candidates):
        take_L = cheaper_L & (best_L == k)
        if bool(take_L.any()):
            plan = plan.with_layers(idx[take_L], c.layers(take_L))
    return plan


def _traffic_set(loads_MLSE: torch.Tensor, kept: StepPlan, config):
    """Step-long traffic replicas on the kept placement in the first ``R // 2`` slots
    (``planning.traffic.step_replicas``), or ``None`` across one node, with cross-node
    replicas off, or where none pays its fill."""
    topology = kept.topology
    N, g, El, r = topology.num_nodes, topology.gpus_per_node, topology.experts_per_gpu, topology.replica_slots // 2
    if N == 1 or r == 0 or not config.cross_node_replicas:
        return None
    M, L, S, E = loads_MLSE.shape
    loads = loads_MLSE.to(torch.int64)
    owner_node_LE = kept.placement_LE // El // g
    remote_MLNE = loads.view(M, L, N, g, E).sum(3).masked_fill(
        owner_node_LE.view(1, L, 1, E) == torch.arange(N).view(1, 1, N, 1), 0)
    native_LG = torch.zeros(L, topology.num_gpus, dtype=torch.int64).scatter_add_(
        1, kept.placement_LE // El, loads.sum((0, 2)))
    e_MLGr, q_MLGr = step_replicas(remote_MLNE, native_LG, topology, r, config.cross_node_s_per_token / g,
                                   config.cross_replica_fill_s_per_expert)
    return (e_MLGr, q_MLGr) if bool((e_MLGr >= 0).any()) else None
