"""relibra for torchtitan 0.3.0: swap MoE layers by configuration, balance them per step.

* :mod:`.moe` -- :class:`RelibraMoE` (torchtitan ``MoE`` with replayed routing, executed by
  relibra's ``ReplayBalancedMoE`` engine), routing replay helpers;
* :mod:`.override` -- the ``@override`` on ``MoE.Config`` (``relibra_moe``) and
  :func:`apply_relibra`;

See ``integrations/torchtitan/README.md``.
"""

from .moe import (RelibraMoE, RelibraRoutedExperts, clear_routing_replay, record_routing,
                  relibra_moe_layers, replay_router_scores, set_routing_replay)
from .override import OVERRIDE_TARGET, apply_relibra, relibra_moe, relibra_moe_config

__all__ = [
    "OVERRIDE_TARGET", "RelibraMoE", "RelibraRoutedExperts", "apply_relibra", "clear_routing_replay",
    "record_routing", "relibra_moe", "relibra_moe_config", "relibra_moe_layers",
    "replay_router_scores", "set_routing_replay",
]
