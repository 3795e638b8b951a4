"""torchtitan config functions for relibra (``--module integrations.torchtitan --config <name>``).

Each returns a :class:`~integrations.torchtitan.trainer.RelibraTrainer.Config` whose
``override.imports`` activates the ``relibra_moe`` override; everything else is the
flavor's torchtitan configuration. Change the relibra options on the command line, e.g.::

    --override.imports 'integrations.torchtitan.override.relibra_moe={"replica_slots": 2, "gpus_per_node": 8}'
    --relibra.source files --relibra.replay_dir /data/replay
"""

from __future__ import annotations

from torchtitan.config.override import OverrideConfig
from torchtitan.models.qwen3 import config_registry as qwen3_registry

from .data import NullTokenizer, SyntheticDataLoader
from .override import OVERRIDE_TARGET
from .trainer import RelibraTrainer, RelibraTrainerConfig

__all__ = ["relibra_qwen3_debugmodel_moe", "to_relibra_trainer_config"]


def to_relibra_trainer_config(config, *, relibra: RelibraTrainerConfig | None = None,
                              **override_options) -> RelibraTrainer.Config:
    """A torchtitan ``Trainer.Config`` as a ``RelibraTrainer.Config`` with the override on.

    Also turns CUDA graphs off: the planned execution reads plan sizes on the host.
    """
    import dataclasses

    config.training.disable_cuda_graphs = True
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    new = RelibraTrainer.Config(**fields, relibra=relibra or RelibraTrainerConfig())
    imports = [e for e in new.override.imports if (e if isinstance(e, str) else e[0]) != OVERRIDE_TARGET]
    new.override = OverrideConfig(imports=[*imports, (OVERRIDE_TARGET, dict(override_options))])
    return new


def relibra_qwen3_debugmodel_moe() -> RelibraTrainer.Config:
    """qwen3 ``debugmodel_moe`` (64 experts, top-8) with EP 8 on one 8-GPU node.

    Synthetic tokens with skewed replayed routing from the dataloader, so it runs without a
    dataset; point ``--relibra.source files --relibra.replay_dir`` (or an RL loop with
    ``source="external"``) at real rollout routing instead.
    """
    config = qwen3_registry.qwen3_moe_debug()
    model = config.model_spec.model
    moe = next(layer.moe for layer in model.layers if getattr(layer, "moe", None) is not None)
    num_moe_layers = sum(getattr(layer, "moe", None) is not None for layer in model.layers)
    config.tokenizer = NullTokenizer.Config(vocab_size=model.vocab_size)
    config.dataloader = SyntheticDataLoader.Config(
        vocab_size=model.vocab_size, num_moe_layers=num_moe_layers, num_experts=moe.num_experts,
        top_k=moe.router.top_k, skew=2.0, shift_every=1)
    config.parallelism.expert_parallel_degree = 8
    config.checkpoint.enable = False
    return to_relibra_trainer_config(config, relibra=RelibraTrainerConfig(source="dataloader"),
                                     planner="relibra", replica_slots=2, gpus_per_node=8)
