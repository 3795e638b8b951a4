"""The torchtitan ``@override`` that swaps every ``MoE`` for :class:`RelibraMoE`.

Activate it from a torchtitan config or the command line::

    --override.imports 'integrations.torchtitan.override.relibra_moe={"replica_slots": 2}'

or in Python (``Trainer.Config.override``)::

    OverrideConfig(imports=[("integrations.torchtitan.override.relibra_moe",
                             {"planner": "relibra", "replica_slots": 2, "reorder": True})])

The replacement keeps every field of the original config (router, experts, shared experts,
initialisation, sharding), so parameter names, shapes and initial values are unchanged.
"""

from __future__ import annotations

from torchtitan.config.override import OverrideConfig, apply_overrides, derive, override
from torchtitan.models.common.moe import MoE

from relibra_torch.checks import check_choice, describe
from relibra_torch.planning import PLANNER_NAMES

from .moe import EXPERT_DTYPES, RelibraMoE, RelibraRoutedExperts, declare_placement

__all__ = ["OVERRIDE_TARGET", "relibra_moe", "relibra_moe_config", "apply_relibra", "declare_placement"]

#: What to list in ``override.imports``.
OVERRIDE_TARGET = "integrations.torchtitan.override.relibra_moe"


def relibra_moe_config(cfg: MoE.Config, *, planner: str = "relibra", replica_slots: int = 1,
                       reorder: bool = True, gpus_per_node: int | None = None,
                       expert_dtype: str | None = "bfloat16", refetch_replicas: bool = False,
                       check_plan: bool = True, on_mismatch: str = "degrade", dispatch: str = "flat",
                       planner_options: dict | None = None) -> RelibraMoE.Config:
    """The :class:`RelibraMoE` config that replaces ``cfg`` (all its fields kept).

    Args:
        planner: one of ``relibra_torch.planning.PLANNER_NAMES``.
        replica_slots: replica slots per EP rank (``R``).
        reorder: let the planner move experts between steps (relibra planner).
        gpus_per_node: EP ranks per node; ``None`` treats the EP group as one node.
        expert_dtype: expert GEMM dtype (:data:`~integrations.torchtitan.moe.EXPERT_DTYPES`);
            ``"bfloat16"`` matches torchtitan's ``GroupedExperts``.
        refetch_replicas, check_plan, on_mismatch, dispatch: see :class:`RelibraRoutedExperts.Config`
            (``dispatch="hierarchical"``: DeepEP's normal-mode exchange, one row per (token,
            remote node) then per (token, GPU); default ``"flat"``, one row per pair).
        planner_options: extra planner arguments (``ReLibraConfig`` fields for relibra).
    """
    if not isinstance(cfg, MoE.Config):
        raise TypeError(f"relibra_moe replaces a MoE.Config; got {type(cfg).__name__}")
    check_choice("planner", planner, PLANNER_NAMES)
    if not isinstance(reorder, bool):
        raise TypeError(f"reorder is {describe(reorder)}; allowed: True or False")
    check_choice("expert_dtype", expert_dtype, EXPERT_DTYPES)
    routed = derive(cfg.routed_experts, RelibraRoutedExperts.Config, replica_slots=replica_slots,
                    gpus_per_node=gpus_per_node, expert_dtype=expert_dtype,
                    refetch_replicas=refetch_replicas, check_plan=check_plan, on_mismatch=on_mismatch,
                    dispatch=dispatch)
    routed.sharding_config = declare_placement(routed.sharding_config)
    if planner_options is not None and not isinstance(planner_options, dict):
        raise TypeError(f"planner_options is {describe(planner_options)}; allowed: a dict or None")
    return derive(cfg, RelibraMoE.Config, routed_experts=routed, planner=planner, reorder=reorder,
                  planner_options=planner_options)


@override(target=MoE.Config, description="relibra: replay-balanced expert execution (reordering + replicas)")
def relibra_moe(cfg: MoE.Config, **options) -> RelibraMoE.Config:
    """Swap a torchtitan ``MoE`` for :class:`RelibraMoE`; ``options`` as in :func:`relibra_moe_config`."""
    return relibra_moe_config(cfg, **options)


def apply_relibra(config, **options) -> list[str]:
    """Apply the override to ``config`` (a model config or a ``Trainer.Config``) in place.

    For loops that build torchtitan models without the ``Trainer``. Call it after the model
    config's ``update_from_config`` (as the trainer does), so that the sharding configs it
    sets are carried over. Returns torchtitan's log lines, one per replaced layer.
    """
    return apply_overrides(OverrideConfig(imports=[(OVERRIDE_TARGET, options)]), config)
