"""The CPU example's torchtitan configs (``--module integrations.torchtitan.example``).

``relibra_qwen3_cpu``: the qwen3 ``debugmodel_moe`` flavor (8 layers, 64 experts, top-8)
on 4 CPU ranks: EP 4 seen as 2 nodes x 2 "GPUs", 1 replica slot per rank, relibra planning
with reordering, routing replayed from one file per step (``make_replay.py``), fp32.
``relibra_qwen3_cpu_small``: the same with 2 layers and a narrow expert hidden size, for a
quick run.
"""

from __future__ import annotations

import os

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.metrics import MetricsProcessor

from integrations.torchtitan.config_registry import to_relibra_trainer_config
from integrations.torchtitan.data import NullTokenizer, SyntheticDataLoader
from integrations.torchtitan.trainer import RelibraTrainerConfig
from torchtitan.models.qwen3 import config_registry as qwen3_registry

from .cpu import cpu_trainer_config

#: Where make_replay.py writes and the example reads the per-step routing files.
REPLAY_DIR = os.environ.get("RELIBRA_REPLAY_DIR", "./outputs/relibra_example/replay")
EXAMPLE = dict(ranks=4, ep=4, gpus_per_node=2, local_batch_size=1, micro_batches=2, seq_len=32, steps=3)


def relibra_qwen3_cpu(n_layers: int | None = None, moe_hidden_dim: int | None = None):
    config = qwen3_registry.qwen3_moe_debug()
    model = config.model_spec.model
    if n_layers is not None:
        model.layers = model.layers[:n_layers]
    if moe_hidden_dim is not None:
        for layer in model.layers:
            layer.moe.routed_experts.inner_experts.hidden_dim = moe_hidden_dim
    e = EXAMPLE
    config.tokenizer = NullTokenizer.Config(vocab_size=model.vocab_size)
    config.dataloader = SyntheticDataLoader.Config(vocab_size=model.vocab_size, seed=0)
    config.training.local_batch_size = e["local_batch_size"]
    config.training.global_batch_size = e["local_batch_size"] * e["ranks"] * e["micro_batches"]
    config.training.seq_len = e["seq_len"]
    config.training.steps = e["steps"]
    config.parallelism.expert_parallel_degree = e["ep"]
    config.lr_scheduler.warmup_steps = 1
    config.metrics = MetricsProcessor.Config(log_freq=1)
    config.checkpoint = CheckpointManager.Config(enable=False)
    config.dump_folder = "./outputs/relibra_example"
    cpu_trainer_config(config)
    return to_relibra_trainer_config(
        config, relibra=RelibraTrainerConfig(source="files", replay_dir=REPLAY_DIR),
        planner="relibra", replica_slots=1, gpus_per_node=e["gpus_per_node"], expert_dtype=None,
        # Tiny CPU steps never pay for a migration at H200 prices; make moving experts free
        # so the example shows reordering.
        planner_options={"migration_s_per_expert": 0.0, "intra_migration_s_per_expert": 0.0})


def relibra_qwen3_cpu_small():
    return relibra_qwen3_cpu(n_layers=2, moe_hidden_dim=64)
