"""torchtitan-compatible MoE layer executed by relibra (replayed routing, step plans, EP).

Legend (shape suffixes, torchtitan's convention):
    B batch, L sequence length, D model dim, F expert hidden dim, E logical experts,
    K top-k, T = B * L tokens of this rank, El = E / G native experts per EP rank,
    G EP ranks.

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

from relibra_torch.distributed.mesh import EPGroup
from relibra_torch.distributed.migration import move_expert_rows
from relibra_torch.moe import EXPERT_PARAMS, ReplayBalancedMoE, ReplicaMemory
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
    if cfg.expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"expert_dtype={cfg.expert_dtype!r} is not allowed; allowed: {EXPERT_DTYPES}")
    if isinstance(cfg.replica_slots, bool) or not isinstance(cfg.replica_slots, int) or cfg.replica_slots < 0:
        raise ValueError(f"replica_slots={cfg.replica_slots!r} must be an int >= 0")
    if cfg.gpus_per_node is not None and (
            isinstance(cfg.gpus_per_node, bool) or not isinstance(cfg.gpus_per_node, int)
            or cfg.gpus_per_node < 1):
        raise ValueError(f"gpus_per_node={cfg.gpus_per_node!r} must be None (the whole EP group is "
                         f"one node) or an int >= 1")


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


class RelibraRoutedExperts(ReplayBalancedMoE, RoutedExperts):
    """torchtitan ``RoutedExperts`` executed by relibra's ``ReplayBalancedMoE`` engine.

    Same children as the original: ``inner_experts`` (torchtitan ``GroupedExperts``) holds
    the expert weights under their torchtitan names and shapes; the token-dispatcher config
    is kept but unused. The engine methods of :class:`~relibra_torch.moe.ReplayBalancedMoE`
    (``set_plan``, ``apply_placement``, the planned forward, replica fills) act on those
    weights. Adds the non-persistent buffer ``placement_E`` (int64 ``[E]``, logical expert ->
    physical native slot, identity at start), declared replicated in the sharding config.

    Replica slots are not buffers of this module: a fill allocates them for one micro-batch
    (``relibra_torch.distributed.replicas``) and autograd frees them after the backward that
    used them, so nothing about them needs a sharding declaration.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        replica_slots: int = 1
        """Extra expert slots per EP rank filled per micro-batch (``R``)."""
        gpus_per_node: int | None = None
        """EP ranks per node (replication stays inside a node); ``None``: one node."""
        expert_dtype: str | None = "bfloat16"
        """dtype of the expert GEMMs and token exchange, one of :data:`EXPERT_DTYPES`."""
        refetch_replicas: bool = False
        """Fetch replica weights again in backward instead of keeping them alive."""
        check_plan: bool = True
        """Check every forward that this rank's routing matches the installed plan."""

    def __init__(self, config: Config):
        _check_config(config)
        # ReplayBalancedMoE.__init__ would create its own parameters; the weights live in
        # inner_experts here, so only the engine state is set up (see _init_engine).
        RoutedExperts.__init__(self, config)
        self.gpus_per_node = config.gpus_per_node
        self.expert_dtype = None if config.expert_dtype is None else getattr(torch, config.expert_dtype)
        self._init_engine(config)
        self._register_state_dict_hook(_logical_state_dict_hook)
        self._register_load_state_dict_pre_hook(_physical_load_pre_hook, with_module=True)

    def _init_engine(self, config: Config) -> None:
        ie = config.inner_experts
        self.dim, self.hidden_dim, self.num_experts = ie.dim, ie.hidden_dim, ie.num_experts
        self.top_k = config.token_dispatcher.top_k
        self.refetch_replicas = bool(config.refetch_replicas)
        self.check_plan = bool(config.check_plan)
        self._ep = _ep_group(None, None)
        self.topology = Topology(1, 1, self.num_experts, config.replica_slots)
        self.register_buffer("placement_E", torch.arange(self.num_experts), persistent=False)
        self._placement_cpu = torch.arange(self.num_experts)
        self._identity_placement = True
        self.replica_memory = ReplicaMemory()
        self._plan, self._schedule, self._has_plan = None, None, False
        self.last_slot_tokens_J = torch.zeros(self.topology.slots_per_gpu, dtype=torch.int64)
        self.last_expert_tokens = 0
        self.last_fills = []

    # The engine reads the expert weights by these names; they live in inner_experts.
    w1_EFD = property(lambda self: self.inner_experts.w1_EFD)
    w2_EDF = property(lambda self: self.inner_experts.w2_EDF)
    w3_EFD = property(lambda self: self.inner_experts.w3_EFD)

    @property
    def ep(self) -> EPGroup:
        """This layer's EP group (one process: size 1, no process group)."""
        return self._ep

    def reset_parameters(self) -> None:
        # No parameters of its own (torchtitan initialises inner_experts from its param_init).
        return None

    def _init_self_parameters(self) -> None:
        return None

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        # After to_empty() the placement holds garbage; freshly initialised weights are in
        # logical order.
        if buffer_device is None:
            buffer_device = self.placement_E.device
        self.placement_E = torch.arange(self.num_experts, device=buffer_device)
        self._placement_cpu = torch.arange(self.num_experts)
        self._identity_placement = True
        self.set_plan(None)

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
        self._ep = ep
        self.topology = Topology(ep.num_nodes, ep.gpus_per_node, self.num_experts,
                                 self.topology.replica_slots)
        self.last_slot_tokens_J = torch.zeros(self.topology.slots_per_gpu, dtype=torch.int64)
        self.set_plan(None)

    def apply_placement(self, new_placement_E: torch.Tensor, optimizer=None) -> int:
        """Move expert rows (weights, gradients, optimizer state) to ``new_placement_E``.

        See :meth:`ReplayBalancedMoE.apply_placement`. Needs every EP rank to hold its
        ``E / EP`` expert rows whole, i.e. no FSDP sharding of the experts inside the EP
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
        x_BLD = _local(x_BLD)
        B, L, D = x_BLD.shape
        K = topk_scores_BLK.shape[-1]
        x_TD = x_BLD.reshape(B * L, D)
        if self.expert_dtype is not None:
            x_TD = x_TD.to(self.expert_dtype)
        ids_TK = _local(topk_expert_ids_BLK).reshape(B * L, K).to(torch.int64)
        gates_TK = _local(topk_scores_BLK).reshape(B * L, K)
        if self._ep.group is None and not self._has_plan:
            out_TD = self._run_local(x_TD, ids_TK, gates_TK)
        else:
            out_TD = self._run_planned(x_TD, ids_TK, gates_TK)
        return out_TD.to(x_BLD.dtype).view(B, L, D)


# State dict in logical expert order, under torchtitan's key names. The hooks run on every
# EP rank with the same placement, so the exchange inside is a collective all ranks join.

def _logical_state_dict_hook(module: RelibraRoutedExperts, state_dict, prefix, local_metadata):
    if module._identity_placement:
        return state_dict
    identity_E = torch.arange(module.num_experts)
    for name in EXPERT_PARAMS:
        key = f"{prefix}inner_experts.{name}"
        if key not in state_dict:
            continue
        value = state_dict[key]
        local = _local(value).detach()
        if local.shape[0] != module.topology.experts_per_gpu:
            raise ValueError(
                f"{key}: local shard has {local.shape[0]} expert rows, expected E/EP = "
                f"{module.topology.experts_per_gpu}; reordering needs the expert FSDP degree to be 1 "
                f"(data_parallel_shard_degree * context_parallel_degree == expert_parallel_degree)")
        moved = move_expert_rows(local, module._placement_cpu, identity_E, module._ep.rank, module._ep.group)
        if isinstance(value, DTensor):
            moved = DTensor.from_local(moved, value.device_mesh, value.placements, run_check=False,
                                       shape=value.shape, stride=value.stride())
        state_dict[key] = moved
    return state_dict


def _physical_load_pre_hook(module: RelibraRoutedExperts, state_dict, prefix, *args):
    if module._identity_placement:
        return
    identity_E = torch.arange(module.num_experts)
    for name in EXPERT_PARAMS:
        key = f"{prefix}inner_experts.{name}"
        if key not in state_dict:
            continue
        value = state_dict[key]
        if isinstance(value, DTensor):
            local = move_expert_rows(value.to_local().detach(), identity_E, module._placement_cpu,
                                     module._ep.rank, module._ep.group)
            state_dict[key] = DTensor.from_local(local, value.device_mesh, value.placements,
                                                 run_check=False, shape=value.shape, stride=value.stride())
        else:
            # A full logical tensor (one process): rows of this rank's physical slots.
            rows = module.native_experts().to(value.device)
            state_dict[key] = value.detach().index_select(0, rows)


def replay_router_scores(router: TokenChoiceTopKRouter, x_BLD: torch.Tensor,
                         expert_ids_BLK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchtitan's router with the expert choice replaced by ``expert_ids_BLK``.

    Computes the gate scores exactly as ``TokenChoiceTopKRouter.forward`` (fp32 gate,
    softmax or sigmoid), gathers them at the replayed experts, then applies ``route_norm``
    and ``route_scale``. The expert bias only steers the choice, so it plays no part.

    Returns:
        ``(topk_scores_BLK, expert_ids_BLK, scores_BLE)`` like the router.
    """
    with torch.autocast(device_type=x_BLD.device.type, dtype=torch.float32):
        scores_BLE = router.gate(x_BLD)
    if router.score_func == "sigmoid":
        scores_BLE = torch.sigmoid(scores_BLE)
    elif router.score_func == "softmax":
        scores_BLE = F.softmax(scores_BLE, dim=-1)
    else:
        raise NotImplementedError(f"Unknown score function {router.score_func}")
    ids_BLK = expert_ids_BLK.to(device=scores_BLE.device, dtype=torch.int64)
    topk_scores_BLK = scores_BLE.gather(dim=-1, index=ids_BLK)
    if router.route_norm:
        topk_scores_BLK = topk_scores_BLK / (topk_scores_BLK.sum(dim=-1, keepdim=True) + 1e-20)
    topk_scores_BLK = topk_scores_BLK * router.route_scale
    return topk_scores_BLK, ids_BLK, scores_BLE


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
        self._replay_ids_BLK: torch.Tensor | None = None
        self._recorded: list[torch.Tensor] | None = None

    def set_replay(self, expert_ids_BLK: torch.Tensor | None) -> None:
        """Route the next forward passes with these expert ids (``None``: own router)."""
        if expert_ids_BLK is not None:
            E, K = self.routed_experts.num_experts, self.router.top_k
            if expert_ids_BLK.dim() != 3 or expert_ids_BLK.shape[-1] != K:
                raise ValueError(f"replayed expert ids must be [B, L, K={K}], got shape "
                                 f"{tuple(expert_ids_BLK.shape)}")
            if expert_ids_BLK.numel() and (int(expert_ids_BLK.min()) < 0 or int(expert_ids_BLK.max()) >= E):
                raise ValueError(f"replayed expert ids must lie in [0, {E - 1}], got values in "
                                 f"[{int(expert_ids_BLK.min())}, {int(expert_ids_BLK.max())}]")
        self._replay_ids_BLK = expert_ids_BLK

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        if self._replay_ids_BLK is not None:
            ids_BLK = self._replay_ids_BLK
            if tuple(ids_BLK.shape[:2]) != tuple(x_BLD.shape[:2]):
                raise ValueError(f"replayed expert ids cover [B, L] = {tuple(ids_BLK.shape[:2])} tokens "
                                 f"but this micro-batch is {tuple(x_BLD.shape[:2])}")
            topk_scores_BLK, topk_expert_ids_BLK, scores_BLE = replay_router_scores(self.router, x_BLD, ids_BLK)
        else:
            topk_scores_BLK, topk_expert_ids_BLK, scores_BLE = self.router(x_BLD, self.expert_bias_E)
        if self._recorded is not None:
            self._recorded.append(_local(topk_expert_ids_BLK).detach().clone())

        routing_map_BLE = torch.zeros_like(scores_BLE, dtype=torch.bool).scatter_(-1, topk_expert_ids_BLK, True)
        num_local_tokens_per_expert_E = routing_map_BLE.sum(dim=(0, 1))
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert_E.add_(num_local_tokens_per_expert_E)

        out_BLD = self.routed_experts(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)
        if self.shared_experts is not None:
            out_BLD = out_BLD + self.shared_experts(x_BLD)
        return out_BLD


def relibra_moe_layers(model: nn.Module) -> list[RelibraMoE]:
    """The model's :class:`RelibraMoE` modules in layer order (replay layer order)."""
    return [m for m in model.modules() if isinstance(m, RelibraMoE)]


def set_routing_replay(model: nn.Module, expert_ids_BLNK: torch.Tensor | None) -> None:
    """Install one micro-batch's replayed routing into every MoE layer of ``model``.

    Args:
        expert_ids_BLNK: int ``[B, L, N, K]`` expert ids per token and MoE layer (``N`` MoE
            layers in model order, the ``num_layers`` of a ``relibra.routing/1`` file), or
            ``None`` to route with the model's own router again.
    """
    layers = relibra_moe_layers(model)
    if not layers:
        raise ValueError("set_routing_replay: the model has no RelibraMoE layer; apply the "
                         "integrations.torchtitan.override.relibra_moe override first")
    if expert_ids_BLNK is None:
        for layer in layers:
            layer.set_replay(None)
        return
    if not isinstance(expert_ids_BLNK, torch.Tensor) or expert_ids_BLNK.dim() != 4:
        raise ValueError("expert_ids_BLNK must be a 4-D tensor [B, L, num_moe_layers, K], got "
                         f"{getattr(expert_ids_BLNK, 'shape', type(expert_ids_BLNK).__name__)}")
    if expert_ids_BLNK.shape[2] != len(layers):
        raise ValueError(f"expert_ids_BLNK has {expert_ids_BLNK.shape[2]} MoE layers but the model has "
                         f"{len(layers)}")
    for n, layer in enumerate(layers):
        layer.set_replay(expert_ids_BLNK[:, :, n])


def clear_routing_replay(model: nn.Module) -> None:
    """Route with the model's own routers again."""
    for layer in relibra_moe_layers(model):
        layer.set_replay(None)


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Record the expert ids every MoE layer uses while the block runs.

    Yields a list with one list per MoE layer (model order) of int64 ``[B, L, K]`` tensors,
    one per forward. ``torch.stack([r[i] for r in rec], dim=2)`` is forward ``i``'s
    ``[B, L, N, K]`` replay.
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
