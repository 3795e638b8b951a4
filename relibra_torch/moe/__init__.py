"""relibra's MoE layer and the execution engine it shares with the torchtitan integration.

* :mod:`.layer` -- :class:`ReplayBalancedMoE` (router, forward, shared experts) and its
  :class:`MoEConfig`;
* :mod:`.engine` -- :class:`ExpertEngine`: plan install, planned and local execution,
  replica fills, placement and migration (handed the weights, owns no parameters);
* :mod:`.host` -- :class:`EngineHost`, the methods every engine-holding module shares;
  :func:`moe_layers`, :func:`share_replica_memory`, safetensors export/import;
* :mod:`.checkpoint` -- logical <-> physical expert rows, state-dict hooks;
* :mod:`.schedule` -- :class:`LayerPlan` (the hook-to-layer interface) and the host-side
  :class:`RankSchedule` of one rank.
"""

from ..distributed.replicas import ReplicaMemory
from .engine import EXPERT_PARAMS, ExpertEngine
from .host import EngineHost, load_expert_safetensors, moe_layers, save_expert_safetensors, share_replica_memory
from .layer import MoEConfig, ReplayBalancedMoE
from .schedule import LayerPlan, RankSchedule, layer_plans

__all__ = ["EXPERT_PARAMS", "EngineHost", "ExpertEngine", "LayerPlan", "MoEConfig", "RankSchedule",
           "ReplayBalancedMoE", "ReplicaMemory", "layer_plans", "load_expert_safetensors", "moe_layers",
           "save_expert_safetensors", "share_replica_memory"]
