"""relibra's light plan: one step-long replica set on the kept placement, for the layers
where the full search cannot repay its host time but a far cheaper plan can.

The guard (:mod:`relibra_torch.planning.worth`) keeps a layer's placement where the full
search (reordering, traffic replicas, per-micro-batch balancing, every candidate built and
priced) costs more host time than the layer's window and gain bound. On small models across
8-16 EP ranks a rank's share is one or two layers and that search's fixed part alone is
40-140 ms of one thread, against windows of 10-50 ms; yet a collapsed router's hot expert
leaves a one-node layer 3x slower than balanced, which a GPU-side planner fixes for free.
The light plan is relibra's step-long set (:mod:`relibra_torch.planning.step_set`: every
free slot of a node given to its experts with the most step tokens per instance, the same
copies all step, so each fills once, with per-micro-batch quotas from replay) on the
placement the guard keeps, no reordering and no traffic replica. Its copies are those that
take a fill's worth off the item's other instances (the margin rule of
:func:`~relibra_torch.planning.step_set.margin_sets`; the share rule before it spread a
collapsed router's hot expert at 2.5x the fills of the cheapest plan); where the layer's
window holds one more set's host time (``worth.Tiers.light_room_L``), the cheaper of that set
and the set whose every copy's own share pays a fill (it wins where a copy on every GPU keeps
each GPU's own tokens local). Per layer it is priced
against the kept plan with the plain plan's exact price (:func:`relibra_torch.planning.plain.layers_price`:
expert compute, all-to-all, fills and returns with their latency) and kept only where it
is cheaper (by more than the charge the guard says its schedules add), so
it never prices above keeping in that price, which is the cost model's with kept replica
buffers (one fill per residency): with ``--refetch-replicas`` (a fill per micro-batch) the
simulator and the hook turn the light tier off. Its host time with its share's token
splits: 4-6 ms plus 0.4-1.6 ms per layer on one node, 8-12 ms plus 0.5-10 ms per layer
across nodes, on a 2-core machine that ran the full search in 0.7x of its fitted floors
(``planning.host_time.light_floor_s``). Layer-local, so split planning gives the same plan (where
every layer sees the step's tokens per source, as replay gives them: the hierarchical price
reads them from a share's first layer).

Without replica slots (``R = 0``) the light plan is the kept placement with experts swapped
between the GPUs of their node (:mod:`~relibra_torch.planning.gpu_pack`, a few numpy rounds
per layer), priced and kept by the same rule: on few layers the guard keeps the placement
where the full search cannot repay its host time, and GPU swaps alone repaid it
(``switch-64/zipf/t64x64/1x8`` at 4 layers, ``benchmarks/never_behind.py --replica-slots 0``).

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots per GPU.
"""

from __future__ import annotations

import torch

from .choose import native_slots
from .gain_bound import owner_loads
from .gpu_pack import pack_gpus
from .plain import layers_price
from .plan import StepPlan
from .price import moe_seconds_ML
from .step_set import margin_sets, step_long_set

__all__ = ["light_plan"]


def light_plan(loads_MLSE: torch.Tensor, kept: StepPlan, config, min_saving_L: torch.Tensor | None = None,
               room_L: torch.Tensor | None = None) -> StepPlan:
    """``kept`` (the kept plan of these layers, :func:`~relibra_torch.planning.fastpath.keep_plan`)
    with, in each layer where it prices lower by more than ``min_saving_L`` (float64 ``[L]``
    seconds, the charge its schedules add, ``worth.Tiers.light_saving_L``; default 0), the step-long set on
    the same placement (module docstring). ``room_L``: bool ``[L]``, the layers where the
    share rule's set is built and weighed too (``worth.Tiers.light_room_L``: where the window
    holds its host time; default every layer); elsewhere the margin rule's set alone.
    ``loads_MLSE``: int ``[M, L, S, E]``; ``config``: a ``ReLibraConfig``."""
    topology, L = kept.topology, loads_MLSE.shape[1]
    if topology.replica_slots == 0:
        spread = _swapped(loads_MLSE, kept, config) if config.reorder and L else None
        if spread is None:
            return kept
        price_L = layers_price(spread, torch.arange(L), loads_MLSE, config)
    else:
        min_tokens = config.min_replica_tokens_on(topology.num_nodes)
        if not config.balance or L == 0 or min_tokens == torch.iinfo(torch.int64).max:
            return kept   # (the last: no token saves anything, so no copy can pay its fill)
        sets = [s for s in _sets(loads_MLSE, kept.placement_LE, topology, min_tokens, room_L)
                if bool((s[0][..., topology.experts_per_gpu:] >= 0).any())]   # those that copy something
        if not sets:
            return kept
        spread, price_L = _cheapest(loads_MLSE, kept, sets, config)
    idx = torch.arange(L)
    # the kept plan holds no copy: its price is its MoE time alone (no fill, no return, no latency)
    saving_L = moe_seconds_ML(kept, loads_MLSE, config).sum(0) - price_L
    cheaper_L = saving_L > (0.0 if min_saving_L is None else min_saving_L.clamp(min=0.0))
    return kept.with_layers(idx[cheaper_L], spread.layers(cheaper_L)) if bool(cheaper_L.any()) else kept


def _sets(loads_MLSE: torch.Tensor, placement_LE: torch.Tensor, topology, min_tokens: int,
          room_L: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The margin rule's step-long set, and where the share rule's differs in a layer of
    ``room_L`` (``None``: every layer), that set with those layers by the share rule
    (:func:`~relibra_torch.planning.step_set.margin_sets`; both layer-local, so each layer's
    sets are built once: the others' by the margin rule alone). Alone, the margin rule priced
    lower on most light layers of the stand-ins and the reviewer's files (``docs/results.md``,
    "The light plan weighs the margin rule")."""
    if room_L is None or bool(room_L.all()):
        return margin_sets(loads_MLSE, topology, placement_LE, min_tokens)[::-1]
    if not bool(room_L.any()):
        return [step_long_set(loads_MLSE, topology, placement_LE, min_tokens, marginal=True)]
    room, rest = room_L.nonzero().flatten(), (~room_L).nonzero().flatten()
    both = margin_sets(loads_MLSE[:, room], topology, placement_LE[room], min_tokens)   # share, margin
    margin_rest = step_long_set(loads_MLSE[:, rest], topology, placement_LE[rest], min_tokens, marginal=True)

    def joined(room_set: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        out = tuple(torch.empty(t.shape[0], room_L.numel(), *t.shape[2:], dtype=t.dtype) for t in room_set)
        for o, r, m in zip(out, room_set, margin_rest):
            o[:, room], o[:, rest] = r, m
        return out
    return [joined(both[-1])] + ([joined(both[0])] if len(both) == 2 else [])


def _cheapest(loads_MLSE: torch.Tensor, kept: StepPlan, sets: list[tuple[torch.Tensor, torch.Tensor]],
              config) -> tuple[StepPlan, torch.Tensor]:
    """``(plan, price_L)``: ``kept``'s placement with, per layer, the set of ``sets``
    (``(slot_expert_MLGJ, slot_tokens_MLGJ)`` pairs,
    :func:`~relibra_torch.planning.step_set.margin_sets`) of lowest exact price (the first on
    ties), and that price (float64 ``[L]``)."""
    idx = torch.arange(loads_MLSE.shape[1])
    plans = [StepPlan(kept.topology, kept.placement_LE, se, tok, kept.planner, kept.previous_placement_LE)
             for se, tok in sets]
    price_PL = torch.stack([layers_price(p, idx, loads_MLSE, config) for p in plans])
    best, price_L = plans[0], price_PL[0]
    for p, q_L in zip(plans[1:], price_PL[1:]):
        lower_L = q_L < price_L
        if bool(lower_L.any()):
            best, price_L = best.with_layers(idx[lower_L], p.layers(lower_L)), torch.minimum(price_L, q_L)
    return best, price_L


def _swapped(loads_MLSE: torch.Tensor, kept: StepPlan, config) -> StepPlan | None:
    """Without replica slots: ``kept`` with experts swapped between the GPUs of their node
    (:func:`~relibra_torch.planning.gpu_pack.pack_gpus`, moves priced from the kept GPUs),
    every expert on its owner; ``None`` where no swap pays."""
    topology = kept.topology
    load_LME = loads_MLSE.to(torch.int64).sum(2).transpose(0, 1).contiguous()
    placement_LE = pack_gpus(kept.placement_LE, load_LME, kept.placement_LE // topology.experts_per_gpu,
                             topology, config)
    if placement_LE is kept.placement_LE:
        return None
    return StepPlan(topology, placement_LE, *native_slots(loads_MLSE, topology, placement_LE), kept.planner,
                    kept.previous_placement_LE)


def hot_spread_saving_L(loads_MLSE: torch.Tensor, topology, placement_LE: torch.Tensor, config) -> torch.Tensor:
    """float64 ``[L]``: an estimate of what the light plan saves on one node by spreading each
    layer's hottest expert alone, from the counts (a few ops per layer, no plan built): its
    step tokens ``w`` get the margin rule's instance count ``n`` (``n (n - 1) min_tokens <= w``,
    at most one per GPU), its owner keeps ``1 / n`` of its tokens and the busiest other GPU
    takes another ``1 / n`` (the copy is assumed to land there), per micro-batch, at a pair's
    compute and at most the busiest GPU's pairs above the mean (the gain bound's compute part);
    less the ``n - 1`` fills its owner's link carries. Other items, the all-to-all and
    the quotas' rebalancing are not counted, so on a collapsed router it is close to the light
    plan's saving and elsewhere below it. 0 across nodes, without replica slots, and where the
    light plan makes no copy (``worth.Tiers``'s light admission counts it ``L / ceil(L / G)``
    times, ``docs/results.md``, "The light tier admits a collapsed layer on its hot expert")."""
    M, L = loads_MLSE.shape[:2]
    min_tokens = config.min_replica_tokens_on(topology.num_nodes)
    zero_L = torch.zeros(L, dtype=torch.float64)
    if (topology.num_nodes > 1 or topology.replica_slots == 0 or not config.balance or L == 0
            or min_tokens == torch.iinfo(torch.int64).max):
        return zero_L
    G = topology.num_gpus
    load_MLE, gpu_MLG = owner_loads(loads_MLSE, topology, placement_LE)
    hot_L = load_MLE.sum(0).argmax(-1)                                                  # the hottest expert
    w_ML = load_MLE.gather(2, hot_L.view(1, L, 1).expand(M, L, 1)).squeeze(-1)
    w_L = w_ML.sum(0).to(torch.float64)
    # the margin rule's instances: the largest n <= G with n (n - 1) <= w / min_tokens
    n_L = ((1 + (1 + 4 * w_L / max(min_tokens, 1)).sqrt()) / 2).floor().clamp(1, G)
    owner_L = placement_LE.gather(1, hot_L.view(L, 1)).squeeze(-1) // topology.experts_per_gpu
    mine_ML = gpu_MLG.gather(2, owner_L.view(1, L, 1).expand(M, L, 1)).squeeze(-1).to(torch.float64)
    others_ML = gpu_MLG.scatter(2, owner_L.view(1, L, 1).expand(M, L, 1), 0).amax(-1).to(torch.float64)
    share_ML = w_ML.to(torch.float64) / n_L
    after_ML = torch.maximum(mine_ML - w_ML + share_ML, others_ML + torch.where(n_L > 1, share_ML, 0.0))
    busiest_ML = torch.maximum(mine_ML, others_ML)
    floor_ML = ((gpu_MLG.sum(-1) + G - 1) // G).to(torch.float64)     # no plan goes below the mean
    saved_ML = torch.minimum(busiest_ML - after_ML, busiest_ML - floor_ML).clamp(min=0)
    saved_L = saved_ML.sum(0) * config.compute_s_per_token
    return (saved_L - (n_L - 1) * config.replica_fill_s_per_expert).clamp(min=0)
