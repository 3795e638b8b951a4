"""torchtitan-compatible MoE layer executed by relibra (replayed routing, step plans, EP).

Legend (the package's, docs/architecture.md): B batch, Q sequence length, D model dim,
F expert hidden dim, E logical experts, K top-k, L MoE layers, T = B * Q tokens of this
rank, El = E / G native experts per EP rank, G EP ranks. (torchtitan writes L for the
sequence length; relibra keeps L for MoE layers everywhere.)

:class:`RelibraMoE` subclasses torchtitan's ``MoE`` and keeps its module tree and state
names: ``router.gate``, ``routed_experts.inner_experts.{w1_EFD, w2_EDF, w3_EFD}``,
``shared_experts``, the persistent ``expert_bias_E`` and the non-persistent
``tokens_per_expert_E`` (so torchtitan's aux-loss-free bias hook, DCP checkpoints and the
Hugging Face state-dict adapters keep working). What changes:

* routing can be *replayed*: with ids installed (:func:`set_routing_replay`), the router
  only computes the gate scores and gathers them at the recorded experts (verl's R3
  convention: ids replayed, gate values from the current weights);
* the routed experts (:class:`RelibraRoutedExperts`) execute relibra's per-micro-batch
  plan: tokens go to native or replica slots, replicas are filled from their owners and
  their gradients sent home, and the expert rows live in the *placement* chosen by the
  planner (``placement_E``: logical expert -> physical native slot). State dicts
  always hold the experts in logical order (the identity placement), whatever the
  placement in force.

Without an EP mesh (one process) the layer computes every expert locally; the result is
torchtitan's up to floating-point summation order.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator

import spmd_types as spmd
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.models.common.decoder_sharding import dense_param_placement
from torchtitan.models.common.moe import MoE, RoutedExperts, TokenChoiceTopKRouter

from relibra_torch.checks import check_choice, check_int
from relibra_torch.distributed.mesh import EPGroup
from relibra_torch.moe import EXPERT_PARAMS, EngineHost, ExpertEngine
from relibra_torch.moe.engine import DISPATCH_MODES, MISMATCH_MODES
from relibra_torch.planning.topology import Topology

__all__ = [
    "RelibraMoE",
    "RelibraRoutedExperts",
    "EXPERT_DTYPES",
    "placement_sharding_layout",
    "declare_placement",
    "relibra_moe_layers",
    "set_routing_replay",
    "clear_routing_replay",
    "record_routing",
    "replay_router_scores",
]

#: Allowed values of ``expert_dtype``: the dtype of the expert GEMMs. ``"bfloat16"`` is
#: what torchtitan's ``GroupedExperts`` does (it casts inputs and weights to bf16);
#: ``None`` keeps the parameters' dtype (use it for fp32 training and tests).
EXPERT_DTYPES = ("bfloat16", "float16", "float32", None)


def _check_config(cfg: "RelibraRoutedExperts.Config") -> None:
    check_choice("expert_dtype", cfg.expert_dtype, EXPERT_DTYPES)
    check_choice("on_mismatch", cfg.on_mismatch, MISMATCH_MODES)
    check_choice("dispatch", cfg.dispatch, DISPATCH_MODES)
    check_int("replica_slots", cfg.replica_slots, 0)
    if cfg.gpus_per_node is not None:
        check_int("gpus_per_node", cfg.gpus_per_node, 1)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _ep_group(mesh, gpus_per_node: int | None) -> EPGroup:
    """relibra's EP layout for torchtitan's 1-D ``ep`` mesh split into nodes of ``gpus_per_node``."""
    if mesh is None:
        return EPGroup(1, 1, 0, None, None)
    G = mesh.size()
    g = G if gpus_per_node is None else gpus_per_node
    if G % g:
        raise ValueError(f"gpus_per_node={g} does not divide the EP degree {G}; the EP group must "
                         f"be whole nodes")
    return EPGroup(G // g, g, mesh.get_local_rank(), mesh.get_group(), mesh)


class RelibraRoutedExperts(EngineHost, RoutedExperts):
    """torchtitan ``RoutedExperts`` executed by relibra's :class:`~relibra_torch.moe.ExpertEngine`.

    Same children as the original: ``inner_experts`` (torchtitan ``GroupedExperts``) holds
    the expert weights under their torchtitan names and shapes; the token-dispatcher config
    is kept but unused. The module holds an engine (``self.engine``), the same one
    :class:`~relibra_torch.moe.ReplayBalancedMoE` uses, and hands it those weights; the
    shared :class:`~relibra_torch.moe.EngineHost` methods (``set_plan``,
    ``apply_placement``, counters, logical weights, checkpoint hooks) act on them. Adds the
    non-persistent buffer ``placement_E`` (int64 ``[E]``, logical expert -> physical native
    slot, identity at start), declared replicated in the sharding config.

    Replica slots are not buffers of this module: a fill allocates them for one micro-batch
    (``relibra_torch.distributed.replicas``) and autograd frees them after the backward that
    used them, so nothing about them needs a sharding declaration.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        replica_slots: int = 1
        """Extra expert slots per EP rank filled per micro-batch (``R``)."""
        gpus_per_node: int | None = None
        """EP ranks per node (the planner's node boundaries: inter-node vs NVLink); ``None``: one node."""
        expert_dtype: str | None = "bfloat16"
        """dtype of the expert GEMMs and token exchange, one of :data:`EXPERT_DTYPES`."""
        refetch_replicas: bool = False
        """Fetch replica weights again in backward instead of keeping them alive."""
        check_plan: bool = True
        """Check every forward that this rank's routing matches the installed plan."""
        on_mismatch: str = "degrade"
        """Routing that does not match the plan: ``"degrade"`` (run on the current placement
        without replicas, warn once, count) or ``"raise"`` (see ``relibra_torch.moe.MoEConfig``)."""
        dispatch: str = "flat"
        """Token exchange: ``"flat"`` (one row per token-expert pair) or ``"hierarchical"``
        (DeepEP's normal mode: one row per (token, remote node), then per (token, GPU) over
        NVLink; see ``relibra_torch.moe.MoEConfig``). Needs ``gpus_per_node`` to matter."""

    def __init__(self, config: Config):
        _check_config(config)
        super().__init__(config)
        ie = config.inner_experts
        self.dim, self.hidden_dim, self.num_experts = ie.dim, ie.hidden_dim, ie.num_experts
        self.top_k = config.token_dispatcher.top_k
        self.gpus_per_node = config.gpus_per_node
        self.expert_dtype = None if config.expert_dtype is None else getattr(torch, config.expert_dtype)
        self.engine = ExpertEngine(Topology(1, 1, self.num_experts, config.replica_slots), _ep_group(None, None),
                                   refetch_replicas=config.refetch_replicas, check_plan=config.check_plan,
                                   on_mismatch=config.on_mismatch, dispatch=config.dispatch)
        self.register_buffer("placement_E", torch.arange(self.num_experts), persistent=False)
        self._register_logical_checkpoint()

    def expert_params(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self.inner_experts, n) for n in EXPERT_PARAMS}

    def expert_param_key(self, name: str) -> str:
        return f"inner_experts.{name}"

    @property
    def ep(self) -> EPGroup:
        """This layer's EP group (one process: size 1, no process group)."""
        return self.engine.ep

    def _init_self_parameters(self) -> None:
        return None

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        # After to_empty() the placement holds garbage; freshly initialised weights are in
        # logical order.
        if buffer_device is None:
            buffer_device = self.placement_E.device
        self.placement_E = torch.arange(self.num_experts, device=buffer_device)
        self.engine.set_placement(torch.arange(self.num_experts), self.placement_E)

    def parallelize(self, parallel_dims) -> None:
        """Shard the expert rows over torchtitan's EP mesh and adopt it as the EP group."""
        if parallel_dims.tp > 1:
            raise ValueError("RelibraMoE does not support tensor parallelism inside the MoE "
                             f"(tensor_parallel_degree={parallel_dims.tp}); use EP and FSDP")
        # A sharding config set after the override (e.g. by update_from_config) lacks it.
        self._sharding_config = declare_placement(self._sharding_config)
        RoutedExperts.parallelize(self, parallel_dims)
        ep = _ep_group(parallel_dims.get_optional_mesh("ep"), self.gpus_per_node)
        if self.num_experts % ep.size:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by the EP degree {ep.size}")
        old = self.engine
        self.engine = ExpertEngine(Topology(ep.num_nodes, ep.gpus_per_node, self.num_experts,
                                            old.topology.replica_slots), ep,
                                   refetch_replicas=old.refetch_replicas, check_plan=old.check_plan,
                                   on_mismatch=old.on_mismatch, replica_memory=old.replica_memory,
                                   dispatch=old.dispatch)

    def apply_placement(self, new_placement_E: torch.Tensor, optimizer=None) -> int:
        """Move expert rows (weights, gradients, optimizer state) to ``new_placement_E``.

        See :meth:`relibra_torch.moe.EngineHost.apply_placement`. Needs every EP rank to hold
        its ``E / EP`` expert rows whole, i.e. no FSDP sharding of the experts inside the EP
        group (``data_parallel_shard_degree * context_parallel_degree == expert_parallel_degree``).
        """
        rows = _local(self.inner_experts.w1_EFD).shape[0]
        if rows != self.topology.experts_per_gpu:
            raise ValueError(
                f"cannot reorder experts: this rank holds {rows} rows of w1_EFD, expected "
                f"E/EP = {self.topology.experts_per_gpu}; the experts are also FSDP-sharded inside "
                f"the EP group. Use data_parallel_shard_degree * context_parallel_degree == "
                f"expert_parallel_degree, or reorder=False / planner='static'")
        return super().apply_placement(new_placement_E, optimizer)

    def forward(  # noqa: D401 - torchtitan RoutedExperts signature
        self,
        x_BLD: torch.Tensor,
        topk_scores_BLK: torch.Tensor,
        topk_expert_ids_BLK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> torch.Tensor:
        # The argument names are torchtitan's (its sharding declarations key on them, and its
        # L is the sequence length); inside, relibra's legend: Q sequence length.
        x_BQD, topk_scores_BQK, topk_expert_ids_BQK = x_BLD, topk_scores_BLK, topk_expert_ids_BLK
        x_BQD = _local(x_BQD)
        B, Q, D = x_BQD.shape
        K = topk_scores_BQK.shape[-1]
        x_TD = x_BQD.reshape(B * Q, D)
        if self.expert_dtype is not None:
            x_TD = x_TD.to(self.expert_dtype)
        ids_TK = _local(topk_expert_ids_BQK).reshape(B * Q, K).to(torch.int64)
        gates_TK = _local(topk_scores_BQK).reshape(B * Q, K)
        out_TD = self._run_experts(x_TD, ids_TK, gates_TK)
        return out_TD.to(x_BQD.dtype).view(B, Q, D)


def replay_router_scores(router: TokenChoiceTopKRouter, x_BQD: torch.Tensor,
                         expert_ids_BQK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchtitan's router with the expert choice replaced by ``expert_ids_BQK``.

    Computes the gate scores exactly as ``TokenChoiceTopKRouter.forward`` (fp32 gate,
    softmax or sigmoid), gathers them at the replayed experts, then applies ``route_norm``
    and ``route_scale``. The expert bias only steers the choice, so it plays no part.

    Returns:
        ``(topk_scores_BQK, expert_ids_BQK, scores_BQE)`` like the router.
    """
    with torch.autocast(device_type=x_BQD.device.type, dtype=torch.float32):
        scores_BQE = router.gate(x_BQD)
    if router.score_func == "sigmoid":
        scores_BQE = torch.sigmoid(scores_BQE)
    elif router.score_func == "softmax":
        scores_BQE = F.softmax(scores_BQE, dim=-1)
    else:
        raise NotImplementedError(f"Unknown score function {router.score_func}")
    ids_BQK = expert_ids_BQK.to(device=scores_BQE.device, dtype=torch.int64)
    # -1 pads: gate 0 (route_norm then normalises over the token's real experts)
    topk_scores_BQK = scores_BQE.gather(dim=-1, index=ids_BQK.clamp(min=0)).masked_fill(ids_BQK < 0, 0.0)
    if router.route_norm:
        topk_scores_BQK = topk_scores_BQK / (topk_scores_BQK.sum(dim=-1, keepdim=True) + 1e-20)
    topk_scores_BQK = topk_scores_BQK * router.route_scale
    return topk_scores_BQK, ids_BQK, scores_BQE


class RelibraMoE(MoE):
    """torchtitan ``MoE`` with replayed routing and relibra's balanced expert execution.

    Build it with the ``@override`` in :mod:`integrations.torchtitan.override` (or
    :func:`integrations.torchtitan.override.relibra_moe_config`). Step-level options
    (planner, reordering) live here so that the trainer can read them from the model.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(MoE.Config):
        planner: str = "relibra"
        """Planner name (``relibra_torch.planning.PLANNER_NAMES``)."""
        reorder: bool = True
        """Let the planner change the placement between steps (experts migrate)."""
        planner_options: dict | None = None
        """Extra planner arguments: ``ReLibraConfig`` fields for relibra (e.g.
        ``migration_s_per_expert``), ``window``/``num_groups`` for the EPLB planners."""

    def __init__(self, config: Config):
        if not isinstance(config.routed_experts, RelibraRoutedExperts.Config):
            raise TypeError("RelibraMoE.Config.routed_experts must be a RelibraRoutedExperts.Config, "
                            f"got {type(config.routed_experts).__name__}")
        super().__init__(config)
        self.planner = config.planner
        self.reorder = config.reorder
        self.planner_options = dict(config.planner_options) if config.planner_options else None
        self._replay_ids_BQK: torch.Tensor | None = None
        self._recorded: list[torch.Tensor] | None = None

    def set_replay(self, expert_ids_BQK: torch.Tensor | None) -> None:
        """Route the next forward passes with these expert ids (``None``: own router).

        ``-1`` is a pad: no expert for that (token, k) (gate 0, counted nowhere, never sent);
        a token whose ids are all ``-1`` gets only the shared experts.
        """
        if expert_ids_BQK is not None:
            E, K = self.routed_experts.num_experts, self.router.top_k
            if expert_ids_BQK.dim() != 3 or expert_ids_BQK.shape[-1] != K:
                raise ValueError(f"replayed expert ids must be [B, Q, K={K}], got shape "
                                 f"{tuple(expert_ids_BQK.shape)}")
            if expert_ids_BQK.numel() and (int(expert_ids_BQK.min()) < -1 or int(expert_ids_BQK.max()) >= E):
                raise ValueError(f"replayed expert ids must lie in [0, {E - 1}] (or -1 for a pad), got "
                                 f"values in [{int(expert_ids_BQK.min())}, {int(expert_ids_BQK.max())}]")
        self._replay_ids_BQK = expert_ids_BQK

    def forward(self, x_BQD: torch.Tensor) -> torch.Tensor:
        if self._replay_ids_BQK is not None:
            ids_BQK = self._replay_ids_BQK
            if tuple(ids_BQK.shape[:2]) != tuple(x_BQD.shape[:2]):
                raise ValueError(f"replayed expert ids cover [B, Q] = {tuple(ids_BQK.shape[:2])} tokens "
                                 f"but this micro-batch is {tuple(x_BQD.shape[:2])}")
            topk_scores_BQK, topk_expert_ids_BQK, scores_BQE = replay_router_scores(self.router, x_BQD, ids_BQK)
        else:
            topk_scores_BQK, topk_expert_ids_BQK, scores_BQE = self.router(x_BQD, self.expert_bias_E)
        if self._recorded is not None:
            self._recorded.append(_local(topk_expert_ids_BQK).detach().clone())

        # Pads (-1) count nowhere: scatter-add a zero for them.
        ids_BQK = topk_expert_ids_BQK
        routing_BQE = torch.zeros(scores_BQE.shape, dtype=torch.int64, device=scores_BQE.device).scatter_add_(
            -1, ids_BQK.clamp(min=0), (ids_BQK >= 0).to(torch.int64))
        num_local_tokens_per_expert_E = routing_BQE.sum(dim=(0, 1))
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert_E.add_(num_local_tokens_per_expert_E)

        out_BQD = self.routed_experts(x_BQD, topk_scores_BQK, topk_expert_ids_BQK, num_local_tokens_per_expert_E)
        if self.shared_experts is not None:
            out_BQD = out_BQD + self.shared_experts(x_BQD)
        return out_BQD


def relibra_moe_layers(model: nn.Module) -> list[RelibraMoE]:
    """The model's :class:`RelibraMoE` modules in layer order (replay layer order)."""
    return [m for m in model.modules() if isinstance(m, RelibraMoE)]


def set_routing_replay(model: nn.Module, expert_ids_BQLK: torch.Tensor | None) -> None:
    """Install one micro-batch's replayed routing into every MoE layer of ``model``.

    Args:
        expert_ids_BQLK: int ``[B, Q, L, K]`` expert ids per token and MoE layer (``L`` MoE
            layers in model order, the ``num_layers`` of a ``relibra.routing/1`` file), or
            ``None`` to route with the model's own router again.
    """
    layers = relibra_moe_layers(model)
    if not layers:
        raise ValueError("set_routing_replay: the model has no RelibraMoE layer; apply the "
                         "integrations.torchtitan.override.relibra_moe override first")
    if expert_ids_BQLK is None:
        for layer in layers:
            layer.set_replay(None)
        return
    if not isinstance(expert_ids_BQLK, torch.Tensor) or expert_ids_BQLK.dim() != 4:
        raise ValueError("expert_ids_BQLK must be a 4-D tensor [B, Q, num_moe_layers, K], got "
                         f"{getattr(expert_ids_BQLK, 'shape', type(expert_ids_BQLK).__name__)}")
    if expert_ids_BQLK.shape[2] != len(layers):
        raise ValueError(f"expert_ids_BQLK has {expert_ids_BQLK.shape[2]} MoE layers but the model has "
                         f"{len(layers)}")
    for n, layer in enumerate(layers):
        layer.set_replay(expert_ids_BQLK[:, :, n])


def clear_routing_replay(model: nn.Module) -> None:
    """Route with the model's own routers again."""
    for layer in relibra_moe_layers(model):
        layer.set_replay(None)


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Record the expert ids every MoE layer uses while the block runs.

    Yields a list with one list per MoE layer (model order) of int64 ``[B, Q, K]`` tensors,
    one per forward. ``torch.stack([r[i] for r in rec], dim=2)`` is forward ``i``'s
    ``[B, Q, L, K]`` replay.
    """
    layers = relibra_moe_layers(model)
    records: list[list[torch.Tensor]] = [[] for _ in layers]
    for layer, rec in zip(layers, records):
        layer._recorded = rec
    try:
        yield records
    finally:
        for layer in layers:
            layer._recorded = None


def placement_sharding_layout():
    """SpmdLayout of ``placement_E``: replicated on every rank, like ``expert_bias_E``."""
    return dense_param_placement(tp=spmd.R)


def declare_placement(sharding_config):
    """``sharding_config`` with ``placement_E`` declared (replicated); ``None`` stays ``None``.

    torchtitan's ``Module.parallelize`` refuses a buffer without a declared placement.
    """
    if sharding_config is None or "placement_E" in sharding_config.state_shardings:
        return sharding_config
    return dataclasses.replace(
        sharding_config,
        state_shardings={**sharding_config.state_shardings, "placement_E": placement_sharding_layout()})
