"""Topology, step plans and the planners that build them from known expert loads.

Every planner is a pure function of count tensors (same input, bit-identical output on any
machine) and returns a :class:`StepPlan`; the stateful :class:`Planner` wrappers remember
the previous placement (and, for EPLB, the load history) between steps.

Planners: ``static`` (Megatron-LM / torchtitan contiguous placement), ``eplb`` and
``eplb-oracle`` (DeepSeek EPLB from history / from the step's true loads), ``relibra``
(reordering + per-micro-batch intra-node replication).
"""

from .base import Planner, StaticPlanner, check_loads, native_plan, static_plan
from .eplb import EPLBPlanner, balanced_packing, eplb_plan, replicate_experts
from .evaluate import PlanMetrics, evaluate
from .lis import lis, lis_summary
from .plan import StepPlan, plan_digest, token_split, validate_plan
from .relibra import ReLibraConfig, ReLibraPlanner, relibra_plan, reorder, replicate
from .topology import Topology

PLANNER_NAMES = ("static", "eplb", "eplb-oracle", "relibra")


def make_planner(name: str, topology: Topology, **kwargs) -> Planner:
    """Build a stateful planner by name (one of :data:`PLANNER_NAMES`).

    ``kwargs`` go to the planner: ``config=ReLibraConfig(...)`` for relibra, ``window`` and
    ``num_groups`` for the EPLB planners.
    """
    if name == "static":
        return StaticPlanner(topology, **kwargs)
    if name in ("eplb", "eplb-oracle"):
        return EPLBPlanner(topology, oracle=name == "eplb-oracle", **kwargs)
    if name == "relibra":
        return ReLibraPlanner(topology, **kwargs)
    raise ValueError(f"unknown planner {name!r}; allowed: {', '.join(PLANNER_NAMES)}")


__all__ = [
    "EPLBPlanner", "PLANNER_NAMES", "PlanMetrics", "Planner", "ReLibraConfig", "ReLibraPlanner",
    "StaticPlanner", "StepPlan", "Topology", "balanced_packing", "check_loads", "eplb_plan",
    "evaluate", "lis", "lis_summary", "make_planner", "native_plan", "plan_digest", "relibra_plan", "reorder",
    "replicate", "replicate_experts", "static_plan", "token_split", "validate_plan",
]
