"""Launch torchtitan's trainer (here ``RelibraTrainer``) on CPU ranks.

    torchrun --nproc_per_node 4 -m integrations.torchtitan.example.train_cpu \\
        --module integrations.torchtitan.example --config relibra_qwen3_cpu

Same as ``python -m torchtitan.train`` plus the CPU shim (:mod:`.cpu`); on GPUs use
``torchtitan.train`` directly.
"""

from __future__ import annotations

import torch

from .cpu import enable_cpu, force_sum_reduction


def main(argv: list[str] | None = None):
    enable_cpu()
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    init_logger()
    config = ConfigManager().parse_args(argv)
    trainer = config.build()
    try:
        for part in trainer.model_parts:
            force_sum_reduction(part)
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return trainer


if __name__ == "__main__":
    main()
