"""Module-level functions the torchtitan integration tests run in one process or on gloo ranks.

Legend: S sequence length, B batch (micro-batch rows), N MoE layers, K top-k, M micro-batches.

A *workload* is ``steps x ranks x micro-batches`` of ``(tokens_BS, labels_BS, ids_BSNK)``:
every rank trains on its own micro-batches with their replayed routing. The one-process
reference runs all ranks' micro-batches of a step one after the other (gradient
accumulation), which is the same sum of gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import titan_fixtures as tf


def make_workload(name: str, *, steps: int, ranks: int, micro_batches: int, batch: int, seq: int,
                  seed: int, skew: float = 3.0, n_layers: int = 2):
    """Random tokens and skewed replayed routing (a few hot experts per layer and step)."""
    cfg = tf.model_config(name, n_layers=n_layers)
    moe = next(layer.moe for layer in cfg.layers if getattr(layer, "moe", None) is not None)
    E, K, N = moe.num_experts, moe.router.top_k, tf.num_moe_layers(cfg)
    gen = torch.Generator().manual_seed(seed)
    work = []
    for _ in range(steps):
        # Hot experts shift from step to step and layer to layer.
        logits_NE = torch.randn(N, E, generator=gen) * skew
        per_rank = []
        for _ in range(ranks):
            mbs = []
            for _ in range(micro_batches):
                x, y = tf.tokens(batch, seq, cfg.vocab_size, int(torch.randint(0, 2**31, (1,), generator=gen)))
                noise = torch.rand(batch * seq, N, E, generator=gen)
                # Gumbel top-k without replacement: distinct experts per token.
                keys = logits_NE.unsqueeze(0) - torch.log(-torch.log(noise.clamp(1e-9, 1 - 1e-9)))
                ids = keys.topk(K, dim=-1).indices.view(batch, seq, N, K)
                mbs.append((x, y, ids))
            per_rank.append(mbs)
        work.append(per_rank)
    return work


def _optimizer(model):
    # A large eps keeps the update a smooth function of the gradient: with eps=1e-8, entries whose
    # gradient is ~1e-8 turn fp32 summation-order noise into O(lr) differences.
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-3, weight_decay=0.1, foreach=False)


def reference_train(name: str, model_kwargs: dict, full_params: dict, work) -> dict:
    """One process: the swapped model, all ranks' micro-batches accumulated per step."""
    from integrations.torchtitan import set_routing_replay

    torch.set_num_threads(1)
    model = tf.build(tf.relibra_config(name, **model_kwargs))
    tf.load_full_params(model, full_params)
    opt = _optimizer(model)
    losses = []
    for per_rank in work:
        total = sum(y.numel() for mbs in per_rank for _, y, _ in mbs)
        opt.zero_grad()
        step_loss = 0.0
        for mbs in per_rank:
            for x, y, ids in mbs:
                set_routing_replay(model, ids)
                loss = tf.loss_fn(model(x), y) / total
                loss.backward()
                step_loss += loss.item()
        opt.step()
        losses.append(step_loss)
    return {"losses": losses, "params": tf.gather_full_params(model)}


def ep_train(name: str, model_kwargs: dict, full_params: dict, work, planner_kwargs: dict | None = None,
             keep_model: bool = False, ac: str | None = None):
    """On every rank of an EP group of the world size: the same steps, balanced by the planner."""
    from integrations.torchtitan import relibra_moe_layers, set_routing_replay
    from integrations.torchtitan.balancer import TitanBalancer

    torch.set_num_threads(1)
    world = dist.get_world_size()
    rank = dist.get_rank()
    dims = tf.parallel_dims(world, ep=world)
    cfg = tf.relibra_config(name, ep=world, **model_kwargs)
    ac_config = None
    if ac is not None:
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
        ac_config = {"full": FullAC.Config(), "selective": SelectiveAC.Config()}[ac]
    model = tf.build_parallel(name, cfg, dims, full_params, ac_config=ac_config)
    opt = _optimizer(model)
    balancer = TitanBalancer(model, planner_kwargs=planner_kwargs)
    losses, reports, fills = [], [], 0
    for per_rank in work:
        mbs = per_rank[rank]
        total = sum(y.numel() for m in per_rank for _, y, _ in m)
        opt.zero_grad()
        balancer.plan_step([ids for _, _, ids in mbs], opt)
        step_loss = torch.zeros(())
        for m, (x, y, ids) in enumerate(mbs):
            balancer.install(m)
            set_routing_replay(model, ids)
            loss = tf.loss_fn(model(x), y) / total
            loss.backward()
            step_loss += loss.detach()
            fills += sum(len(layer.routed_experts.last_fills) for layer in balancer.moe_layers)
        opt.step()
        dist.all_reduce(step_loss)
        losses.append(float(step_loss))
        reports.append(balancer.metrics())
    layers = relibra_moe_layers(model)
    placements = [layer.routed_experts.placement_E.clone() for layer in layers]
    params = tf.gather_full_params(model)
    out = {"losses": losses, "params": params if rank == 0 else None, "reports": reports,
           "placements": placements, "fills": fills,
           "exchange": [None if l.routed_experts.engine.last_exchange is None else
                        (l.routed_experts.engine.dispatch, l.routed_experts.engine.last_exchange.as_dict())
                        for l in layers]}
    if keep_model:
        out["model"] = model
    return out


def ep_dcp_roundtrip(name: str, model_kwargs: dict, full_params: dict, work, ckpt_dir: str,
                     planner_kwargs: dict | None = None):
    """Train (reordering the experts), write a DCP checkpoint of the swapped EP model, then
    (after the caller rewrote it through the original model) load it back into a swapped
    EP model with another placement."""
    import torch.distributed.checkpoint as dcp

    out = ep_train(name, model_kwargs, full_params, work, planner_kwargs, keep_model=True)
    model = out.pop("model")
    dcp.save(model.state_dict(), checkpoint_id=ckpt_dir)
    dist.barrier()
    return out


def ep_load_checkpoint(name: str, model_kwargs: dict, full_params: dict, ckpt_dir: str, seed: int):
    """A swapped EP model with a random placement, loaded from ``ckpt_dir``: its logical
    parameters (rank 0) and the placements it used."""
    import torch.distributed.checkpoint as dcp
    from integrations.torchtitan import relibra_moe_layers

    torch.set_num_threads(1)
    world = dist.get_world_size()
    dims = tf.parallel_dims(world, ep=world)
    model = tf.build_parallel(name, tf.relibra_config(name, ep=world, **model_kwargs), dims, full_params)
    gen = torch.Generator().manual_seed(seed)
    placements = []
    for layer in relibra_moe_layers(model):
        p = torch.randperm(layer.routed_experts.num_experts, generator=gen)
        layer.routed_experts.apply_placement(p)
        placements.append(p)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=ckpt_dir)
    model.load_state_dict(sd)
    params = tf.gather_full_params(model)
    return {"params": params if dist.get_rank() == 0 else None, "placements": placements}


def build_trainer(dump_folder: str, steps: int, override: dict, relibra: dict, **dataloader) -> object:
    """A RelibraTrainer for the CPU example model on the pool's ranks, EP = world size, two
    micro-batches of one 16-token row per rank and step; ``relibra`` are the
    ``RelibraTrainerConfig`` fields, ``dataloader`` extra ``SyntheticDataLoader.Config`` fields."""
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
    config.dataloader = SyntheticDataLoader.Config(vocab_size=model.vocab_size, seed=1, **dataloader)
    config.relibra = RelibraTrainerConfig(**relibra)
    config.parallelism.expert_parallel_degree = world
    config.training.seq_len = 16
    config.training.steps = steps
    config.training.global_batch_size = world * 2  # two micro-batches per rank and step
    config.dump_folder = dump_folder
    config.override = OverrideConfig(imports=[(OVERRIDE_TARGET, override)])
    trainer = config.build()
    for part in trainer.model_parts:
        force_sum_reduction(part)
    return trainer


def trainer_run(dump_folder: str, steps: int, override: dict) -> dict:
    """torchtitan's training loop (RelibraTrainer) on the pool's ranks, EP = world size."""
    trainer = build_trainer(dump_folder, steps, override, {"source": "dataloader"},
                            num_moe_layers=2, num_experts=64, top_k=8, skew=2.5)
    losses, metrics = run_trainer(trainer)
    return {"losses": losses, "metrics": metrics,
            "placement": [layer.routed_experts.placement_E.tolist()
                          for layer in trainer.balancer.moe_layers]}


def trainer_files_run(dump_folder: str, replay_dir: str, steps: int, packing: str) -> dict:
    """RelibraTrainer with ``relibra.source='files'`` and ``relibra.packing`` (see :func:`build_trainer`)."""
    trainer = build_trainer(dump_folder, steps, {"planner": "relibra", "replica_slots": 1, "gpus_per_node": 1,
                                                 "expert_dtype": None},
                            {"source": "files", "replay_dir": replay_dir, "packing": packing})
    losses, metrics = run_trainer(trainer)
    return {"losses": losses, "metrics": metrics}


def run_trainer(trainer) -> tuple[list[float], list[dict]]:
    """torchtitan's training loop, step by step as ``Trainer.train`` runs it: every logged
    loss and the balancer's metrics after each step."""
    logged = []
    inner = trainer.metrics_processor.log

    def record(step, loss, max_loss, grad_norm, extra_metrics=None):
        logged.append(loss)
        return inner(step, loss, max_loss, grad_norm, extra_metrics=extra_metrics)

    trainer.metrics_processor.log = record
    metrics = []
    data = trainer.batch_generator(trainer.dataloader)
    while trainer.should_continue_training():
        trainer.step += 1
        trainer.train_step(data)
        metrics.append(dict(trainer.relibra_metrics))
    return logged, metrics


def efsdp_reorder_error(name: str, n_layers: int, ep: int) -> str:
    """EP smaller than the data-parallel world: the experts are FSDP-sharded inside the EP
    group, and reordering must refuse with a clear error (rather than move wrong rows)."""
    from integrations.torchtitan import relibra_moe_layers

    torch.set_num_threads(1)
    dims = tf.parallel_dims(dist.get_world_size(), ep=ep)
    model = tf.build_parallel(name, tf.relibra_config(name, n_layers=n_layers, ep=ep), dims)
    layer = relibra_moe_layers(model)[0].routed_experts
    try:
        layer.apply_placement(torch.randperm(layer.num_experts, generator=torch.Generator().manual_seed(0)))
    except ValueError as exc:
        return str(exc)
    return ""
