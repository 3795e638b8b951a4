"""Topology, step plans and the planners that build them from known expert loads.

Every planner is a pure function of count tensors (same input, bit-identical output on any
machine) and returns a :class:`StepPlan`; the stateful :class:`Planner` wrappers remember
the previous placement (and, for EPLB, the load history) between steps.
"""

from .evaluate import PlanMetrics, evaluate
from .plan import StepPlan, plan_digest, token_split, validate_plan
from .topology import Topology

__all__ = [
    "PlanMetrics", "StepPlan", "Topology", "evaluate", "plan_digest", "token_split",
    "validate_plan",
]
