"""Exact bounds of the fast path (:mod:`relibra_torch.planning.fastpath`) for the step-long
plans of :func:`relibra_torch.planning.balance.replicate_step`: where the fast path's coarse
bounds (a step's drops against one fill and one latency) do not prove that such a plan loses,
it is planned here exactly as ``replicate_step`` plans it, on the placement the full search
keeps, and priced against the plan without copies by the same ``balance.step_price_L``
(ties keep the plan without copies, ``replicate_step``'s first); plan ``c``'s layers are
settled by running ``replicate_step`` itself.

* ``c``: one step-long set balanced on the step's totals (only without traffic slots): there
  ``replicate_step`` itself is run, and must make no copy;
* ``d``: the set over every free slot (:mod:`relibra_torch.planning.step_set`), after ``r0``
  empty traffic slots per GPU.

Legend: M micro-batches, L layers (those asked about), N nodes, g GPUs per node, G GPUs,
E experts, El native experts per GPU, S source ranks.
"""

from __future__ import annotations

import torch

from .balance import replicate_step, step_price_L
from .step_set import step_long_sets
from .topology import Topology

__all__ = ["c_loses", "d_loses", "search_natives"]


def search_natives(previous_placement_LE: torch.Tensor, topology: Topology, config) -> torch.Tensor:
    """int64 ``[L, G, El]``: each GPU's native experts in slot order on the placement the full
    search plans copies on, when it keeps every expert's GPU: reordering gives them in
    logical order inside a GPU (``fastpath.assign_gpus``), else the previous placement as it is."""
    L, E = previous_placement_LE.shape
    shape = (L, topology.num_gpus, topology.experts_per_gpu)
    if config.reorder:
        gpu_LE = previous_placement_LE // topology.experts_per_gpu
        return (gpu_LE * E + torch.arange(E)).argsort(1).view(shape)
    return torch.empty_like(previous_placement_LE).scatter_(
        1, previous_placement_LE, torch.arange(E).expand(L, E)).view(shape)


def _loses(plan, natives_LG: torch.Tensor, slot_LE: torch.Tensor, load_MLE: torch.Tensor, topology: Topology,
           config) -> bool:
    """Whether ``plan`` prices at least the plan without copies in every layer."""
    M, L = load_MLE.shape[:2]
    N, G, El = topology.num_nodes, topology.num_gpus, topology.experts_per_gpu
    se_MLGl = natives_LG.view(1, L, G, El).expand(M, L, G, El)
    none = (se_MLGl, load_MLE.gather(2, se_MLGl.reshape(M, L, -1)).view(M, L, G, El))
    owner_LE = slot_LE // El
    prices = (config.saved_s_per_token(N), config.replica_fill_s_per_expert, config.fill_latency_s(N))
    return bool((step_price_L(*plan, owner_LE, *prices) >= step_price_L(*none, owner_LE, *prices)).all())


def _kept(placement_LE: torch.Tensor, layers_L: torch.Tensor, topology: Topology, config):
    """``(natives_LG, slot_LE)``: the kept placement's natives per GPU and slot per expert."""
    L = int(layers_L.numel())
    natives_LG = search_natives(placement_LE[layers_L], topology, config).reshape(L, -1)
    slot_LE = torch.empty_like(natives_LG).scatter_(1, natives_LG, torch.arange(natives_LG.shape[1]).expand(L, -1))
    return natives_LG, slot_LE


def d_loses(load_MLE: torch.Tensor, layers_L: torch.Tensor, placement_LE: torch.Tensor, topology: Topology,
            config, r0: int) -> bool:
    """Whether plan ``d`` (module docstring) prices at least the plan without copies in every
    layer of ``layers_L`` (``load_MLE``: int64 ``[M, L_all, E]``)."""
    M, N, L = load_MLE.shape[0], topology.num_nodes, int(layers_L.numel())
    natives_LG, slot_LE = _kept(placement_LE, layers_L, topology, config)
    load_MLE = load_MLE[:, layers_L]
    prefilled = None
    if r0:
        prefilled = (torch.full((M, L, topology.num_gpus, r0), -1, dtype=torch.int64),
                     torch.zeros(M, L, topology.num_gpus, r0, dtype=torch.int64))
    # with the capped sets of step_set.step_long_sets where plain.py weighs them: where its
    # first plan has no traffic slots
    capped = not (config.cross_node_replicas and N > 1 and topology.replica_slots // 2)
    ds = step_long_sets(load_MLE.unsqueeze(2), topology, slot_LE, config.min_replica_tokens_on(N), prefilled,
                        int(config.two_hop), capped)
    return all(_loses(d, natives_LG, slot_LE, load_MLE, topology, config) for d in ds)


def c_loses(own_MLNE: torch.Tensor, layers_L: torch.Tensor, placement_LE: torch.Tensor, topology: Topology,
            config) -> bool:
    """Whether plan ``c`` (module docstring) loses in every layer of ``layers_L`` to the plan
    without copies, and so do the others: ``replicate_step`` without traffic slots is run
    there as the plain plan runs it (``own_MLNE``: int64 ``[M, L_all, N, E]`` demand by source
    node) and makes no copy."""
    M, N, g = own_MLNE.shape[0], topology.num_nodes, topology.gpus_per_node
    _, slot_LE = _kept(placement_LE, layers_L, topology, config)
    own = own_MLNE[:, layers_L]
    L, E = own.shape[1], own.shape[-1]
    # replicate_step reads its sources only per node: each node's demand from its first GPU
    loads_MLSE = torch.zeros(M, L, N, g, E, dtype=torch.int64)
    loads_MLSE[:, :, :, 0] = own
    prices = (config.saved_s_per_token(N), config.replica_fill_s_per_expert, config.fill_latency_s(N))
    se, _ = replicate_step(loads_MLSE.view(M, L, N * g, E), topology, slot_LE, config.min_replica_tokens_on(N),
                           None, config.min_cross_replica_tokens, int(config.two_hop), prices)
    return not bool((se[..., topology.experts_per_gpu:] >= 0).any())
