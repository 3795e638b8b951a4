"""A custom PyTorch training loop with routing replay and the relibra planner hook.

Four CPU processes (gloo) form an expert-parallel mesh of 2 nodes x 2 GPUs. Each rank
trains a small stack of ``ReplayBalancedMoE`` layers on its own micro-batches, whose
expert choices come from a routing replay (synthetic RL-like routing: every sample has a
task, every task its own hot experts per layer, so the hot experts shift between
micro-batches and ranks). Before every step the :class:`~relibra_torch.hook.ReplayBalancer` gathers the
replayed counts, plans (reordering + per-micro-batch intra-node replicas), moves experts
and their AdamW state when the placement changes, and installs each micro-batch's plan.

The same data is trained twice, with the ``static`` planner (Megatron-style placement) and
with ``relibra``: the losses agree to fp32 rounding, while the per-micro-batch expert load
measured from the layers' counters (max GPU / mean GPU) drops.

    python examples/custom_loop.py [--steps 6] [--planner relibra]

Legend: T tokens, D dim, L MoE layers, K top-k, E experts, M micro-batches.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from relibra_torch.hook import ReplayBalancer
from relibra_torch.moe import ReplayBalancedMoE
from relibra_torch.planning import Planner
from relibra_torch.planning.pricing import priced_config
from relibra_torch.testing import run_on_ranks


@dataclass(frozen=True)
class LoopConfig:
    nodes: int = 2
    gpus_per_node: int = 2
    dim: int = 32
    hidden_dim: int = 16
    num_experts: int = 16
    top_k: int = 2
    num_layers: int = 2
    replica_slots: int = 1
    micro_batches: int = 3
    samples_per_micro_batch: int = 4
    max_tokens_per_micro_batch: int = 96
    steps: int = 6
    lr: float = 1e-2
    seed: int = 0


class MoEStack(nn.Module):
    """``L`` pre-norm residual MoE blocks and a linear head; ``routed_experts`` is ``[T, L, K]``."""

    def __init__(self, cfg: LoopConfig, mesh=None):
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(cfg.dim) for _ in range(cfg.num_layers))
        self.moes = nn.ModuleList(
            ReplayBalancedMoE(cfg.dim, cfg.hidden_dim, cfg.num_experts, cfg.top_k, mesh=mesh,
                              replica_slots=cfg.replica_slots)
            for _ in range(cfg.num_layers))
        self.head = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x_TD: torch.Tensor, routed_experts_TLK: torch.Tensor) -> torch.Tensor:
        for l, (norm, moe) in enumerate(zip(self.norms, self.moes)):
            x_TD = x_TD + moe(norm(x_TD), routed_experts_TLK[:, l])
        return self.head(x_TD)


NUM_TASKS = 4  # math, code, science, chat: each with its own hot experts


def task_weights(cfg: LoopConfig) -> torch.Tensor:
    """float64 ``[A, L, E]`` routing preference of each task ``A`` in each layer.

    A layer-wide Zipf-like profile (weight ``1 / rank^2`` over a random order of the
    experts: the few hot experts every task uses) times a task-specific one (``1 / rank``
    over another order), as RL traces show: a few globally hot experts, and hot spots that
    move with the task mix.
    """
    gen = torch.Generator().manual_seed(cfg.seed)
    rank_E = torch.arange(1, cfg.num_experts + 1, dtype=torch.float64)
    w_ALE = torch.empty(NUM_TASKS + 1, cfg.num_layers, cfg.num_experts, dtype=torch.float64)
    for a in range(NUM_TASKS + 1):  # the last row is the layer-wide profile
        for l in range(cfg.num_layers):
            w_ALE[a, l, torch.randperm(cfg.num_experts, generator=gen)] = rank_E ** -(2.0 if a == NUM_TASKS else 1.0)
    return w_ALE[:NUM_TASKS] * w_ALE[NUM_TASKS:]


def make_data(cfg: LoopConfig, step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of one step: ``(x_TD, target_TD, routed_experts_TLK)``.

    The replay stands in for a rollout's recorded routing: each micro-batch is a group of
    responses to one prompt of a random task, and every token picks ``K`` distinct experts
    per layer from that task's preference (times a per-sample lognormal jitter), so the hot
    experts shift between micro-batches and ranks.
    """
    world = cfg.nodes * cfg.gpus_per_node
    w_ALE = task_weights(cfg)
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + step * world + rank)
    out = []
    for _ in range(cfg.micro_batches):
        ids = []
        # GRPO-style: a micro-batch holds a group of responses to one prompt, one task.
        task = int(torch.randint(NUM_TASKS, (), generator=gen))
        for _ in range(cfg.samples_per_micro_batch):
            length = int(torch.randint(8, 33, (), generator=gen))
            w_LE = w_ALE[task] * torch.exp(0.5 * torch.randn(cfg.num_layers, cfg.num_experts, generator=gen,
                                                             dtype=torch.float64))
            # [L, length * K] -> [length, L, K]: each token's K experts are distinct.
            picks = [torch.multinomial(w_LE, cfg.top_k, replacement=False, generator=gen) for _ in range(length)]
            ids.append(torch.stack(picks))
        ids_TLK = torch.cat(ids)[:cfg.max_tokens_per_micro_batch]  # keeps the CPU example quick
        T = ids_TLK.shape[0]
        out.append((torch.randn(T, cfg.dim, generator=gen), torch.randn(T, cfg.dim, generator=gen), ids_TLK))
    return out


def train_rank(cfg: LoopConfig, planner: str | Planner, planner_kwargs: dict | None = None) -> dict:
    """Run on every rank of an initialised gloo group; return losses, balance and weights."""
    torch.manual_seed(cfg.seed)
    mesh = init_device_mesh("cpu", (cfg.nodes, cfg.gpus_per_node), mesh_dim_names=("node", "gpu"))
    model = MoEStack(cfg, mesh)
    # Same logical weights on every rank (and in any single-process reference): build the
    # reference model from the seed and load its logical state dict.
    torch.manual_seed(cfg.seed)
    model.load_state_dict(MoEStack(cfg).state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, foreach=False)
    balancer = ReplayBalancer(model, planner, planner_kwargs)
    # parameters every rank holds whole (router, norms, head) are data parallel: sum grads
    dense = [p for n, p in model.named_parameters() if not n.split(".")[-1].startswith(("w1_", "w2_", "w3_"))]
    world = dist.get_world_size()
    history = []
    for step in range(cfg.steps):
        batches = make_data(cfg, step, dist.get_rank())
        plan = balancer.plan_step([ids for _, _, ids in batches], optimizer)
        loss_sum = torch.zeros(())
        measured = []
        for m, (x_TD, target_TD, ids_TLK) in enumerate(batches):
            balancer.install(m)
            loss = ((model(x_TD, ids_TLK) - target_TD) ** 2).sum()
            loss.backward()
            loss_sum += loss.detach()
            tokens = torch.tensor([[layer.last_expert_tokens for layer in balancer.layers]], dtype=torch.float64)
            gathered = [torch.empty_like(tokens) for _ in range(world)]
            dist.all_gather(gathered, tokens)
            per_gpu_GL = torch.cat(gathered)
            measured.append((per_gpu_GL.max(0).values / per_gpu_GL.mean(0).clamp(min=1e-9)).tolist())
            predicted = plan.slot_tokens_MLGJ[m].sum(-1)[:, dist.get_rank()]
            if not torch.equal(per_gpu_GL[dist.get_rank()].long(), predicted):
                raise AssertionError(f"executed {per_gpu_GL[dist.get_rank()].tolist()} != planned {predicted.tolist()}")
        for p in dense:
            dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss_sum)
        history.append({"loss": float(loss_sum), "measured_imbalance_ML": measured,
                        "planner_s": balancer.report.planner_s,
                        "migrated": balancer.report.migrated_experts,
                        "fell_back": balancer.report.fell_back})
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in model.state_dict().items()}
    return {"history": history, "state": state if dist.get_rank() == 0 else None}


def _mean_imbalance(history: list[dict]) -> float:
    vals = [v for h in history for mb in h["measured_imbalance_ML"] for v in mb]
    return sum(vals) / len(vals)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    cfg = LoopConfig(steps=args.steps)
    world = cfg.nodes * cfg.gpus_per_node
    print(f"{world} gloo ranks as {cfg.nodes} nodes x {cfg.gpus_per_node} GPUs, {cfg.num_layers} MoE layers, "
          f"E={cfg.num_experts}, top-{cfg.top_k}, R={cfg.replica_slots}, {cfg.micro_batches} micro-batches/step")
    runs = {}
    # The planner prices moves and copies for these (tiny) experts on H200. A toy step has
    # ~1000x fewer tokens than a real one, so moving experts would never pay; make
    # migration free here so that reordering shows (replica fills stay priced).
    kwargs = {"relibra": {"config": priced_config(
        cfg.dim, cfg.hidden_dim, "h200", migration_s_per_expert=0.0, intra_migration_s_per_expert=0.0)}}
    for name in ("static", "relibra"):
        t0 = time.perf_counter()
        runs[name] = run_on_ranks(train_rank, world, cfg, name, kwargs.get(name))[0]
        print(f"  {name}: {cfg.steps} steps in {time.perf_counter() - t0:.1f} s")
    print(f"\n{'step':>4} {'loss static':>14} {'loss relibra':>14} {'imb static':>11} {'imb relibra':>12} "
          f"{'moved':>6} {'plan ms':>8}")
    for s in range(cfg.steps):
        a, b = runs["static"]["history"][s], runs["relibra"]["history"][s]
        print(f"{s:>4} {a['loss']:>14.6f} {b['loss']:>14.6f} {_mean_imbalance([a]):>11.3f} "
              f"{_mean_imbalance([b]):>12.3f} {b['migrated']:>6d} {1e3 * b['planner_s']:>8.1f}")
    max_rel = max(
        float(((runs["static"]["state"][k] - v).abs().max() / v.abs().max().clamp(min=1e-12)))
        for k, v in runs["relibra"]["state"].items())
    print(f"\nmeasured max/mean expert tokens per GPU: static {_mean_imbalance(runs['static']['history']):.3f}, "
          f"relibra {_mean_imbalance(runs['relibra']['history']):.3f}")
    print(f"final logical weights, relibra vs static: max relative difference {max_rel:.2e}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
