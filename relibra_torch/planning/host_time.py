"""The guard's host-time model (:mod:`~relibra_torch.planning.worth`): the full search's
floor per layer, the light plan's, its schedules' share, and this host's scale for the
topology. Every figure is one thread's CPU seconds in the time of the machine the constants
were fitted on (``planning.pricing.PLAN_FLOOR_S`` and the constants below), times the
config's host scale (``moe.host_speed``).
"""

from __future__ import annotations

from .topology import Topology

__all__ = ["FIT_GPUS", "LIGHT_EXPERT_NODES_S", "LIGHT_EXPERT_S", "LIGHT_LAYER_NODES_S", "LIGHT_LAYER_S",
           "LIGHT_SCHEDULE_EXPERTS", "LIGHT_SCHEDULE_SHARE", "LIGHT_SQRT_GPUS", "few_micro_batches", "host_scale", "layer_floor_s",
           "light_floor_s", "light_layer_s", "light_scale", "light_schedule_share", "plan_floor_s"]


def plan_floor_s(topology: Topology, config) -> float:
    """The config's fixed floor for the topology (:func:`_fixed_floor`) on this host
    (:func:`host_scale`): 0 turns the guard off."""
    return _fixed_floor(topology, config) * host_scale(topology, config)


def _fixed_floor(topology: Topology, config) -> float:
    """The config's fixed floor as fitted: ``plan_floor_nodes_s`` across nodes, else ``plan_floor_s``."""
    return config.plan_floor_nodes_s if topology.num_nodes > 1 else config.plan_floor_s


#: The most GPUs the host-time constants were fitted and calibrated on (``moe.host_speed``'s
#: reference shares: 8 and 16). Beyond them a share's search grew with the GPUs (2 x 8 -> 8 x 8
#: at 64-256 tokens per GPU: 1.4-5.3x, ``docs/results.md``, "The guard's host time grows with
#: the GPUs"), so across nodes every host-time constant is scaled by ``G / FIT_GPUS``.
FIT_GPUS = 16


def host_scale(topology: Topology, config) -> float:
    """This host's planning time over the fitted constants' for the topology
    (``host_scale_nodes`` across nodes, times ``G / FIT_GPUS`` beyond :data:`FIT_GPUS` GPUs,
    else ``host_scale``)."""
    if topology.num_nodes == 1:
        return config.host_scale
    return config.host_scale_nodes * _gpu_growth(topology)


#: Up to this many GPUs the light plan's and the schedules' growth is ``sqrt(G / FIT_GPUS)``
#: (measured up to 8 x 8); beyond, it is the search's ``G / FIT_GPUS`` (:func:`light_scale`).
LIGHT_SQRT_GPUS = 64


def light_scale(topology: Topology, config) -> float:
    """:func:`host_scale` for the light plan and every rank's schedules: across nodes beyond
    :data:`FIT_GPUS` GPUs and up to :data:`LIGHT_SQRT_GPUS` they grow with ``sqrt(G /
    FIT_GPUS)``, not with ``G / FIT_GPUS`` as the search does; beyond that, as the search.
    Measured with each tier forced (real layer counts, 8 micro-batches, 256 and 1,024 tokens
    per GPU, OLMoE, Qwen3-30B-A3B and Switch-64 shapes; ``docs/results.md``, "The light plan
    and the schedules beyond 16 GPUs"): from 2 x 8 to 8 x 8 a light share's time grew
    1.4-2.6x in 10 of 12 pairs (8-12x in two at 1,024 tokens per GPU, whose windows held it
    twice over) and rank 0's schedules of the step 1.5-3.4x (above 2x only at 1,024 tokens
    per GPU, whose windows held them 30-80 times), while ``G / FIT_GPUS`` priced both at 4x
    and the guard kept static placement where either tier fit the window with room to spare.
    On 32 x 8 the square root, and ``G / 32`` too, priced a Switch-256 light plan and its
    schedules at well under the 146-704 ms they took (a reviewer's check), so beyond
    :data:`LIGHT_SQRT_GPUS` nothing was measured that supports a slower growth than the
    search's. Up to :data:`FIT_GPUS` GPUs it is :func:`host_scale`."""
    if topology.num_nodes == 1 or topology.num_gpus > LIGHT_SQRT_GPUS:
        return host_scale(topology, config)
    return config.host_scale_nodes * _gpu_growth(topology) ** 0.5


def _gpu_growth(topology: Topology) -> float:
    """How much a share's search grows with the GPUs: ``G / FIT_GPUS`` across nodes beyond
    :data:`FIT_GPUS` GPUs, else 1."""
    return 1.0 if topology.num_nodes == 1 else max(1.0, topology.num_gpus / FIT_GPUS)


def layer_floor_s(topology: Topology, config, share: int, micro_batches: int) -> float:
    """The floor ``F`` of one layer of a rank's ``share`` layers (``planning.worth``'s module docstring): the fixed
    floor spread over the share plus the per-layer part, scaled to top-k, the experts across
    nodes and the micro-batches."""
    nodes = topology.num_nodes > 1
    experts = max(topology.num_experts / 64, 1.0) if nodes else 1.0
    per_layer = (config.plan_layer_nodes_s if nodes else config.plan_layer_s) * host_scale(topology, config)
    return (plan_floor_s(topology, config) / max(share, 1) + per_layer * (max(config.top_k, 1) * experts) ** 0.5) \
        * max(micro_batches, 8) / 8 * few_micro_batches(topology, micro_batches)


def few_micro_batches(topology: Topology, micro_batches: int) -> float:
    """The search's floor below 8 micro-batches beyond :data:`FIT_GPUS` GPUs, over what
    :func:`host_scale`'s growth ``g = G / FIT_GPUS`` gives it at 8: ``(sqrt(g) + (g - sqrt(g))
    M / 8) / g``; 1 at 8 micro-batches or more, on one node and up to ``FIT_GPUS`` GPUs.

    The floors were fitted at 8 micro-batches and kept for fewer (a share's fixed Python work
    does not shrink with them): on the stand-ins of ``benchmarks/never_behind.py`` a full
    search at 2 micro-batches took 0.5-1.2x its time at 8 on 8-16 GPUs, 0.53x on 4 x 8 and
    0.65x on 8 x 8. The growth with the GPUs is tensor work (``[M, S, G, J]`` splits and
    estimates), which does shrink with them: on GLM-5 at EP 256 (32 x 8, 2,048 tokens per GPU)
    a share took 0.46 s at 2 micro-batches against 1.75 s at 8 (0.26x), while the floor priced
    both at 2.5 s, so the guard refused the search there and relibra planned 7% slower than
    eplb-oracle (``docs/results.md``, "Fewer micro-batches at 256 GPUs"). Here ``sqrt(g)`` of
    the growth stays and the rest follows ``M / 8``: 0.78x at 2 micro-batches on 4 x 8, 0.63x
    on 8 x 8, 0.44x on 32 x 8; each at or above those measurements but 8 x 8's (0.65x)."""
    g = _gpu_growth(topology)
    if g <= 1 or micro_batches >= 8:
        return 1.0
    return (g ** 0.5 + (g - g ** 0.5) * max(micro_batches, 1) / 8) / g


#: The light tier's host time (:mod:`~relibra_torch.planning.light` and its share's token
#: splits, one thread, at 8 micro-batches) on a rank's share of ``k`` layers of ``E`` experts:
#: ``light_share * floor + k * (LIGHT_LAYER_S + LIGHT_EXPERT_S * E)`` (one node; across nodes
#: the ``_NODES`` pair and the across-nodes floor), in the full search's floors' time (the
#: machine they were fitted on). Measured on the 94 never-behind stand-ins with 256+ tokens
#: per GPU (``benchmarks/never_behind.py``), shares of 1, 2 and 4 layers, on a machine that ran
#: the full search in 0.62-0.77x of those floors (so times 1.4 here): one node 4-6 ms + 0.4-1.6
#: ms per layer (8 to 256 experts), across nodes 8-12 ms + 0.5-10 ms per layer. Its per-layer
#: part follows the experts, not top-k.
LIGHT_LAYER_S, LIGHT_EXPERT_S = 4.9e-4, 6.6e-6
LIGHT_LAYER_NODES_S, LIGHT_EXPERT_NODES_S = 3.0e-4, 5.2e-5
#: A light layer's schedules (``moe.schedule_batch.rank_schedules``) against ``plan_schedule_s``
#: (fitted on the full search's plans): each copy holds its slot all step, one residency, so
#: 0.3-0.7 ms per layer on the same stand-ins and machine, about half (x 1.4) of 1.1 ms. At
#: least that; more with many experts and across nodes (:func:`light_schedule_share`).
LIGHT_SCHEDULE_SHARE = 0.5
#: ``(base, per expert)`` of the light schedules' share, one node and across nodes: measured per
#: light layer with the light tier forced on the 64 stand-ins with 256-1,024 tokens per GPU
#: (one session, divided by that session's host scale): one node 0.36-0.55 of
#: ``plan_schedule_s`` at 8-64 experts, 0.66 at 128, 1.0-1.2 at 256; across nodes 0.75 at 32,
#: 0.97 at 64, 1.25 at 256 experts (16 GPUs' schedules). A share that follows the experts kept
#: 256-expert light plans whose schedules overran the window the constant share expected.
LIGHT_SCHEDULE_EXPERTS = ((0.4, 2.8e-3), (0.7, 2.2e-3))


def light_schedule_share(topology: Topology) -> float:
    """A light layer's schedules as a share of ``plan_schedule_s`` on ``topology``: at least
    :data:`LIGHT_SCHEDULE_SHARE`, growing with the experts (:data:`LIGHT_SCHEDULE_EXPERTS`)."""
    base, per_expert = LIGHT_SCHEDULE_EXPERTS[topology.num_nodes > 1]
    return max(LIGHT_SCHEDULE_SHARE, base + per_expert * topology.num_experts)


def light_floor_s(topology: Topology, config, share: int, micro_batches: int) -> float:
    """The light tier's host time per layer of a rank's ``share`` layers (constants above):
    0 when the light plan is off (``light_share`` 0)."""
    if config.light_share <= 0:
        return 0.0
    fixed = _fixed_floor(topology, config) * light_scale(topology, config)
    return (config.light_share * fixed / max(share, 1) + light_layer_s(topology, config, 8)) * max(micro_batches, 8) / 8


def light_layer_s(topology: Topology, config, micro_batches: int) -> float:
    """The light plan's part per layer of :func:`light_floor_s` (constants above): what one more
    step-long set of a layer costs to build and price, about."""
    nodes = topology.num_nodes > 1
    layer_s = (LIGHT_LAYER_NODES_S + LIGHT_EXPERT_NODES_S * topology.num_experts if nodes
               else LIGHT_LAYER_S + LIGHT_EXPERT_S * topology.num_experts) * light_scale(topology, config)
    return layer_s * max(micro_batches, 8) / 8
