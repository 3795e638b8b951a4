"""Write the example's routing replay: one ``relibra.routing/1`` file per training step.

Stands in for an RL rollout that recorded ``routed_experts``. Every file holds the step's
``micro_batches x ranks x local_batch_size`` samples of ``seq_len`` tokens, in
(micro-batch, data-parallel rank, row) order, with skewed routing whose hot experts move
from step to step (as in RL batches of different tasks).

    python -m integrations.torchtitan.example.make_replay [--config relibra_qwen3_cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import os

import torch

from relibra_torch.replay import save_routing

from integrations.torchtitan.data import skewed_routing
from integrations.torchtitan.trainer import step_file

from . import config_registry


def write_replay(config, out_dir: str, *, skew: float = 2.5, seed: int = 0) -> list[str]:
    """Files for every step of ``config`` (a RelibraTrainer.Config); returns their paths."""
    model = config.model_spec.model
    moes = [layer.moe for layer in model.layers if getattr(layer, "moe", None) is not None]
    E, K, N = moes[0].num_experts, moes[0].router.top_k, len(moes)
    t = config.training
    ranks = config_registry.EXAMPLE["ranks"]
    samples = t.global_batch_size  # micro_batches * ranks * local_batch_size
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    paths = []
    for step in range(1, t.steps + 1):
        ids_TNK = skewed_routing(samples * t.seq_len, N, E, K, skew=skew, generator=gen)
        offsets = torch.arange(samples + 1, dtype=torch.int64) * t.seq_len
        path = step_file(out_dir, step)
        save_routing(path, ids_TNK, offsets, E, model="qwen3-debugmodel_moe")
        paths.append(path)
    assert samples % (ranks * t.local_batch_size) == 0
    return paths


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="relibra_qwen3_cpu")
    p.add_argument("--out", default=config_registry.REPLAY_DIR)
    p.add_argument("--skew", type=float, default=2.5)
    args = p.parse_args(argv)
    config = getattr(config_registry, args.config)()
    for path in write_replay(config, args.out, skew=args.skew):
        print(path)


if __name__ == "__main__":
    main()
