"""What the layer sends under a plan, predicted: the simulator side of the transfer counts.

:func:`transfer_counts` returns, per micro-batch, layer and GPU, the quantities the layer
counts as it runs (``relibra_torch.moe.counters``, same keys and units) from the plan, its
``token_split`` and its residencies (``planning.residency``). The cost model prices the same
numbers: :func:`replica_traffic` is the replica schedule both use, and the dispatch rows
are ``evaluate``'s. ``tests/test_consistency.py`` runs plans through the layer on gloo ranks
(``relibra_torch.testing.run_plan_transfers``) and asserts equal counts.

Legend: M micro-batches, L layers, G GPUs, J slots per GPU, E experts.
"""

from __future__ import annotations

import torch

from ..checks import check_choice, check_int
from ..planning.evaluate import PlanMetrics, evaluate
from ..planning.plan import StepPlan
from ..planning.price import exchange_collectives
from ..planning.relay import RELAY_COLLECTIVES
from ..planning.residency import Residencies, residencies
from ..planning.two_hop import hop_routes, sequential_hops
from .dispatch import DISPATCH_MODES, hierarchical_rows

__all__ = ["COUNT_KEYS", "hook_step_collectives", "plan_relays_ML", "replica_traffic", "transfer_counts"]

#: The layer's per (micro-batch, layer, GPU) keys (``moe.counters.COUNT_KEYS``; sim cannot
#: import the layer, tests check the two tuples are equal).
COUNT_KEYS = ("cross_node_rows", "intra_node_rows", "fill_bytes_cross", "fill_bytes_intra",
              "grad_return_bytes_cross", "grad_return_bytes_intra", "collectives")


def replica_traffic(res: Residencies, refetch: bool = False) -> dict[str, torch.Tensor]:
    """Weight fetches and gradient returns per GPU, int64 ``[M, L, G]`` each.

    Keys: ``fetch_{recv,send}_{cross,intra}`` (expert weight copies received at the replica's
    GPU / sent by the owner, in that micro-batch: forward, plus the backward's second fetch
    with ``refetch``) and ``return_{send,recv}_{cross,intra}`` (gradient copies sent by the
    replica's GPU / received by the owner, in that micro-batch's backward); ``cross`` when the
    owner is on another node. Kept buffers: one fetch per residency (its first micro-batch
    with tokens) and one return (its last); ``refetch``: two fetches and one return per
    micro-batch with tokens. Second hops (``planning.two_hop``, kept buffers only) come from
    (go to) the hub's GPU over NVLink: in ``*_intra`` (sender or receiver the hub) when they
    ride in the micro-batch's first-hop exchange, else (the hub fills or returns in the same
    micro-batch, ``two_hop.sequential_hops``) in ``fetch2_{recv,send}`` / ``return2_{send,recv}``,
    an exchange of their own after the first hops (fills) or before them (returns).
    """
    M, L, G, J = res.fill_MLGJ.shape
    src, cross_link, seq_fill, seq_ret = hop_routes(res.owner_MLGJ, res.cross_node_MLGJ, res.hubs(refetch),
                                                    res.held_MLGJ, res.fill_start_MLGJ, res.grad_return_MLGJ)
    src = src.clamp(min=0).reshape(M, L, G * J)
    out = {}
    for what, n_MLGJ, seq in (("fetch", res.fetches(refetch), seq_fill), ("return", res.returns(refetch), seq_ret)):
        for link, mask in (("cross", cross_link), ("intra", res.fill_MLGJ & ~cross_link & ~seq), ("2", seq)):
            here = n_MLGJ * mask
            replica_side = here.sum(-1)
            at_src = torch.zeros(M, L, G, dtype=torch.int64).scatter_add_(2, src, here.reshape(M, L, G * J))
            name = f"{what}2" if link == "2" else what
            suffix = "" if link == "2" else f"_{link}"
            if what == "fetch":
                out[f"{name}_recv{suffix}"], out[f"{name}_send{suffix}"] = replica_side, at_src
            else:
                out[f"{name}_send{suffix}"], out[f"{name}_recv{suffix}"] = replica_side, at_src
    return out


def transfer_counts(plan: StepPlan, loads_MLSE: torch.Tensor, routed_ids=None, dispatch: str = "flat",
                    refetch: bool = False, *, expert_params: int, param_bytes: int = 2,
                    grad_bytes: int = 4, check_plan: bool = True,
                    metrics: PlanMetrics | None = None) -> dict[str, torch.Tensor]:
    """The layer's transfer counts under ``plan``, int64 ``[M, L, G]`` per key.

    Args:
        plan: the step plan; loads_MLSE: int ``[M, L, S, E]`` its counts.
        routed_ids: ``[m][s]`` int ``[T, L, K]`` per-token routing in the layer's token order
            (hierarchical dispatch only: its rows depend on which experts each token shares).
        dispatch: ``"flat"`` (one row per token-expert pair) or ``"hierarchical"`` (one row per
            (token, remote node), then per (token, destination GPU):
            :func:`relibra_torch.sim.dispatch.hierarchical_rows`).
        refetch: the layer's ``refetch_replicas``.
        expert_params: weights of one expert (``3 * D * F``).
        param_bytes: bytes per weight the layer is handed (its parameters' dtype).
        grad_bytes: bytes per returned gradient value (4: the layer returns fp32, or the
            weights' dtype if wider).
        check_plan: the layer's ``check_plan`` (one all-reduce per layer and micro-batch).
        metrics: ``evaluate(plan, loads_MLSE)`` if already computed.

    Keys and units: see ``relibra_torch.moe.counters``.
    """
    check_choice("dispatch", dispatch, DISPATCH_MODES)
    check_int("expert_params", expert_params)
    if dispatch == "hierarchical" and routed_ids is None:
        raise ValueError("transfer_counts(dispatch='hierarchical') needs routed_ids: its rows depend on "
                         "which experts each token shares (pass the routing the layer runs)")
    if metrics is None:
        metrics = evaluate(plan, loads_MLSE)
    res = metrics.residency if metrics.residency is not None else residencies(plan)
    traffic = replica_traffic(res, refetch)
    weight, grad = expert_params * param_bytes, expert_params * grad_bytes
    M, L, G, _ = res.fill_MLGJ.shape
    per_layer = layer_collectives_ML(res, plan.topology, dispatch, refetch, check_plan, plan_relays_ML(plan, dispatch))
    if dispatch == "hierarchical":  # relayed tokens are NVLink rows too
        rows = hierarchical_rows(plan, loads_MLSE, routed_ids)
        cross_MLG, intra_MLG = rows["cross_node_rows"], rows["intra_node_rows"] + rows["relay_rows"]
    else:
        cross_MLG, intra_MLG = metrics.cross_send_MLG.clone(), metrics.intra_send_MLG.clone()
    return {
        "cross_node_rows": cross_MLG,
        "intra_node_rows": intra_MLG,
        "fill_bytes_cross": traffic["fetch_recv_cross"] * weight,
        "fill_bytes_intra": (traffic["fetch_recv_intra"] + traffic["fetch2_recv"]) * weight,
        "grad_return_bytes_cross": traffic["return_send_cross"] * grad,
        "grad_return_bytes_intra": (traffic["return_send_intra"] + traffic["return2_send"]) * grad,
        "collectives": per_layer.unsqueeze(-1).expand(M, L, G).contiguous(),
    }


def layer_collectives_ML(res: Residencies, topology, dispatch: str = "flat", refetch: bool = False,
                         check_plan: bool = True, relay_ML: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[M, L]``: collectives one layer issues per micro-batch, forward + backward (every
    rank joins each one, so the count is every GPU's): plan check, the token exchange (flat:
    dispatch and combine each way; hierarchical: ``planning.price.hierarchical_collectives``), a fill
    where a residency starts and a gradient return where one ends, and one more where a
    second hop must wait for its hub in the same micro-batch (``two_hop.sequential_hops``);
    with ``refetch``: fetch, fetch, return wherever a replica
    computes; ``planning.relay.RELAY_COLLECTIVES`` more where ``relay_ML`` (bool ``[M, L]``). None on one GPU."""
    if refetch:
        fills = 3 * res.active_MLGJ.flatten(2).any(-1).to(torch.int64)  # fetch, fetch, return
    else:
        seq_fill, seq_ret = sequential_hops(res.hubs(), res.held_MLGJ, res.fill_start_MLGJ, res.grad_return_MLGJ)
        fills = sum(mask.flatten(2).any(-1).to(torch.int64)
                    for ev, seq in ((res.fill_start_MLGJ, seq_fill), (res.grad_return_MLGJ, seq_ret))
                    for mask in (ev & ~seq, seq))
    exchange = exchange_collectives(topology.num_nodes, topology.gpus_per_node, dispatch)
    relays = 0 if relay_ML is None else RELAY_COLLECTIVES * relay_ML.to(torch.int64)
    return (exchange + int(check_plan) + fills + relays) * int(topology.num_gpus > 1)


def plan_relays_ML(plan: StepPlan, dispatch: str) -> torch.Tensor | None:
    """bool ``[M, L]``: where the plan relays tokens (hierarchical dispatch only), else ``None``."""
    if plan.relay_MLGg is None or dispatch != "hierarchical":
        return None
    return plan.relay_MLGg.flatten(2).any(-1)


def hook_step_collectives(plan: StepPlan, *, uses_pairs: bool = False, split_planning: bool = False,
                          tensors_per_param: int = 1) -> torch.Tensor:
    """int64 ``[G]``: collectives of ``ReplayBalancer.plan_step`` on every GPU.

    Count-shape and count all-gathers (2), the pair-count all-reduce (planners that price
    co-activation), the plan agreement (split planning: inputs digest + plan all-gather;
    otherwise the plan digest all-gather), the failure flag (1), and migration: one
    all-to-all per moved tensor (3 expert weights x ``tensors_per_param``: the weight, its
    gradient if set, optimizer state tensors) of every layer whose placement changed from
    ``plan.previous_placement_LE`` (identity when ``None``).
    """
    G, L, E = plan.topology.num_gpus, plan.num_layers, plan.topology.num_experts
    if G == 1:
        return torch.zeros(1, dtype=torch.int64)
    previous = plan.previous_placement_LE
    if previous is None:
        previous = torch.arange(E).expand(L, E)
    moved_layers = int((plan.placement_LE != previous).any(1).sum())
    n = 2 + int(uses_pairs) + (2 if split_planning else 1) + 1 + 3 * tensors_per_param * moved_layers
    return torch.full((G,), n, dtype=torch.int64)
