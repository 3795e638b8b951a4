"""``RelibraTrainer``: torchtitan's ``Trainer`` that plans every step from its routing replay.

Legend: M micro-batches of a step (gradient accumulation), N MoE layers, B micro-batch rows
(``training.local_batch_size``), S sequence length (``training.seq_len``), K top-k,
P data-parallel ranks.

What it adds to ``Trainer.train_step`` (everything else -- loss, clipping, optimizer, LR,
checkpointing, logging -- is torchtitan's):

1. it fetches the step's ``M`` micro-batches up front (torchtitan does too, to count
   tokens) and reads their replayed expert ids (:class:`RelibraTrainerConfig.source`);
2. before the first forward it runs the planner hook (:class:`TitanBalancer`): all-gather
   of the counts over the EP group, planner, digest check, and, when the placement
   changes, migration of expert weights *and optimizer state* (the same point in the
   loop as a post-step hook of the previous optimizer step: nothing touches parameters in
   between, and it also covers the first step and resumption);
3. before each micro-batch's forward it installs that micro-batch's plan and replayed ids;
4. it adds the planner's numbers (per-layer imbalance before/after, planner time, migrated
   experts) to torchtitan's metrics (``MetricsProcessor`` backends and the console line).

Pipeline parallelism is not supported (one model part).
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import torch

from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from .balancer import TitanBalancer
from .moe import relibra_moe_layers, set_routing_replay

__all__ = ["ROUTING_KEY", "RelibraTrainer", "RelibraTrainerConfig", "micro_batch_routing_from_file",
           "step_file"]

#: Key of the replayed expert ids in a dataloader's ``input_dict`` (``[B, S, N, K]``).
ROUTING_KEY = "routed_experts"


@dataclass(kw_only=True, slots=True)
class RelibraTrainerConfig:
    source: Literal["dataloader", "files", "external"] = "dataloader"
    """Where each micro-batch's replayed expert ids come from:

    - ``dataloader``: ``input_dict["routed_experts"]`` (``[B, S, N, K]``) next to the tokens;
    - ``files``: one ``relibra.routing/1`` file per step, ``<replay_dir>/step_<step:06d>.safetensors``,
      samples in (micro-batch, data-parallel rank, row) order, each ``seq_len`` tokens long;
    - ``external``: the caller (an RL loop) calls ``trainer.set_step_routing(...)`` before
      every ``train_step``.
    """
    replay_dir: str = ""
    """Directory of the per-step files (``source="files"``)."""
    packing: Literal["fixed", "length", "routepack"] = "fixed"
    """How the step's samples are spread over data-parallel ranks and micro-batches
    (``source="files"`` only: the file holds the whole step). ``fixed`` keeps the data
    loader's order; ``length`` / ``routepack`` repack with
    :func:`relibra_torch.planning.packing.pack_replay` (every rank computes the same plan from
    the file) and all-gather the micro-batches' tokens over the data-parallel ranks so each
    rank trains the samples the plan gives it. Samples keep their rows of ``seq_len``
    tokens, so every micro-batch keeps ``local_batch_size`` rows."""
    packing_hardware: str = "h200"
    """Hardware preset that prices the packing objective (``relibra_torch.sim.presets``)."""
    log_metrics: bool = True
    """Add the planner's numbers to torchtitan's metrics."""


def step_file(replay_dir: str, step: int) -> str:
    """Path of step ``step``'s routing file."""
    return os.path.join(replay_dir, f"step_{step:06d}.safetensors")


def micro_batch_routing_from_file(path: str, *, micro_batches: int, dp_degree: int, dp_rank: int,
                                  batch: int, seq_len: int, num_layers: int, num_experts: int | None = None,
                                  top_k: int | None = None) -> list[torch.Tensor]:
    """This rank's ``M`` micro-batches of replayed ids, each int64 ``[B, S, N, K]``.

    The file holds the whole step: ``M * P * B`` samples of ``S`` tokens, sample
    ``(m * P + p) * B + b`` being row ``b`` of micro-batch ``m`` on data-parallel rank ``p``.
    ``num_experts`` / ``top_k`` (the model's, when given) must be the file's: a file recorded
    for another model is refused before any plan is made from it.
    """
    from relibra_torch.replay import load_routing

    replay = load_routing(path)
    for field, want_value in (("num_experts", num_experts), ("top_k", top_k)):
        got = getattr(replay, field)
        if want_value is not None and got != want_value:
            raise ValueError(f"{path}: {field}={got}, but the model's MoE layers have {field}={want_value}; the "
                             f"file was recorded for another model (model={replay.model!r})")
    want = micro_batches * dp_degree * batch
    if replay.num_samples != want:
        raise ValueError(f"{path}: {replay.num_samples} samples, expected micro_batches*dp_degree*"
                         f"local_batch_size = {micro_batches}*{dp_degree}*{batch} = {want}")
    lengths = replay.sample_lengths
    if not bool((lengths == seq_len).all()):
        bad = int((lengths != seq_len).nonzero()[0])
        raise ValueError(f"{path}: sample {bad} has {int(lengths[bad])} tokens, expected seq_len={seq_len}")
    if replay.num_layers != num_layers:
        raise ValueError(f"{path}: num_layers={replay.num_layers}, but the model has {num_layers} MoE layers")
    ids_XSNK = replay.routed_experts_TLK.view(want, seq_len, num_layers, replay.top_k).to(torch.int64)
    ids_MPBSNK = ids_XSNK.view(micro_batches, dp_degree, batch, seq_len, num_layers, replay.top_k)
    return [ids_MPBSNK[m, dp_rank].clone() for m in range(micro_batches)]


class _OptimizerState:
    """``.state`` of every optimizer of torchtitan's container, seen as one mapping."""

    def __init__(self, container):
        optimizers = getattr(container, "optimizers", None) or [container]
        self.state = collections.ChainMap(*[o.state for o in optimizers])


class RelibraTrainer(Trainer):
    """torchtitan ``Trainer`` with per-step planning and per-micro-batch plan installation.

    Use it with the ``relibra_moe`` override active (see ``integrations/torchtitan/README.md``)::

        config = RelibraTrainer.Config(..., override=OverrideConfig(imports=[OVERRIDE_TARGET]))
        trainer = config.build()
        trainer.train()
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        relibra: RelibraTrainerConfig = field(default_factory=RelibraTrainerConfig)

    def __init__(self, config: Config):
        super().__init__(config)
        if self.parallel_dims.pp_enabled:
            raise ValueError("RelibraTrainer does not support pipeline parallelism "
                             "(parallelism.pipeline_parallel_degree must be 1)")
        rc = config.relibra
        if rc.source == "files" and not rc.replay_dir:
            raise ValueError("relibra.source='files' needs relibra.replay_dir")
        if rc.packing not in ("fixed", "length", "routepack"):
            raise ValueError(f"relibra.packing = {rc.packing!r}; allowed: one of 'fixed', 'length', 'routepack'")
        if rc.packing != "fixed" and rc.source != "files":
            raise ValueError(f"relibra.packing={rc.packing!r} needs relibra.source='files' (a source holding "
                             "the whole step's samples); with another data loader, pack with "
                             "relibra_torch.planning.packing.pack_replay and apply its permutation in the "
                             "loader (integrations/torchtitan/README.md)")
        self.model = self.model_parts[0]
        if not relibra_moe_layers(self.model):
            raise ValueError("RelibraTrainer: the model has no RelibraMoE layer; add "
                             "'integrations.torchtitan.override.relibra_moe' to override.imports")
        self.balancer = TitanBalancer(self.model)
        self._external: list[torch.Tensor] | None = None
        self._routing: list[torch.Tensor] | None = None
        self._micro_batch = 0
        self.relibra_metrics: dict[str, float] = {}
        self.relibra_packing: dict[str, float] = {}
        if rc.log_metrics:
            self._wrap_metrics_log()

    # ------------------------------------------------------------------ routing sources

    def set_step_routing(self, routing: Sequence[torch.Tensor]) -> None:
        """Give the next ``train_step`` its replayed ids: ``M`` tensors ``[B, S, N, K]``
        (``relibra.source="external"``), in the order the micro-batches are fetched."""
        self._external = [torch.as_tensor(r) for r in routing]

    def _model_shape(self) -> dict:
        """The routed experts' count and top-k that a replay file must match."""
        layer = self.balancer.moe_layers[0].routed_experts
        return {"num_experts": layer.num_experts, "top_k": layer.top_k}

    def _dp(self) -> tuple[int, int]:
        if self.parallel_dims.dp_enabled:
            mesh = self.parallel_dims.get_mesh("batch")
            return mesh.size(), mesh.get_local_rank()
        return 1, 0

    def _step_routing(self, microbatches) -> list[torch.Tensor]:
        rc = self.config.relibra
        M = len(microbatches)
        if rc.source == "dataloader":
            routing = []
            for m, (input_dict, _) in enumerate(microbatches):
                if ROUTING_KEY not in input_dict:
                    raise ValueError(f"relibra.source='dataloader' but micro-batch {m}'s input_dict has no "
                                     f"{ROUTING_KEY!r} (keys: {sorted(input_dict)})")
                routing.append(input_dict[ROUTING_KEY])
        elif rc.source == "files":
            dp_degree, dp_rank = self._dp()
            routing = micro_batch_routing_from_file(
                step_file(rc.replay_dir, self.step), micro_batches=M, dp_degree=dp_degree, dp_rank=dp_rank,
                batch=self.config.training.local_batch_size, seq_len=self.config.training.seq_len,
                num_layers=self.balancer.num_layers, **self._model_shape())
        else:
            if self._external is None:
                raise ValueError("relibra.source='external': call trainer.set_step_routing(...) before "
                                 "every train_step")
            routing, self._external = self._external, None
        if len(routing) != M:
            raise ValueError(f"step {self.step}: {len(routing)} micro-batches of routing for {M} micro-batches")
        for m, ((_, labels), ids) in enumerate(zip(microbatches, routing)):
            if ids.dim() != 4 or tuple(ids.shape[:2]) != tuple(labels.shape[:2]):
                raise ValueError(f"step {self.step}, micro-batch {m}: routing has shape {tuple(ids.shape)}, "
                                 f"expected [B, S, N, K] with [B, S] = {tuple(labels.shape[:2])}")
        return routing

    # ------------------------------------------------------------------ the step

    def _packed_step(self, microbatches) -> tuple[list, list[torch.Tensor]]:
        """Repack the step (``relibra.packing``): this rank's new micro-batches and routing.

        Sample ``k = (m * P + p) * B + b`` of the step file is row ``b`` of micro-batch ``m``
        on data-parallel rank ``p`` (the data loader's order); the plan moves whole samples,
        so every rank all-gathers the step's token rows and keeps the ones it is given.
        """
        import torch.distributed as dist

        from relibra_torch.planning.packing import PackingConfig, pack_replay
        from relibra_torch.replay import load_routing
        from relibra_torch.sim.cost import expert_cost_model
        from relibra_torch.sim.packed import packing_costs

        rc = self.config.relibra
        M, (P, rank) = len(microbatches), self._dp()
        B, S = self.config.training.local_batch_size, self.config.training.seq_len
        path = step_file(rc.replay_dir, self.step)
        # validates the file (samples, lengths, layers) like the unpacked path
        micro_batch_routing_from_file(path, micro_batches=M, dp_degree=P, dp_rank=rank, batch=B, seq_len=S,
                                      num_layers=self.balancer.num_layers, **self._model_shape())
        replay = load_routing(path)
        layer = self.balancer.moe_layers[0].routed_experts
        topo = layer.topology
        costs = packing_costs(expert_cost_model(layer.dim, layer.hidden_dim, layer.num_experts, layer.top_k,
                                                rc.packing_hardware))
        gpn = topo.gpus_per_node if P % topo.gpus_per_node == 0 else 1
        k = torch.arange(M * P * B)
        fixed = ((k // B) % P, k // (B * P))
        plan = pack_replay(replay, PackingConfig(P, M, B * S, gpus_per_node=gpn, method=rc.packing, seed=self.step),
                           costs, initial=fixed)
        mine = plan.micro_batches_of(rank)

        def gathered(values: list[torch.Tensor]) -> torch.Tensor:
            local = torch.stack(values)  # [M, B, ...]
            if P == 1:
                return local.reshape(M * B, *local.shape[2:])
            group = self.parallel_dims.get_mesh("batch").get_group()
            local_dev = local.to(self.device).contiguous()  # NCCL gathers device tensors only
            parts = [torch.empty_like(local_dev) for _ in range(P)]
            dist.all_gather(parts, local_dev, group=group)
            whole = torch.stack(parts, 1).to(local.device)  # [M, P, B, ...]: sample order of the file
            return whole.reshape(M * P * B, *local.shape[2:])

        keys = [key for key in microbatches[0][0] if key != ROUTING_KEY]
        for key in keys:
            if not isinstance(microbatches[0][0][key], torch.Tensor) or microbatches[0][0][key].shape[:1] != (B,):
                raise ValueError(f"relibra.packing={rc.packing!r} moves whole rows, but input_dict[{key!r}] is not "
                                 f"a tensor of {B} rows")
        inputs = {key: gathered([mb[0][key] for mb in microbatches]) for key in keys}
        labels = gathered([mb[1] for mb in microbatches])
        ids = replay.routed_experts_TLK.view(M * P * B, S, self.balancer.num_layers, replay.top_k).to(torch.int64)
        out, routing = [], []
        for m in range(M):
            rows = mine[m]
            out.append(({key: v[rows].clone() for key, v in inputs.items()}, labels[rows].clone()))
            routing.append(ids[rows].clone())
        moved = int(((plan.rank_N != fixed[0]) | (plan.micro_batch_N != fixed[1])).sum())
        self.relibra_packing = {"relibra/packing_objective_s": plan.objective_s,
                                "relibra/packing_moved_samples": float(moved),
                                **{f"relibra/packing_{k}_s": v for k, v in plan.start_objectives_s.items()
                                   if v is not None}}
        return out, routing

    def train_step(self, data_iterator):
        # torchtitan reads all micro-batches of the step before the first forward as well;
        # reading them here first lets the planner see the whole step.
        microbatches = [next(data_iterator) for _ in range(self.gradient_accumulation_steps)]
        self.relibra_packing = {}
        if self.config.relibra.packing != "fixed":
            microbatches, routing = self._packed_step(microbatches)
        else:
            routing = self._step_routing(microbatches)
        t0 = time.perf_counter()
        self.balancer.plan_step(routing, _OptimizerState(self.optimizers))
        hook_s = time.perf_counter() - t0
        self._routing, self._micro_batch = routing, 0
        self.relibra_metrics = {**self.balancer.metrics(), "relibra/hook_ms": 1000.0 * hook_s,
                                **self.relibra_packing}
        try:
            super().train_step(iter(microbatches))
        finally:
            self._routing = None
            set_routing_replay(self.model, None)

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        m = self._micro_batch
        if self._routing is None or m >= len(self._routing):
            raise RuntimeError("forward_backward_step outside a planned RelibraTrainer.train_step")
        input_dict = {k: v for k, v in input_dict.items() if k != ROUTING_KEY}
        self.balancer.install(m)
        set_routing_replay(self.model, self._routing[m].to(self.device))
        self._micro_batch += 1
        return super().forward_backward_step(input_dict=input_dict, labels=labels,
                                             global_valid_tokens=global_valid_tokens)

    # ------------------------------------------------------------------ metrics

    def _wrap_metrics_log(self) -> None:
        processor = self.metrics_processor
        original = processor.log

        def log(step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
                extra_metrics: dict[str, Any] | None = None):
            extra = {**(extra_metrics or {}), **self.relibra_metrics}
            m = self.relibra_metrics
            if m:
                logger.info(f"relibra step {step}: imbalance {m.get('relibra/imbalance_before/mean', 1.0):.3f}"
                            f" -> {m.get('relibra/imbalance_after/mean', 1.0):.3f}, planner "
                            f"{m['relibra/planner_ms']:.1f} ms, migrated {int(m['relibra/migrated_experts'])} experts")
            return original(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)

        processor.log = log
