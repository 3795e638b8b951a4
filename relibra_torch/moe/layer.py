"""``ReplayBalancedMoE``: an MoE layer that executes routing replay balanced by a step plan.

Legend: see ``docs/architecture.md``. Here T tokens (all leading dims of the input
flattened), D model dim, F expert hidden dim, E logical experts, K top-k, G EP ranks,
El = E / G native experts per rank, R replica slots per rank.

Execution of one forward on EP rank ``r`` (see ``docs/moe.md``):

1. route: router scores (fp32); with replayed ``routed_experts`` the ids are taken as given
   and the gates recomputed from the live scores of those experts (so the router keeps its
   gradient), else top-k of the scores (plus the optional expert bias);
2. the layer's :class:`~relibra_torch.moe.ExpertEngine` assigns every (token, k) pair to an
   instance of its expert following the plan's split, permutes by destination slot,
   exchanges, fills replica slots, runs the grouped SwiGLU, exchanges back and combines with
   the gates (fp32 accumulation);
3. plus the optional shared experts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_choice, check_int, check_number
from ..distributed.mesh import ep_group_from_mesh
from ..distributed.replicas import ReplicaMemory
from ..planning.topology import Topology
from .engine import DISPATCH_MODES, EXPERT_PARAMS, MISMATCH_MODES, ExpertEngine, local_tensor
from .host import EngineHost

__all__ = ["MoEConfig", "ReplayBalancedMoE"]


@dataclass(frozen=True)
class MoEConfig:
    """Routing and execution options of :class:`ReplayBalancedMoE` (every field has a default).

    Attributes:
        score_func: ``"softmax"`` (over all experts) or ``"sigmoid"`` router scores.
        route_norm: renormalise the top-k scores of every token to sum to 1.
        route_scale: multiply the gates by this.
        expert_bias: keep an ``expert_bias_E`` buffer added to the scores for the top-k
            choice only (aux-loss-free balancing); the gates use the unbiased scores.
        num_shared_experts: dense shared experts (one SwiGLU of hidden
            ``shared_hidden_dim * num_shared_experts``), added to every token's output.
        shared_hidden_dim: defaults to the routed experts' ``hidden_dim``.
        replica_slots: ``R`` replica slots per GPU that plans may fill.
        refetch_replicas: fetch replica weights again in backward (and recompute the replica
            rows' forward) instead of keeping them alive; see ``docs/moe.md`` for the
            measured trade-off.
        check_plan: verify, every forward, that replayed ids lie in ``[-1, E)`` and (with a
            plan or an EP group) that every rank's routed ids match the plan's split: one
            small device-to-host copy and one all-reduce of ``G`` flags per layer. Off: the
            caller vouches for the replay; a mismatch then computes a wrong result or fails
            inside the exchange, and an out-of-range id is undefined behaviour on a GPU.
        on_mismatch: ``"degrade"`` (default): a forward whose routed ids disagree with the
            installed plan on any rank runs on every rank on the current placement without
            replicas, with counts exchanged (correct, slower); warned once per process and
            counted (``ReplayBalancer.report.degraded_micro_batches``). ``"raise"``: every
            rank raises ``ValueError`` instead.
        dispatch: the token exchange. ``"flat"`` (default): one row per token-expert pair,
            one all-to-all each way (Megatron-LM's alltoall dispatcher). ``"hierarchical"``
            (DeepEP's normal mode): a token crosses to each remote node once, landing on the
            GPU with its source's local index, and fans out over NVLink to the GPUs holding
            its pairs' slots (one row per (token, GPU)); combine reduces on the way back.
            Same results (fp32 sums), fewer inter-node rows; see ``docs/moe.md``.
        init_std: std of the truncated-normal initialisation.
    """

    score_func: str = "softmax"
    route_norm: bool = False
    route_scale: float = 1.0
    expert_bias: bool = False
    num_shared_experts: int = 0
    shared_hidden_dim: int | None = None
    replica_slots: int = 0
    refetch_replicas: bool = False
    check_plan: bool = True
    on_mismatch: str = "degrade"
    dispatch: str = "flat"
    init_std: float = 0.02

    def __post_init__(self) -> None:
        check_choice("score_func", self.score_func, ("softmax", "sigmoid"))
        check_number("route_scale", self.route_scale)
        check_int("num_shared_experts", self.num_shared_experts, 0)
        if self.shared_hidden_dim is not None:
            check_int("shared_hidden_dim", self.shared_hidden_dim, 1)
        check_int("replica_slots", self.replica_slots, 0)
        check_choice("on_mismatch", self.on_mismatch, MISMATCH_MODES)
        check_choice("dispatch", self.dispatch, DISPATCH_MODES)
        check_number("init_std", self.init_std, 0.0)


class _SwiGLU(nn.Module):
    """Dense SwiGLU FFN (torchtitan ``FeedForward`` layout), used for the shared experts."""

    def __init__(self, dim: int, hidden_dim: int, **factory):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False, **factory)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False, **factory)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ReplayBalancedMoE(EngineHost, nn.Module):
    """Top-k MoE layer with SwiGLU experts, routing replay and plan-driven expert parallelism.

    Args:
        dim: model dim ``D``.
        hidden_dim: routed expert hidden dim ``F``.
        num_experts: ``E``.
        top_k: ``K`` experts per token.
        mesh: EP ``DeviceMesh`` (2-D ``("node", "gpu")`` or 1-D = one node), or ``None`` for
            one process. Expert weights become DTensors ``Shard(0)`` over it in physical order.
        config: a :class:`MoEConfig`; or pass its fields as keyword arguments
            (``replica_slots=2``), which override the config's.
        replica_memory: a :class:`ReplicaMemory` tracker (share one across layers with
            :func:`share_replica_memory`); a new one by default.
        dtype, device: of the parameters (``device`` defaults to the mesh's device type).

    State: parameters ``gate.weight`` ``[E, D]`` (replicated), ``w1_EFD``, ``w2_EDF``,
    ``w3_EFD`` (``[E, F, D]``/``[E, D, F]``; DTensors in physical order with a mesh),
    ``shared_experts.*``; buffers ``expert_bias_E`` (persistent, optional), ``placement_E``
    and ``tokens_per_expert_E`` (not persistent). ``state_dict`` is in logical expert order.
    Execution state (plan, placement, counters) lives in ``self.engine``.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, *, mesh=None,
                 config: MoEConfig | None = None, replica_memory: ReplicaMemory | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None, **options):
        super().__init__()
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(MoEConfig)})
        if unknown:
            raise TypeError(f"ReplayBalancedMoE got unknown option(s) {unknown}; allowed: the fields of "
                            f"MoEConfig ({', '.join(f.name for f in dataclasses.fields(MoEConfig))})")
        cfg = dataclasses.replace(config or MoEConfig(), **options)
        self.config = cfg
        # Routing options as plain attributes (documented once, on MoEConfig).
        self.score_func, self.route_norm = cfg.score_func, bool(cfg.route_norm)
        self.route_scale, self.init_std = float(cfg.route_scale), float(cfg.init_std)
        self.dim = check_int("dim", dim)
        self.hidden_dim = check_int("hidden_dim", hidden_dim)
        self.num_experts = check_int("num_experts", num_experts)
        self.top_k = check_int("top_k", top_k, 1, num_experts)
        ep = ep_group_from_mesh(mesh)
        if num_experts % ep.size:
            raise ValueError(f"num_experts = {num_experts} is not divisible by the EP mesh size "
                             f"{ep.size} ({ep.num_nodes} nodes x {ep.gpus_per_node} GPUs); allowed: a "
                             f"mesh whose size divides the expert count")
        topology = Topology(ep.num_nodes, ep.gpus_per_node, num_experts, cfg.replica_slots)
        self.engine = ExpertEngine(topology, ep, refetch_replicas=cfg.refetch_replicas,
                                   check_plan=cfg.check_plan, on_mismatch=cfg.on_mismatch,
                                   replica_memory=replica_memory, dispatch=cfg.dispatch)
        if device is None and mesh is not None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if mesh.device_type == "cuda" else torch.device(mesh.device_type))
        factory = {"dtype": dtype, "device": device}

        self.gate = nn.Linear(dim, num_experts, bias=False, **factory)
        shapes = {"w1_EFD": (hidden_dim, dim), "w2_EDF": (dim, hidden_dim), "w3_EFD": (hidden_dim, dim)}
        for name, tail in shapes.items():
            local = torch.empty(topology.experts_per_gpu, *tail, **factory)
            if mesh is not None:
                from torch.distributed.tensor import DTensor, Shard
                local = DTensor.from_local(local, mesh, [Shard(0)] * mesh.ndim, run_check=False)
            self.register_parameter(name, nn.Parameter(local))
        hidden_shared = (cfg.shared_hidden_dim or hidden_dim) * cfg.num_shared_experts
        self.shared_experts = _SwiGLU(dim, hidden_shared, **factory) if cfg.num_shared_experts else None
        if cfg.expert_bias:
            self.register_buffer("expert_bias_E", torch.zeros(num_experts, dtype=torch.float32, device=device))
        else:
            self.expert_bias_E = None
        self.register_buffer("tokens_per_expert_E", torch.zeros(num_experts, dtype=torch.float32,
                                                                 device=device), persistent=False)
        self.register_buffer("placement_E", torch.arange(num_experts, device=device), persistent=False)
        self._register_logical_checkpoint()
        self.reset_parameters()

    @property
    def refetch_replicas(self) -> bool:
        return self.engine.refetch_replicas

    @refetch_replicas.setter
    def refetch_replicas(self, value: bool) -> None:
        self.engine.refetch_replicas = bool(value)

    @property
    def check_plan(self) -> bool:
        return self.engine.check_plan

    @check_plan.setter
    def check_plan(self, value: bool) -> None:
        self.engine.check_plan = bool(value)

    @property
    def mesh(self):
        return self.engine.ep.mesh

    def expert_params(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in EXPERT_PARAMS}

    def expert_param_key(self, name: str) -> str:
        return name

    def extra_repr(self) -> str:
        t = self.topology
        return (f"dim={self.dim}, hidden_dim={self.hidden_dim}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, score_func={self.score_func!r}, EP={t.num_nodes}x{t.gpus_per_node}, "
                f"replica_slots={t.replica_slots}, refetch_replicas={self.refetch_replicas}, "
                f"dispatch={self.engine.dispatch!r}")

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Truncated-normal init (std ``init_std``); each rank initialises its own experts."""
        nn.init.trunc_normal_(self.gate.weight, std=self.init_std)
        for n in EXPERT_PARAMS:
            nn.init.trunc_normal_(local_tensor(getattr(self, n)), std=self.init_std)
        if self.shared_experts is not None:
            for lin in (self.shared_experts.w1, self.shared_experts.w2, self.shared_experts.w3):
                nn.init.trunc_normal_(lin.weight, std=self.init_std)

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor, routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the layer.

        Args:
            x: ``[..., D]`` tokens.
            routed_experts: optional int ``[..., K]`` replayed expert ids (same leading dims
                as ``x``); the gates are recomputed from the live router scores of exactly
                these experts.

        Returns:
            ``[..., D]`` in ``x``'s dtype.
        """
        if x.shape[-1] != self.dim:
            raise ValueError(f"x has last dim {x.shape[-1]}; allowed: dim = {self.dim}")
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"x has dtype {x.dtype}; allowed: float32, float16 or bfloat16 (the expert kernels)")
        x_TD = x.reshape(-1, self.dim)
        ids_TK, gates_TK = self._route(x, x_TD, routed_experts)
        #: int64 ``[T, K]`` expert ids of the last forward (read by the routing recorder).
        self.last_expert_ids_TK = ids_TK.detach()
        if self.training:
            with torch.no_grad():  # pads (-1) count nowhere
                flat = ids_TK.reshape(-1)
                self.tokens_per_expert_E.scatter_add_(
                    0, flat.clamp(0, self.num_experts - 1), ((flat >= 0) & (flat < self.num_experts)).float())
        out_TD = self._run_experts(x_TD, ids_TK, gates_TK)
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        return out_TD.view(x.shape)

    def _apply(self, fn, recurse=True):
        """A model-wide cast (``.bfloat16()``, ``.half()``, ``.to(dtype)``) moves the buffers as
        usual but keeps the token counter in fp32: bf16 counts stop being exact past 256."""
        counts_E = self.tokens_per_expert_E
        out = super()._apply(fn, recurse)
        if self.tokens_per_expert_E.dtype != counts_E.dtype:
            self.tokens_per_expert_E = counts_E.to(self.tokens_per_expert_E.device)
        return out

    def router_scores(self, x_TD: torch.Tensor) -> torch.Tensor:
        """float32 ``[T, E]`` live router scores of tokens ``x_TD`` ``[T, D]`` (softmax or
        sigmoid of an fp32 gate, as torchtitan computes them): what the gates are taken from,
        and what exploration routing perturbs at rollout."""
        logits_TE = F.linear(x_TD.float(), self.gate.weight.float())
        return logits_TE.softmax(-1) if self.score_func == "softmax" else logits_TE.sigmoid()

    def route(self, x_TD: torch.Tensor, routed_experts: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids_TK int64, gates_TK fp32)`` of tokens ``x_TD`` ``[T, D]`` (replayed ids
        ``[T, K]`` optional, checked as in :meth:`forward`): the router of :meth:`forward`
        without the experts (ExpertPlex's attention ranks route, expert ranks compute)."""
        return self._route(x_TD, x_TD, routed_experts)

    def _route(self, x: torch.Tensor, x_TD: torch.Tensor,
               routed_experts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores_TE = self.router_scores(x_TD)
        if routed_experts is None:
            choice_TE = scores_TE if self.expert_bias_E is None else scores_TE + self.expert_bias_E
            ids_TK = choice_TE.topk(self.top_k, dim=-1).indices
            gates_TK = scores_TE.gather(1, ids_TK)
        else:
            # Replayed ids may hold -1 pads (no expert for that (token, k)): gate 0, skipped
            # by the counts, the planner and the experts; route_norm then normalises over the
            # token's real experts. A token whose ids are all -1 gets only the shared experts.
            ids_TK = self._check_routed(x, routed_experts)
            # (Clamped so that the gather never indexes out of range: out-of-range ids are
            # refused below or by the engine's count check, on every rank together.)
            gates_TK = scores_TE.gather(1, ids_TK.clamp(0, self.num_experts - 1)).masked_fill(ids_TK < 0, 0.0)
        if self.route_norm:
            gates_TK = gates_TK / (gates_TK.sum(-1, keepdim=True) + 1e-20)
        return ids_TK, gates_TK * self.route_scale

    def _check_routed(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        if not isinstance(routed, torch.Tensor):
            raise TypeError(f"routed_experts is {type(routed).__name__}; allowed: an integer torch.Tensor")
        if routed.dtype not in (torch.int16, torch.int32, torch.int64):  # what the planner and files take
            raise TypeError(f"routed_experts has dtype {routed.dtype}; allowed: a signed integer dtype, int16, "
                            f"int32 or int64 (-1 is a pad)")
        want = (*x.shape[:-1], self.top_k)
        if tuple(routed.shape) != want:
            raise ValueError(f"routed_experts has shape {tuple(routed.shape)}, expected {want} "
                             f"(x's leading dims, then top_k={self.top_k})")
        ids_TK = routed.reshape(-1, self.top_k).to(device=x.device, dtype=torch.int64)
        # Value checks read data (a device-to-host copy): with an EP group or a plan the engine
        # checks the range on its count copy, agreed by every rank; one process without a plan
        # checks here. Skipped with check_plan=False and under torch.compile.
        local = self.engine.ep.group is None and self.engine.plan is None
        if local and self.check_plan and not torch.compiler.is_compiling() and ids_TK.numel():
            lo, hi = int(ids_TK.min()), int(ids_TK.max())
            if lo < -1 or hi >= self.num_experts:
                raise ValueError(f"routed_experts has ids in [{lo}, {hi}]; allowed: "
                                 f"[0, num_experts={self.num_experts}), or -1 for a pad (no expert)")
        return ids_TK
