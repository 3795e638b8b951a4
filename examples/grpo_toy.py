"""GRPO on a toy arithmetic task with routing replay and relibra balancing, on 4 gloo ranks (CPU).

    .venv/bin/python examples/grpo_toy.py            # about 1-2 minutes on 2 CPU cores
    .venv/bin/python examples/grpo_toy.py --explore  # exploration routing in the rollouts

What happens:

1. *Warm start* (one process): a few supervised steps on ``a+b=`` -> answer so the policy
   is right some of the time (GRPO needs reward variance inside a group).
2. Four ranks = a 2 nodes x 2 GPUs expert-parallel mesh. Each rank holds a *trainer*
   (:class:`TinyMoELM` whose MoE layers are ``ReplayBalancedMoE`` sharded over the mesh, with
   replica slots) and a *rollout engine* (the same model unsharded, synced from the trainer
   before every rollout, as verl/slime sync their inference engines).
3. Every step, on every rank: sample prompts, generate a group of responses per prompt
   with a KV cache while :class:`RoutingRecorder` records every token's experts (optionally
   explored with :class:`ExplorationPolicy`), write the routing replay file, score the answers,
   compute group-normalised advantages.
4. Training: the rank's samples are cut into mini-batches (one optimizer step each) and
   micro-batches. Before each mini-batch, :class:`ReplayBalancer` counts the replayed
   routing of all its micro-batches, all-gathers the counts and plans (reordering +
   replication); before each micro-batch it installs that micro-batch's plan. The trainer
   forward uses the replayed ids (PPO-clipped GRPO loss), the recorder confirms which
   experts it used, and the layers' counters give the tokens every GPU processed.
   The same routing is also pushed through "probe" layers at static placement (contiguous,
   no replicas: Megatron-LM / torchtitan today) to measure the unbalanced baseline.

Printed per step: mean reward, loss, routing agreement between training and rollout with
replay (must be 100%) and of the trainer's own router without replay, and per layer the
measured imbalance (max over GPUs / mean of expert token-rows, averaged over micro-batches)
with static placement vs with relibra.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_lm  # noqa: E402

from relibra_torch.rollout.explore import ExplorationConfig, ExplorationPolicy  # noqa: E402
from relibra_torch.rollout.recorder import RoutingRecorder  # noqa: E402
from relibra_torch.replay.routing import load_routing  # noqa: E402

NUM_NODES, GPUS_PER_NODE = 2, 2


@dataclass(frozen=True)
class Args:
    steps: int = 20
    prompts_per_rank: int = 8
    group_size: int = 8
    mini_batches: int = 2
    micro_batches: int = 2
    max_new_tokens: int = 4
    max_operand: int = 9
    sft_steps: int = 100
    lr: float = 1e-3
    clip: float = 0.2
    replica_slots: int = 1
    planner: str = "relibra"
    explore: bool = False
    seed: int = 0
    out: str = "out/grpo_toy"


def model_config() -> tiny_lm.TinyLMConfig:
    return tiny_lm.TinyLMConfig(vocab_size=tiny_lm.Tokenizer().vocab_size, dim=48, hidden_dim=48,
                                n_layers=2, n_heads=2, num_experts=8, top_k=2)


# ---------------------------------------------------------------------------- warm start


def warm_start(args: Args, path: str) -> float:
    """Supervised steps on the task (one process, unsharded); saves the state dict.

    Returns the greedy accuracy on 200 held-out prompts.
    """
    tok, task = tiny_lm.Tokenizer(), tiny_lm.AdditionTask(args.max_operand)
    torch.manual_seed(args.seed)
    model = tiny_lm.TinyMoELM(model_config())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    rng = random.Random(args.seed)
    for _ in range(args.sft_steps):
        seqs, plens = [], []
        for _ in range(64):
            prompt, answer = task.sample(rng)
            s = tok.encode(prompt)
            plens.append(len(s))
            seqs.append(s + tok.encode(answer, bos=False) + [tok.eos])
        loss = -torch.cat(tiny_lm.sequence_logprobs(model, seqs, plens)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.save(model.state_dict(), path)
    held_out = [task.sample(random.Random(10**6 + i)) for i in range(200)]
    out = tiny_lm.generate(model, [tok.encode(p) for p, _ in held_out], args.max_new_tokens, eos=tok.eos,
                           generator=torch.Generator(), greedy=True)
    return sum(tok.decode(r) == a for r, (_, a) in zip(out.responses(), held_out)) / len(held_out)


# ---------------------------------------------------------------------------- rank side


def _all_gather_scalar(value: float) -> torch.Tensor:
    t = torch.tensor([float(value)], dtype=torch.float64)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


def _imbalance(counter_per_layer: list[int]) -> torch.Tensor:
    """max/mean over GPUs of this micro-batch's counters, per layer (collective)."""
    local = torch.tensor(counter_per_layer, dtype=torch.float64)
    out = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    g = torch.stack(out)  # [G, L]
    return g.max(0).values / g.mean(0).clamp_min(1e-9)


def _split(items: list[int], parts: int) -> list[list[int]]:
    return [items[i * len(items) // parts:(i + 1) * len(items) // parts] for i in range(parts)]


def _full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    # Collective: every rank calls it (expert shards are all-gathered in logical order).
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def rank_main(args_dict: dict, sft_path: str) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from relibra_torch.hook import ReplayBalancer
    from relibra_torch.moe import ReplayBalancedMoE

    args = Args(**args_dict)
    rank, world = dist.get_rank(), dist.get_world_size()
    tok, task = tiny_lm.Tokenizer(), tiny_lm.AdditionTask(args.max_operand)
    cfg = model_config()
    mesh = init_device_mesh("cpu", (NUM_NODES, GPUS_PER_NODE), mesh_dim_names=("node", "gpu"))

    sft = torch.load(sft_path)
    trainer = tiny_lm.TinyMoELM(cfg, mesh=mesh, replica_slots=args.replica_slots)
    trainer.load_state_dict(sft)
    rollout_model = tiny_lm.TinyMoELM(cfg).eval()
    # Static-placement probes: same routing, contiguous placement, no replicas. Only their
    # token counters are read, which do not depend on weights when routing is replayed.
    probes = [ReplayBalancedMoE(cfg.dim, cfg.hidden_dim, cfg.num_experts, cfg.top_k, mesh=mesh)
              for _ in range(cfg.n_layers)]
    moes = [b.moe for b in trainer.blocks]
    dense = [p for p in trainer.parameters() if not isinstance(p, DTensor)]
    optimizer = torch.optim.Adam(trainer.parameters(), lr=args.lr, foreach=False)
    balancer = ReplayBalancer(trainer, planner=args.planner)

    # The trainer's own router choice (no replay), captured from each MoE layer's input.
    free_ids: dict[int, torch.Tensor] = {}

    def capture(layer: int):
        def hook(module, inputs):
            free_ids[layer] = tiny_lm.moe_router_scores(module, inputs[0].detach()).topk(module.top_k).indices
        return hook

    for l, moe in enumerate(moes):
        moe.register_forward_pre_hook(capture(l))

    os.makedirs(args.out, exist_ok=True)
    rows = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        rollout_model.load_state_dict(_full_state_dict(trainer))

        # ---- rollout with recording
        rng = random.Random(args.seed * 1_000_003 + step * 1009 + rank + 17)
        tasks = [task.sample(rng) for _ in range(args.prompts_per_rank)]
        prompts = [tok.encode(p) for p, _ in tasks for _ in range(args.group_size)]
        answers = [a for _, a in tasks for _ in range(args.group_size)]
        policy = None
        if args.explore:
            policy = ExplorationPolicy(ExplorationConfig(enabled=True, seed=args.seed * 7919 + step * 131 + rank))
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
        with RoutingRecorder(rollout_model, model_name="grpo-toy") as rec:
            out = tiny_lm.generate(rollout_model, prompts, args.max_new_tokens, eos=tok.eos, generator=gen,
                                   routing_policy=policy, recorder=rec)
        path = os.path.join(args.out, f"step{step:03d}_rank{rank}.routing.safetensors")
        rec.save(path, out.lengths, sample_step=[step] * len(prompts))
        replay = load_routing(path)  # what a separate trainer process would read

        rewards = torch.tensor([task.reward(a, tok.decode(r)) for a, r in zip(answers, out.responses())])
        grouped = rewards.view(args.prompts_per_rank, args.group_size)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()

        # ---- training with replay and the planner hook
        n_agree = n_free = n_total = 0
        imb_static, imb_relibra, imb_pred = [], [], []
        loss_sum = 0.0
        samples = list(range(len(prompts)))
        for mini in _split(samples, args.mini_batches):
            micro = _split(mini, args.micro_batches)
            routed = [replay.select(ids).routed_experts_TLK.long() for ids in micro]
            balancer.plan_step(routed, optimizer)
            imb_pred.append(balancer.report.predicted_imbalance_ML)
            n_tokens = sum(len(out.sequences[n]) - out.prompt_lens[n] for n in mini)
            for m, ids in enumerate(micro):
                balancer.install(m)
                seqs = [out.sequences[n] for n in ids]
                plens = [out.prompt_lens[n] for n in ids]
                _, sample_T, pos_T = tiny_lm.packed(seqs)
                with RoutingRecorder(trainer) as train_rec:
                    train_rec.next_forward(sample_T, pos_T)
                    logps = tiny_lm.sequence_logprobs(trainer, seqs, plens, routed_experts_TLK=routed[m])
                used = train_rec.replay([len(s) for s in seqs]).routed_experts_TLK.long()
                n_agree += int((used == routed[m]).all(-1).sum())
                free = torch.stack([free_ids[l] for l in range(cfg.n_layers)], dim=1)
                n_free += int((free.sort(-1).values == routed[m].sort(-1).values).all(-1).sum())
                n_total += routed[m].shape[0] * routed[m].shape[1]
                imb_relibra.append(_imbalance([moe.last_expert_tokens for moe in moes]))

                new = torch.cat(logps)
                old = torch.cat([out.logprobs[n] for n in ids])
                a = torch.cat([adv[n].expand(len(out.logprobs[n])) for n in ids])
                ratio = torch.exp(new - old)
                surrogate = torch.minimum(ratio * a, ratio.clamp(1 - args.clip, 1 + args.clip) * a)
                # Global objective = mean over ranks of each rank's per-token mean; the
                # expert gradients already sum over ranks through the all-to-all backward.
                loss = -surrogate.sum() / n_tokens / world
                loss.backward()
                loss_sum += float(loss.detach())

                with torch.no_grad():
                    for l, probe in enumerate(probes):
                        probe(torch.zeros(routed[m].shape[0], cfg.dim), routed_experts=routed[m][:, l])
                imb_static.append(_imbalance([p.last_expert_tokens for p in probes]))
            for p in dense:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        balancer.clear()

        reward = float(_all_gather_scalar(rewards.mean()).mean())
        loss = float(_all_gather_scalar(loss_sum).sum()) / args.mini_batches
        totals = _all_gather_scalar(n_agree), _all_gather_scalar(n_free), _all_gather_scalar(n_total)
        row = {
            "step": step,
            "reward": reward,
            "loss": loss,
            "agree_replay": float(totals[0].sum() / totals[2].sum()),
            "agree_free": float(totals[1].sum() / totals[2].sum()),
            "imb_static_L": torch.stack(imb_static).mean(0).tolist(),
            "imb_relibra_L": torch.stack(imb_relibra).mean(0).tolist(),
            "imb_predicted_L": torch.cat(imb_pred).mean(0).tolist(),
            "seconds": time.perf_counter() - t0,
        }
        rows.append(row)
        if rank == 0:
            print(format_row(row), flush=True)
    return rows


# ---------------------------------------------------------------------------- driver


def format_row(r: dict) -> str:
    layers = "  ".join(f"L{l} {s:.2f}->{b:.2f}" for l, (s, b) in enumerate(zip(r["imb_static_L"], r["imb_relibra_L"])))
    return (f"{r['step']:>4}  {r['reward']:6.3f}  {r['loss']:+8.4f}  {r['agree_replay']:7.1%}  "
            f"{r['agree_free']:7.1%}  {layers}  {r['seconds']:5.1f}s")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Args()
    for name, value in asdict(d).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument(flag, action="store_true", default=value)
        else:
            p.add_argument(flag, type=type(value), default=value)
    args = Args(**vars(p.parse_args(argv)))
    torch.set_num_threads(1)
    from relibra_torch.testing import run_on_ranks

    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    sft_path = os.path.join(args.out, "warm_start.pt")
    acc = warm_start(args, sft_path)
    print(f"warm start: {args.sft_steps} supervised steps, greedy accuracy {acc:.1%} "
          f"({time.perf_counter() - t0:.1f}s)")
    print(f"GRPO: {NUM_NODES}x{GPUS_PER_NODE} EP ranks (gloo), 8 experts top-2, {args.replica_slots} replica "
          f"slot(s)/GPU, planner {args.planner}, {args.prompts_per_rank}x{args.group_size} samples/rank/step, "
          f"{args.mini_batches} optimizer steps x {args.micro_batches} micro-batches, "
          f"exploration {'on' if args.explore else 'off'}")
    print("imbalance = max/mean expert token-rows over the 4 GPUs per MoE layer (layer counters), static -> relibra")
    print("step  reward      loss   agree   own-router  imbalance per layer            time")
    rows = run_on_ranks(rank_main, NUM_NODES * GPUS_PER_NODE, asdict(args), sft_path, timeout_s=600)[0]
    print(summary(rows, args, time.perf_counter() - t0))


def summary(rows: list[dict], args: Args, seconds: float) -> str:
    n = len(rows)
    k = max(1, min(5, n // 2))
    first = sum(r["reward"] for r in rows[:k]) / k
    last = sum(r["reward"] for r in rows[-k:]) / k
    static = torch.tensor([r["imb_static_L"] for r in rows]).mean(0)
    relibra = torch.tensor([r["imb_relibra_L"] for r in rows]).mean(0)
    pred = torch.tensor([r["imb_predicted_L"] for r in rows]).mean(0)
    return (f"{n} steps: mean reward {first:.3f} (first {k}) -> {last:.3f} (last {k}); replay agreement "
            f"{min(r['agree_replay'] for r in rows):.1%} (min), own router {sum(r['agree_free'] for r in rows) / n:.1%} "
            f"(mean); imbalance static {static.mean():.3f} -> relibra {relibra.mean():.3f} (planner predicted "
            f"{pred.mean():.3f}); replay files in {args.out}/; total {seconds:.1f}s")


if __name__ == "__main__":
    main()
