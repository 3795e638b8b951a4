"""Rank functions for the RelibraTrainer packing test (torchtitan's loop on gloo ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def trainer_files_run(dump_folder: str, replay_dir: str, steps: int, packing: str) -> dict:
    """RelibraTrainer with ``relibra.source='files'`` and ``relibra.packing``; EP = world size,
    two micro-batches of one 16-token row per rank and step."""
    import os

    from integrations.torchtitan.data import SyntheticDataLoader
    from integrations.torchtitan.example import config_registry as example
    from integrations.torchtitan.example.cpu import enable_cpu, force_sum_reduction
    from integrations.torchtitan.override import OVERRIDE_TARGET
    from integrations.torchtitan.trainer import RelibraTrainerConfig
    from torchtitan.config.override import OverrideConfig

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    enable_cpu()
    world = dist.get_world_size()
    config = example.relibra_qwen3_cpu(n_layers=2, moe_hidden_dim=32)
    model = config.model_spec.model
    config.dataloader = SyntheticDataLoader.Config(vocab_size=model.vocab_size, seed=1)
    config.relibra = RelibraTrainerConfig(source="files", replay_dir=replay_dir, packing=packing)
    config.parallelism.expert_parallel_degree = world
    config.training.seq_len = 16
    config.training.steps = steps
    config.training.global_batch_size = world * 2
    config.dump_folder = dump_folder
    config.override = OverrideConfig(imports=[(OVERRIDE_TARGET, {"planner": "relibra", "replica_slots": 1,
                                                                 "gpus_per_node": 1, "expert_dtype": None})])
    trainer = config.build()
    for part in trainer.model_parts:
        force_sum_reduction(part)
    from _titan_fns import run_trainer

    losses, metrics = run_trainer(trainer)
    return {"losses": losses, "metrics": metrics}
