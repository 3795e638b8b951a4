"""Topology, step plans and the planners that build them from known expert loads.

Every planner is a pure function of count tensors (same input, bit-identical output on any
machine) and returns a :class:`StepPlan`; the stateful :class:`Planner` wrappers remember
the previous placement (and, for EPLB, the load history) between steps.

Planners: ``static`` (Megatron-LM / torchtitan contiguous placement), ``eplb`` and
``eplb-oracle`` (DeepSeek EPLB from history / from the step's true loads, tokens split per
physical replica), ``eplb-instance`` and ``eplb-oracle-instance`` (the same with the older
even split over GPU instances), ``online-node`` and ``online-global`` (run-time
per-micro-batch replication from the exact loads, MoonEP-like inside a node and
UltraEP-like anywhere in the EP group), ``relibra`` (reordering + per-micro-batch
replication: cross-node traffic replicas, then intra-node balancing); fed the same replay
as relibra (:mod:`relibra_torch.planning.replay_baselines`): ``eplb-node-demand``
(eplb-oracle plus relibra's step-long node-demand traffic replicas) and
``online-global-planned`` (online-global's solver run ahead, no run-time latency).
"""

from .base import Planner, StaticPlanner, check_loads, native_plan, static_plan
from .eplb import EPLBPlanner, balanced_packing, eplb_plan, eplb_replica_table, replicate_experts
from .evaluate import PlanMetrics, evaluate
from .online import OnlinePlanner, online_global_plan, online_node_plan
from .lis import lis, lis_summary
from .plan import StepPlan, plan_digest, token_split, validate_plan
from .replay_baselines import EPLBNodeDemandPlanner, PlannedOnlinePlanner, eplb_node_demand_plan
from .relibra import ReLibraConfig, ReLibraPlanner, relibra_plan, reorder, replicate
from .topology import Topology

PLANNER_NAMES = ("static", "eplb", "eplb-oracle", "eplb-instance", "eplb-oracle-instance",
                 "online-node", "online-global", "online-global-planned", "eplb-node-demand", "relibra")


def make_planner(name: str, topology: Topology, **kwargs) -> Planner:
    """Build a stateful planner by name (one of :data:`PLANNER_NAMES`).

    ``kwargs`` go to the planner: ``config=ReLibraConfig(...)`` for relibra; ``window``,
    ``num_groups``, ``interval`` and ``relabel`` for the EPLB planners; ``plan_latency_s``
    and ``min_replica_tokens`` for the online planners (``min_replica_tokens`` only for
    online-global-planned); ``num_groups``, ``cross_node_s_per_token`` and
    ``cross_replica_fill_s_per_expert`` for eplb-node-demand.
    """
    if name == "static":
        return StaticPlanner(topology, **kwargs)
    if name in ("eplb", "eplb-oracle", "eplb-instance", "eplb-oracle-instance"):
        return EPLBPlanner(topology, oracle=name.startswith("eplb-oracle"),
                           split="instance" if name.endswith("-instance") else "replica", **kwargs)
    if name in ("online-node", "online-global"):
        return OnlinePlanner(topology, scope=name.split("-", 1)[1], **kwargs)
    if name == "online-global-planned":
        return PlannedOnlinePlanner(topology, **kwargs)
    if name == "eplb-node-demand":
        return EPLBNodeDemandPlanner(topology, **kwargs)
    if name == "relibra":
        return ReLibraPlanner(topology, **kwargs)
    raise ValueError(f"unknown planner {name!r}; allowed: {', '.join(PLANNER_NAMES)}")


__all__ = [
    "EPLBNodeDemandPlanner", "EPLBPlanner", "OnlinePlanner", "PlannedOnlinePlanner", "PLANNER_NAMES",
    "PlanMetrics", "Planner", "ReLibraConfig",
    "ReLibraPlanner", "StaticPlanner", "StepPlan", "Topology", "balanced_packing", "check_loads",
    "eplb_node_demand_plan", "eplb_plan", "eplb_replica_table", "evaluate", "lis", "lis_summary", "make_planner", "native_plan",
    "online_global_plan", "online_node_plan", "plan_digest", "relibra_plan", "reorder",
    "replicate", "replicate_experts", "static_plan", "token_split", "validate_plan",
]
