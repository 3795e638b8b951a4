"""``ReplayBalancedMoE``: an MoE layer that executes routing replay balanced by a step plan.

Legend (shape suffixes):
    T tokens (all leading dims of the input flattened), D model dim, F expert hidden dim,
    E logical experts, K top-k, G EP ranks (node-major), S source ranks (= G), El = E / G
    native experts per rank, R replica slots per rank, J = El + R slots per rank,
    X = G * J destination slots, Rr rows received by this rank, Fr fills received.

Execution of one forward on EP rank ``r`` (see ``docs/moe.md``):

1. route: router scores (fp32); with replayed ``routed_experts`` the ids are taken as given
   and the gates recomputed from the live scores of those experts (so the router keeps its
   gradient), else top-k of the scores (plus the optional expert bias);
2. assign every (token, k) pair to an instance of its expert following the plan's split
   (the rule of :func:`relibra_torch.planning.token_split`), permute by destination slot;
3. all-to-all the rows (sizes from the plan: no count exchange);
4. group the received rows: one group per native expert, then one per filled slot; fill
   replica slots with the owners' weights (autograd-aware, gradients go home);
5. two grouped SwiGLU GEMMs (native weights, fill buffers), reverse all-to-all, combine
   with the gates (fp32 accumulation), plus the optional shared experts.
"""

from __future__ import annotations

import json
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import ops
from .distributed.collectives import all_to_all_autograd
from .distributed.mesh import EPGroup, ep_group_from_mesh
from .distributed.migration import move_expert_rows, native_experts
from .distributed.replicas import (FillSpec, ReplicaMemory, fetch_replica_weights, fill_replicas,
                                   return_replica_grads)
from .distributed.schedule import (LayerPlan, RankSchedule, assign_slots, build_rank_schedule,
                                   check_layer_plan, check_placement, group_permutation, layer_plans,
                                   native_layer_plan)
from .planning.topology import Topology

__all__ = ["EXPERT_PARAMS", "LayerPlan", "ReplayBalancedMoE", "ReplicaMemory", "layer_plans", "load_expert_safetensors",
           "moe_layers", "save_expert_safetensors", "share_replica_memory"]

EXPERT_PARAMS = ("w1_EFD", "w2_EDF", "w3_EFD")
SAFETENSORS_FORMAT = "relibra.experts/1"


def _expert_ffn(x_RD: torch.Tensor, w1_GFD: torch.Tensor, w2_GDF: torch.Tensor, w3_GFD: torch.Tensor,
                offsets_G: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts, group ``g`` = rows ``offsets[g-1]:offsets[g]`` with weight ``g``.

    Weights are stored torchtitan-style (``w1``/``w3`` ``[G, F, D]``, ``w2`` ``[G, D, F]``);
    the ops take ``[G, in, out]``, i.e. transposed views (no copy).
    """
    dt = x_RD.dtype
    return ops.expert_swiglu(x_RD, w1_GFD.to(dt).transpose(-2, -1), w2_GDF.to(dt).transpose(-2, -1),
                             w3_GFD.to(dt).transpose(-2, -1), offsets_G)


class _RefetchReplicaFFN(torch.autograd.Function):
    """Replica-slot experts that keep no replica weights between forward and backward.

    Forward fetches the fill weights, computes, and frees them. Backward fetches them again,
    recomputes the replica rows' forward (activation-checkpoint style) and sends the weight
    gradients home. Costs one more weight transfer and one more forward of the replica rows
    per micro-batch; saves the buffers' memory (and their activations) between passes.
    """

    @staticmethod
    def forward(ctx, x_RD, offsets_G, spec, memory, w1, w2, w3):
        bufs = fetch_replica_weights((w1, w2, w3), spec, memory)
        with torch.no_grad():
            y_RD = _expert_ffn(x_RD, *bufs, offsets_G)
        ctx.save_for_backward(x_RD, offsets_G, w1, w2, w3)
        ctx.spec, ctx.memory = spec, memory
        return y_RD

    @staticmethod
    def backward(ctx, grad_y_RD):
        x_RD, offsets_G, w1, w2, w3 = ctx.saved_tensors
        need_w = any(ctx.needs_input_grad[4:])
        bufs = fetch_replica_weights((w1, w2, w3), ctx.spec, ctx.memory)
        with torch.enable_grad():
            xd = x_RD.detach().requires_grad_(ctx.needs_input_grad[0])
            bd = [b.detach().requires_grad_(need_w) for b in bufs]
            y = _expert_ffn(xd, *bd, offsets_G)
            inputs = ([xd] if ctx.needs_input_grad[0] else []) + (bd if need_w else [])
            grads = torch.autograd.grad(y, inputs, grad_y_RD, allow_unused=True) if inputs else []
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs)]
        grad_x = grads.pop(0) if ctx.needs_input_grad[0] else None
        grad_w = [None, None, None]
        if need_w:
            grad_w = return_replica_grads(grads, ctx.spec, [w1.shape, w2.shape, w3.shape])
        return (grad_x, None, None, None, *grad_w)


class _SwiGLU(nn.Module):
    """Dense SwiGLU FFN (torchtitan ``FeedForward`` layout), used for the shared experts."""

    def __init__(self, dim: int, hidden_dim: int, **factory):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False, **factory)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False, **factory)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _check_pos_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class ReplayBalancedMoE(nn.Module):
    """Top-k MoE layer with SwiGLU experts, routing replay and plan-driven expert parallelism.

    Args:
        dim: model dim ``D``.
        hidden_dim: routed expert hidden dim ``F``.
        num_experts: ``E``.
        top_k: ``K`` experts per token.
        score_func: ``"softmax"`` (over all experts) or ``"sigmoid"`` router scores.
        route_norm: renormalise the top-k scores of every token to sum to 1.
        route_scale: multiply the gates by this.
        expert_bias: keep an ``expert_bias_E`` buffer added to the scores for the top-k
            choice only (aux-loss-free balancing); the gates use the unbiased scores.
        num_shared_experts: dense shared experts (one SwiGLU of hidden
            ``shared_hidden_dim * num_shared_experts``), added to every token's output.
        shared_hidden_dim: defaults to ``hidden_dim``.
        mesh: EP ``DeviceMesh`` (2-D ``("node", "gpu")`` or 1-D = one node), or ``None`` for
            one process. Expert weights become DTensors ``Shard(0)`` over it in physical order.
        replica_slots: ``R`` replica slots per GPU that plans may fill.
        refetch_replicas: fetch replica weights again in backward (and recompute the replica
            rows' forward) instead of keeping them alive; see ``docs/moe.md`` for the measured
            trade-off (default ``False``).
        replica_memory: a :class:`ReplicaMemory` tracker (share one across layers with
            :func:`share_replica_memory`); a new one by default.
        check_plan: verify, every forward, that this rank's routed ids match the plan's
            split (one device-to-host copy of ``E`` counts; turn off once trusted).
        init_std: std of the truncated-normal initialisation.
        dtype, device: of the parameters (``device`` defaults to the mesh's device type).

    State: parameters ``gate.weight`` ``[E, D]`` (replicated), ``w1_EFD``, ``w2_EDF``,
    ``w3_EFD`` (``[E, F, D]``/``[E, D, F]``; DTensors in physical order with a mesh),
    ``shared_experts.*``; buffers ``expert_bias_E`` (persistent, optional), ``placement_E``
    and ``tokens_per_expert_E`` (not persistent). ``state_dict`` is in logical expert order.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, *,
                 score_func: str = "softmax", route_norm: bool = False, route_scale: float = 1.0,
                 expert_bias: bool = False, num_shared_experts: int = 0,
                 shared_hidden_dim: int | None = None, mesh=None, replica_slots: int = 0,
                 refetch_replicas: bool = False, replica_memory: ReplicaMemory | None = None,
                 check_plan: bool = True, init_std: float = 0.02,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None):
        super().__init__()
        self.dim = _check_pos_int("dim", dim)
        self.hidden_dim = _check_pos_int("hidden_dim", hidden_dim)
        self.num_experts = _check_pos_int("num_experts", num_experts)
        self.top_k = _check_pos_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} must be <= num_experts={num_experts}")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func={score_func!r}; allowed: 'softmax', 'sigmoid'")
        _check_pos_int("replica_slots", replica_slots, 0)
        _check_pos_int("num_shared_experts", num_shared_experts, 0)
        self.score_func = score_func
        self.route_norm = bool(route_norm)
        self.route_scale = float(route_scale)
        self.refetch_replicas = bool(refetch_replicas)
        self.check_plan = bool(check_plan)
        self.init_std = float(init_std)

        self._ep: EPGroup = ep_group_from_mesh(mesh)
        if num_experts % self._ep.size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the EP mesh size "
                             f"{self._ep.size} ({self._ep.num_nodes} nodes x "
                             f"{self._ep.gpus_per_node} GPUs); choose a mesh whose size divides "
                             f"the expert count")
        self.topology = Topology(self._ep.num_nodes, self._ep.gpus_per_node, num_experts, replica_slots)
        if device is None and mesh is not None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if mesh.device_type == "cuda" else torch.device(mesh.device_type))
        factory = {"dtype": dtype, "device": device}
        El = self.topology.experts_per_gpu

        self.gate = nn.Linear(dim, num_experts, bias=False, **factory)
        shapes = {"w1_EFD": (hidden_dim, dim), "w2_EDF": (dim, hidden_dim), "w3_EFD": (hidden_dim, dim)}
        for name, tail in shapes.items():
            local = torch.empty(El, *tail, **factory)
            if mesh is not None:
                from torch.distributed.tensor import DTensor, Shard
                local = DTensor.from_local(local, mesh, [Shard(0)] * mesh.ndim, run_check=False)
            self.register_parameter(name, nn.Parameter(local))
        self.shared_experts = (_SwiGLU(dim, (shared_hidden_dim or hidden_dim) * num_shared_experts, **factory)
                               if num_shared_experts else None)
        if expert_bias:
            self.register_buffer("expert_bias_E", torch.zeros(num_experts, dtype=torch.float32,
                                                              device=device))
        else:
            self.expert_bias_E = None
        self.register_buffer("tokens_per_expert_E", torch.zeros(num_experts, dtype=torch.float32,
                                                                 device=device), persistent=False)
        self.register_buffer("placement_E", torch.arange(num_experts, device=device), persistent=False)
        self._placement_cpu = torch.arange(num_experts)
        self._identity_placement = True
        self.replica_memory = replica_memory if replica_memory is not None else ReplicaMemory()
        self._plan: LayerPlan | None = None
        self._schedule: RankSchedule | None = None
        self._has_plan = False
        #: Expert rows (token-expert pairs) this GPU processed in the last forward, per slot
        #: ``[J]`` and in total (taken from the executed exchange).
        self.last_slot_tokens_J = torch.zeros(self.topology.slots_per_gpu, dtype=torch.int64)
        self.last_expert_tokens = 0
        #: ``(slot, logical expert)`` of every fill this GPU received in the last forward.
        self.last_fills: list[tuple[int, int]] = []
        self.register_state_dict_post_hook(ReplayBalancedMoE._logical_state_dict_hook)
        self.register_load_state_dict_pre_hook(ReplayBalancedMoE._load_logical_hook)
        self.reset_parameters()

    # ------------------------------------------------------------------ properties

    @property
    def ep_rank(self) -> int:
        """This process's EP rank (0 without a mesh)."""
        return self._ep.rank

    @property
    def mesh(self):
        return self._ep.mesh

    @property
    def plan(self) -> LayerPlan | None:
        """The installed :class:`LayerPlan` (``None``: native placement, no replicas)."""
        return self._plan

    @property
    def placement_cpu(self) -> torch.Tensor:
        """int64 CPU ``[E]`` placement in force (a copy; ``placement_E`` is the device buffer)."""
        return self._placement_cpu.clone()

    def native_experts(self) -> torch.Tensor:
        """int64 ``[El]``: logical expert at each local row of this rank's expert weights."""
        return native_experts(self._placement_cpu, self.topology.experts_per_gpu, self._ep.rank)

    def local_expert_weights(self) -> dict[str, torch.Tensor]:
        """This rank's expert parameters as plain ``[El, ...]`` tensors, physical order (views)."""
        return {n: _local(getattr(self, n)) for n in EXPERT_PARAMS}

    def extra_repr(self) -> str:
        t = self.topology
        return (f"dim={self.dim}, hidden_dim={self.hidden_dim}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, score_func={self.score_func!r}, EP={t.num_nodes}x{t.gpus_per_node}, "
                f"replica_slots={t.replica_slots}, refetch_replicas={self.refetch_replicas}")

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Truncated-normal init (std ``init_std``); each rank initialises its own experts."""
        nn.init.trunc_normal_(self.gate.weight, std=self.init_std)
        for n in EXPERT_PARAMS:
            nn.init.trunc_normal_(_local(getattr(self, n)), std=self.init_std)
        if self.shared_experts is not None:
            for lin in (self.shared_experts.w1, self.shared_experts.w2, self.shared_experts.w3):
                nn.init.trunc_normal_(lin.weight, std=self.init_std)

    # ------------------------------------------------------------------ plans

    def set_plan(self, plan: LayerPlan | None) -> None:
        """Install the plan for the next forwards (``None``: native placement, no replicas).

        The plan stays installed until replaced (activation recomputation in backward reuses
        it). Raises ``ValueError`` for a plan of another topology or placement.
        """
        if plan is None:
            self._plan, self._schedule, self._has_plan = None, None, False
            return
        plan = check_layer_plan(plan, self.topology, self._placement_cpu)
        self._schedule = build_rank_schedule(self.topology, self._placement_cpu, plan,
                                             self._ep.rank).to(self.placement_E.device)
        self._plan, self._has_plan = plan, True

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
            raise ValueError(f"x has last dim {x.shape[-1]}, expected dim={self.dim}")
        x_TD = x.reshape(-1, self.dim)
        ids_TK, gates_TK = self._route(x, x_TD, routed_experts)
        #: int64 ``[T, K]`` expert ids of the last forward (read by the routing recorder).
        self.last_expert_ids_TK = ids_TK.detach()
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert_E.scatter_add_(
                    0, ids_TK.reshape(-1), torch.ones(ids_TK.numel(), device=ids_TK.device))
        if self._ep.group is None and not self._has_plan:
            out_TD = self._run_local(x_TD, ids_TK, gates_TK)
        else:
            out_TD = self._run_planned(x_TD, ids_TK, gates_TK)
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        return out_TD.view(x.shape)

    def router_scores(self, x_TD: torch.Tensor) -> torch.Tensor:
        """float32 ``[T, E]`` live router scores of tokens ``x_TD`` ``[T, D]`` (softmax or
        sigmoid of an fp32 gate, as torchtitan computes them): what the gates are taken from,
        and what exploration routing perturbs at rollout."""
        logits_TE = F.linear(x_TD.float(), self.gate.weight.float())
        return logits_TE.softmax(-1) if self.score_func == "softmax" else logits_TE.sigmoid()

    def _route(self, x: torch.Tensor, x_TD: torch.Tensor,
               routed_experts: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores_TE = self.router_scores(x_TD)
        if routed_experts is None:
            choice_TE = scores_TE if self.expert_bias_E is None else scores_TE + self.expert_bias_E
            ids_TK = choice_TE.topk(self.top_k, dim=-1).indices
        else:
            ids_TK = self._check_routed(x, routed_experts)
        gates_TK = scores_TE.gather(1, ids_TK)
        if self.route_norm:
            gates_TK = gates_TK / (gates_TK.sum(-1, keepdim=True) + 1e-20)
        return ids_TK, gates_TK * self.route_scale

    def _check_routed(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        if not isinstance(routed, torch.Tensor):
            raise TypeError(f"routed_experts must be a torch.Tensor, got {type(routed).__name__}")
        if routed.dtype not in (torch.int16, torch.int32, torch.int64, torch.uint8):
            raise TypeError(f"routed_experts must be an integer tensor, got {routed.dtype}")
        want = (*x.shape[:-1], self.top_k)
        if tuple(routed.shape) != want:
            raise ValueError(f"routed_experts has shape {tuple(routed.shape)}, expected {want} "
                             f"(x's leading dims, then top_k={self.top_k})")
        ids_TK = routed.reshape(-1, self.top_k).to(device=x.device, dtype=torch.int64)
        # Value checks read data; under torch.compile they are left to the eager run.
        if not torch.compiler.is_compiling() and ids_TK.numel():
            lo, hi = int(ids_TK.min()), int(ids_TK.max())
            if lo < 0 or hi >= self.num_experts:
                raise ValueError(f"routed_experts has ids in [{lo}, {hi}]; allowed: "
                                 f"[0, num_experts={self.num_experts})")
        return ids_TK

    def _run_local(self, x_TD, ids_TK, gates_TK):
        """One process, no plan: every expert local, slots = physical expert rows."""
        slot_TK = ids_TK if self._identity_placement else self.placement_E[ids_TK]
        x_sorted_RD, row_of_TK, offsets_E = ops.permute(slot_TK, x_TD, self.num_experts)
        w = self.local_expert_weights()
        y_RD = _expert_ffn(x_sorted_RD, w["w1_EFD"], w["w2_EDF"], w["w3_EFD"], offsets_E)
        if not torch.compiler.is_compiling():
            # Kept on the device: reading the counters is the only sync.
            counts = torch.diff(offsets_E.to(torch.int64), prepend=offsets_E.new_zeros(1))
            self.last_slot_tokens_J = torch.cat([counts, counts.new_zeros(self.topology.replica_slots)])
            self.last_expert_tokens = int(x_sorted_RD.shape[0])
            self.last_fills = []
        return ops.unpermute(y_RD, row_of_TK, gates_TK)

    @torch.compiler.disable
    def _run_planned(self, x_TD, ids_TK, gates_TK):
        """Plan-driven execution with exchanges (graph break under ``torch.compile``)."""
        topo, ep = self.topology, self._ep
        device = x_TD.device
        E, J = topo.num_experts, topo.slots_per_gpu
        flat_ids = ids_TK.reshape(-1)
        sched = self._schedule
        if sched is None or self.check_plan:
            counts_E = torch.bincount(flat_ids, minlength=E).cpu()
        if sched is None:
            sched = self._native_schedule(counts_E, device)
        elif self.check_plan:
            self._check_counts(counts_E, sched, device)

        # (token, k) pairs -> destination slot g * J + j, by the token_split rule.
        dest_TK = assign_slots(ids_TK, sched)
        x_send, row_of_TK, _ = ops.permute(dest_TK, x_TD, topo.num_gpus * J)
        x_recv = all_to_all_autograd(x_send, sched.send_sizes, sched.recv_sizes, ep.group)

        # Group the received rows: native experts first (local row order), then fills.
        perm = group_permutation(sched, device)
        x_grp = x_recv.index_select(0, perm)
        w = self.local_expert_weights()
        wl = (w["w1_EFD"], w["w2_EDF"], w["w3_EFD"])
        n_own = sched.num_own_rows
        offs_own = sched.own_offsets
        if sched.any_fill:
            spec = FillSpec(sched.fill_send_idx, sched.fill_send_sizes, sched.fill_recv_sizes, ep.group)
            offs_fill = sched.fill_offsets
            if self.refetch_replicas:
                y_own = _expert_ffn(x_grp[:n_own], *wl, offs_own)
                y_fill = _RefetchReplicaFFN.apply(x_grp[n_own:], offs_fill, spec, self.replica_memory, *wl)
            else:
                x_grp, bufs = fill_replicas(x_grp, wl, spec, self.replica_memory)
                y_own = _expert_ffn(x_grp[:n_own], *wl, offs_own)
                y_fill = _expert_ffn(x_grp[n_own:], *bufs, offs_fill)
            y_grp = torch.cat([y_own, y_fill])
        else:
            y_grp = _expert_ffn(x_grp, *wl, offs_own)
        inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=device))
        y_recv = y_grp.index_select(0, inv)
        y_send = all_to_all_autograd(y_recv, sched.recv_sizes, sched.send_sizes, ep.group)

        self.last_slot_tokens_J = sched.slot_tokens_J.clone()
        self.last_expert_tokens = int(x_recv.shape[0])
        self.last_fills = list(zip(sched.fill_slots, sched.fill_experts))
        return ops.unpermute(y_send, row_of_TK, gates_TK)

    def _check_counts(self, counts_E: torch.Tensor, sched: RankSchedule, device: torch.device) -> None:
        """Raise on every rank if any rank's routed ids disagree with the plan.

        The ranks agree first (one all-reduce of a flag) so that a mismatch on one rank
        cannot leave the others waiting in the token exchange.
        """
        ep = self._ep
        diff = (counts_E != sched.expected_counts_E).nonzero().flatten()
        bad = int(diff[0]) if len(diff) else -1
        flags = torch.zeros(max(ep.size, 1), dtype=torch.int64)
        flags[ep.rank] = bad + 1
        if ep.group is not None:
            flags = flags.to(device)
            dist.all_reduce(flags, group=ep.group)
            flags = flags.cpu()
        if not flags.any():
            return
        ranks = flags.nonzero().flatten().tolist()
        if bad >= 0:
            detail = (f"here (EP rank {ep.rank}) expert {bad} has {int(counts_E[bad])} token-expert "
                      f"pairs but the plan's split_SGJ[{ep.rank}] sends {int(sched.expected_counts_E[bad])}")
        else:
            detail = f"this rank (EP rank {ep.rank}) matches"
        raise ValueError(f"routed experts do not match the installed plan on EP ranks {ranks}: {detail}; "
                         f"install the plan made from these routed experts' counts")

    def _native_schedule(self, counts_E: torch.Tensor, device: torch.device) -> RankSchedule:
        """No plan installed: gather every rank's counts and run the native placement."""
        ep = self._ep
        if ep.group is None:
            counts_SE = counts_E.unsqueeze(0)
        else:
            local = counts_E.to(device)
            gathered = [torch.empty_like(local) for _ in range(ep.size)]
            dist.all_gather(gathered, local, group=ep.group)
            counts_SE = torch.stack(gathered).cpu()
        plan = native_layer_plan(self.topology, self._placement_cpu, counts_SE)
        return build_rank_schedule(self.topology, self._placement_cpu, plan, ep.rank).to(device)

    # ------------------------------------------------------------------ placement

    @torch.no_grad()
    def apply_placement(self, new_placement_E: torch.Tensor, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Move expert weights (and gradients, and optimizer state) to ``new_placement_E``.

        Every rank of the EP group must call it with the same placement (between optimizer
        steps). Optimizer state tensors shaped like an expert parameter (Adam/AdamW
        ``exp_avg``, ``exp_avg_sq``, ...) move with it; scalar state (``step``) stays. The
        installed plan is dropped (it was made for the old placement).

        Args:
            new_placement_E: int ``[E]`` permutation, logical expert -> physical native slot.
            optimizer: the optimizer holding this layer's expert parameters, if any.

        Returns:
            the number of experts whose owner GPU changed.
        """
        new = check_placement(new_placement_E, self.num_experts, "new_placement_E")
        old = self._placement_cpu
        El = self.topology.experts_per_gpu
        moved = int((old // El != new // El).sum())
        if torch.equal(new, old):
            return 0
        for name in EXPERT_PARAMS:
            p = getattr(self, name)
            tensors = [p] + ([p.grad] if p.grad is not None else [])
            if optimizer is not None:
                for v in optimizer.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape) and v.dim() > 0:
                        tensors.append(v)
            for t in tensors:
                local = _local(t)
                local.copy_(move_expert_rows(local, old, new, self._ep.rank, self._ep.group))
        self._set_placement(new)
        return moved

    def _set_placement(self, placement_E: torch.Tensor) -> None:
        self._placement_cpu = placement_E.clone()
        self.placement_E.copy_(placement_E.to(self.placement_E.device))
        self._identity_placement = bool(torch.equal(placement_E, torch.arange(self.num_experts)))
        self.set_plan(None)

    # ------------------------------------------------------------------ state dict

    def _expert_placements(self):
        from torch.distributed.tensor import Shard
        return [Shard(0)] * self._ep.mesh.ndim

    @staticmethod
    def _logical_state_dict_hook(module: "ReplayBalancedMoE", state_dict, prefix, local_metadata) -> None:
        # Checkpoints are in logical expert order whatever the placement: with a mesh, a
        # DTensor sharded evenly in logical order (expert e on EP rank e // El), which DCP can
        # reshard to any EP size; without one, a plain [E, ...] tensor.
        if module._identity_placement:
            return
        identity = torch.arange(module.num_experts)
        for name in EXPERT_PARAMS:
            key = prefix + name
            if key not in state_dict:
                continue
            p = getattr(module, name)
            local = move_expert_rows(_local(p).detach(), module._placement_cpu, identity,
                                     module._ep.rank, module._ep.group)
            if module._ep.mesh is not None:
                from torch.distributed.tensor import DTensor
                local = DTensor.from_local(local, module._ep.mesh, module._expert_placements(),
                                           run_check=False)
            state_dict[key] = local

    @staticmethod
    def _load_logical_hook(module: "ReplayBalancedMoE", state_dict, prefix, local_metadata, strict,
                           missing_keys, unexpected_keys, error_msgs) -> None:
        for name in EXPERT_PARAMS:
            key = prefix + name
            if key in state_dict:
                state_dict[key] = module._physical_from_logical(name, state_dict[key])

    def _physical_from_logical(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A logically ordered expert tensor (full, or a DTensor) -> this rank's physical value."""
        from torch.distributed.tensor import DTensor
        p = getattr(self, name)
        mesh = self._ep.mesh
        identity = torch.arange(self.num_experts)
        if tuple(value.shape) != tuple(p.shape):
            return value  # the default loader reports the size mismatch
        if isinstance(value, DTensor):
            if (mesh is not None and value.device_mesh == mesh
                    and list(value.placements) == self._expert_placements()):
                local = move_expert_rows(value.to_local().detach().to(_local(p).device), identity,
                                         self._placement_cpu, self._ep.rank, self._ep.group)
                return DTensor.from_local(local, mesh, self._expert_placements(), run_check=False)
            value = value.full_tensor()
        rows = self.native_experts().to(value.device)
        local = value.detach().index_select(0, rows).to(_local(p).device)
        if mesh is not None:
            return DTensor.from_local(local, mesh, self._expert_placements(), run_check=False)
        return local

    def logical_expert_weights(self) -> dict[str, torch.Tensor]:
        """Full ``[E, ...]`` expert weights in logical order on every rank (collective)."""
        out = {}
        identity = torch.arange(self.num_experts)
        for name in EXPERT_PARAMS:
            local = move_expert_rows(_local(getattr(self, name)).detach(), self._placement_cpu, identity,
                                     self._ep.rank, self._ep.group)
            if self._ep.group is not None:
                parts = [torch.empty_like(local) for _ in range(self._ep.size)]
                dist.all_gather(parts, local.contiguous(), group=self._ep.group)
                local = torch.cat(parts)
            out[name] = local
        return out

    @torch.no_grad()
    def load_logical_expert_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load full ``[E, ...]`` logical expert weights (this rank takes its rows; no collective)."""
        for name in EXPERT_PARAMS:
            if name not in weights:
                raise ValueError(f"missing expert weight {name!r}; got keys {sorted(weights)}")
            full = weights[name]
            want = tuple(getattr(self, name).shape)
            if tuple(full.shape) != want:
                raise ValueError(f"expert weight {name} has shape {tuple(full.shape)}, expected {want}")
            local = _local(getattr(self, name))
            local.copy_(full.index_select(0, self.native_experts().to(full.device)))


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view sharing storage), or the tensor itself."""
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        return t.to_local()
    return t


def moe_layers(model: nn.Module) -> list[tuple[str, ReplayBalancedMoE]]:
    """``(qualified name, layer)`` of every :class:`ReplayBalancedMoE` in ``model``, in order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, ReplayBalancedMoE)]


def share_replica_memory(model: nn.Module) -> ReplicaMemory:
    """Give every MoE layer of ``model`` one :class:`ReplicaMemory`; return it.

    Its ``peak_bytes`` is then the peak replica-buffer memory of this GPU over all layers.
    """
    memory = ReplicaMemory()
    for _, layer in moe_layers(model):
        layer.replica_memory = memory
    return memory


def save_expert_safetensors(model: nn.Module, path: str) -> dict[str, torch.Tensor]:
    """Write every MoE layer's expert weights in logical order to a safetensors file.

    Keys are ``<layer name>.w1_EFD`` etc. (``model`` itself being a layer: just ``w1_EFD``).
    Collective when the layers are expert-parallel: call on every rank; global rank 0 writes.
    Returns the tensors written.
    """
    from safetensors.torch import save_file
    tensors: dict[str, torch.Tensor] = {}
    meta = {"format": SAFETENSORS_FORMAT}
    layers = moe_layers(model)
    if not layers:
        raise ValueError("model has no ReplayBalancedMoE layer")
    for name, layer in layers:
        for k, v in layer.logical_expert_weights().items():
            tensors[f"{name}.{k}" if name else k] = v.detach().cpu().contiguous()
    meta["layers"] = json.dumps({n: layer.num_experts for n, layer in layers})
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_file(tensors, path, metadata=meta)
    return tensors


def load_expert_safetensors(model: nn.Module, path: str) -> None:
    """Load expert weights written by :func:`save_expert_safetensors` (any EP layout).

    Every rank reads the file and keeps its own experts; no collective.
    """
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != SAFETENSORS_FORMAT:
            raise ValueError(f"{path}: metadata format is {meta.get('format')!r}, expected "
                             f"{SAFETENSORS_FORMAT!r}")
        keys = set(f.keys())
        for name, layer in moe_layers(model):
            weights = {}
            for k in EXPERT_PARAMS:
                key = f"{name}.{k}" if name else k
                if key not in keys:
                    raise ValueError(f"{path}: missing tensor {key!r}")
                weights[k] = f.get_tensor(key)
            layer.load_logical_expert_weights(weights)

