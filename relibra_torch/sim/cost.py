"""The cost model of one training step under a step plan (ARCHITECTURE.md, "Cost model").

Legend (shape suffixes): M micro-batches, L MoE layers, S source ranks (= G), E experts,
G GPUs (EP ranks, node-major), J slots per GPU.

Every term is a small pure function so that tests can check it against hand-computed
numbers. Times are seconds, sizes bytes, throughputs FLOP/s and bytes/s. A *token* here is a
token-expert pair, the unit of ``loads_MLSE`` (a token routed to ``k`` experts counts ``k``).

Per micro-batch ``m`` and MoE layer ``l``:

* expert compute: a SwiGLU expert runs three ``D x F`` GEMMs, ``6 * D * F`` FLOPs per token
  forward and twice that backward (gradients w.r.t. inputs and weights); the layer waits
  for the most loaded GPU, at ``bf16_tflops * grouped_gemm_efficiency``.
* all-to-all: dispatch and combine each move ``D * activation_bytes`` per token; backward
  repeats both with gradients. Per GPU, one all-to-all takes
  ``max(cross_send, cross_recv) / inter_node_bw + max(intra_send, intra_recv) / nvlink_bw``
  (the two links are summed, not overlapped: the GPU's copy engines/SMs drive both and
  DeepEP-style kernels forward RDMA traffic over NVLink); the slowest GPU sets the time.
* replica fill and gradient return, as the layer executes them
  (:func:`relibra_torch.sim.transfers.replica_traffic`, the code the layer-side consistency
  test checks): each *residency* of a replica (``planning.residency``: a run of micro-batches
  in which a slot holds the same expert owned elsewhere) moves the expert's ``3 * D * F``
  weights from the owner in the forward of its first micro-batch with tokens and the same
  number of gradient values (``grad_bytes``: fp32, what the layer returns) back in the
  backward of its last; a residency without tokens costs nothing. With
  ``refetch_replicas`` every micro-batch with tokens fetches twice (forward, and backward
  before recomputing) and returns once, and its backward recomputes the replica rows'
  forward (expert compute). Transfers go over NVLink (inter-node bandwidth if the owner is
  on another node). Per GPU, received and sent bytes are both counted (an owner feeding
  three replicas sends three copies). With ``overlap_replication`` the transfer of layer
  ``l`` hides behind that layer's attention compute (and shared experts) and only the
  excess is charged; one rule for every system.
* run-time planning (online systems only): ``plan_latency_s`` per layer and micro-batch in
  forward (the backward reuses the plan), on the critical path: the plan needs the
  router's output, so at most the shared experts (which run beside the routed ones) can
  hide it, and only with ``overlap_replication``; planning and fill together hide behind
  at most attention + shared experts.
* migration, once per step: experts whose owner changed carry weights, an fp32 master
  copy (``master_weights``) and Adam's two fp32 moments over the inter-node network (NVLink
  when the move stays inside a node).
* attention and dense parts, the same for every system: per rank and layer,
  ``2 * P_attn * T`` FLOPs for the Q/K/V/O projections (``P_attn`` their weights, ``T`` the
  rank's tokens) plus ``2 * (d_qk + d_v) * pairs`` for the causal score and value products,
  ``pairs = sum_i n_i (n_i + 1) / 2`` over the rank's samples of length ``n_i`` (Megatron-LM's
  FLOP count, Narayanan et al. 2021, eq. 3: ``4 * s^2 * h`` per layer for non-causal
  attention, halved for the causal mask that FlashAttention skips); the router
  ``2 * D * E * T``; shared experts ``6 * D * F_shared * T``; dense layers' FFN
  ``6 * D * F_dense * T``; the LM head ``2 * D * V * T``. Backward is twice forward. Ranks
  synchronise at every MoE all-to-all, so each layer's attention takes the slowest rank's
  time, at ``bf16_tflops * dense_efficiency``. Norms, embeddings, the loss and the
  optimizer step are the same for every system and are left out.

  Which tokens cross which link depends on ``CostOptions.dispatch``: ``flat`` (a copy per
  token-expert pair, ``evaluate``'s counts) or ``hierarchical`` (a copy per token and remote
  node, then per (token, GPU) over NVLink, as the layer sends them, :mod:`relibra_torch.sim.dispatch`;
  relayed tokens add an NVLink stage of their own). One per-GPU time rule for both.

The uniform reference (not a bound: :mod:`relibra_torch.sim.bound` is) gets the mean expert
load on every GPU, uniform routing's all-to-all spread evenly (flat: a source sends ``(G - g) / G``
of its pairs to other nodes, ``(g - 1) / G`` to its node's other GPUs; hierarchical: a token
crosses to ``(N - 1) * (1 - C(E - E/N, K) / C(E, K))`` remote nodes and over NVLink to
``N * (g - 1) * (1 - C(E - E/G, K) / C(E, K))`` GPUs; every GPU receives the mean), no
replicas, no migration: a system whose routing sends fewer bytes can exceed 1.0 of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_choice, check_int
from ..planning.evaluate import PlanMetrics, imbalance
from ..planning.plan import StepPlan
from ..planning.price import exchange_collectives
from ..planning.pricing import ReorderWeights, reorder_weights
from ..planning.residency import residencies
from .dispatch import DISPATCH_MODES, uniform_remote_node_probability
from .transfers import layer_collectives_ML, plan_relays_ML, replica_traffic
from .presets import HardwareSpec, ModelSpec

# ReorderWeights (planning.pricing) is re-exported here, where it was first defined.
__all__ = ["CostOptions", "CostModel", "StepCost", "ReorderWeights", "expert_cost_model"]


@dataclass(frozen=True)
class CostOptions:
    """Knobs of the cost model that are not properties of the hardware or the model.

    Attributes:
        overlap_replication: hide replica fill (forward) and gradient return (backward)
            behind the same layer's attention compute; only the excess is charged.
        activation_bytes: bytes per hidden value in dispatch/combine (2 = bf16).
        param_bytes: bytes per expert weight in a replica fill (2 = bf16).
        grad_bytes: bytes per gradient value returned from a replica (4: the layer
            accumulates and returns replica gradients in fp32, the owner's main-gradient
            dtype, or in the weights' dtype if wider).
        refetch_replicas: price the layer's ``refetch_replicas=True`` (no kept buffers).
        master_weights: migration also moves an fp32 master copy of the weights.
        optimizer_state_bytes: bytes of optimizer state per parameter moved by migration
            (8 = Adam's two fp32 moments).
        dispatch: ``"flat"`` (one copy per token-expert pair) or ``"hierarchical"``
            (DeepEP / HybridEP: one copy per token and remote node, NVLink fan-out there);
            see :mod:`relibra_torch.sim.dispatch`.
    """

    overlap_replication: bool = False
    activation_bytes: int = 2
    param_bytes: int = 2
    grad_bytes: int = 4
    master_weights: bool = True
    optimizer_state_bytes: int = 8
    dispatch: str = "flat"
    refetch_replicas: bool = False

    def __post_init__(self) -> None:
        for f in ("activation_bytes", "param_bytes", "grad_bytes"):
            check_int(f, getattr(self, f))
        check_int("optimizer_state_bytes", self.optimizer_state_bytes, 0)
        check_choice("--dispatch", self.dispatch, DISPATCH_MODES)


@dataclass
class StepCost:
    """What one step costs under one plan (seconds unless noted).

    ``*_ML`` tensors are float64 ``[M, L]``: forward + backward of that micro-batch and MoE
    layer. Scalars are totals over the step.
    """

    moe_layer_s_ML: torch.Tensor  # expert + all-to-all + exposed replica time + exposed planning
    expert_s_ML: torch.Tensor
    all_to_all_s_ML: torch.Tensor
    replica_s_ML: torch.Tensor  # raw transfer time
    replica_exposed_s_ML: torch.Tensor  # charged to the step (== raw without overlap)
    attention_dense_s: float  # every system pays alike
    migration_s: float
    step_s: float
    cross_node_bytes: float
    intra_node_bytes: float
    replica_bytes: float
    migrated_experts: int
    migrated_bytes: float
    planning_exposed_s_ML: torch.Tensor | None = None  # run-time planning charged (online systems)
    latency_s_ML: torch.Tensor | None = None  # fixed latency of the layer's collectives
    # max / mean over GPUs of cross-node receive, mean over micro-batches x layers
    cross_node_recv_imbalance: float = 1.0

    @property
    def moe_s(self) -> float:
        return float(self.moe_layer_s_ML.sum())


class CostModel:
    """Times for the terms of ARCHITECTURE.md's cost model on one (model, hardware)."""

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, options: CostOptions | None = None):
        self.model = model
        self.hardware = hardware
        self.options = options or CostOptions()
        self.expert_flops_per_s = hardware.bf16_tflops * 1e12 * hardware.grouped_gemm_efficiency
        self.dense_flops_per_s = hardware.bf16_tflops * 1e12 * hardware.dense_efficiency
        self.nvlink_bytes_per_s = hardware.nvlink_gbps * 1e9
        self.inter_node_bytes_per_s = hardware.inter_node_gbps * 1e9
        self.token_bytes = model.hidden_size * self.options.activation_bytes
        self.expert_fwd_flops_per_token = 6 * model.hidden_size * model.moe_ffn
        self.expert_weight_bytes = model.expert_params() * self.options.param_bytes
        self.expert_grad_bytes = model.expert_params() * self.options.grad_bytes
        o = self.options
        self.migration_bytes_per_expert = model.expert_params() * (
            o.param_bytes + (4 if o.master_weights else 0) + o.optimizer_state_bytes)

    # --- single terms ------------------------------------------------------------------
    def expert_compute_s(self, max_gpu_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward expert compute time of a layer whose busiest GPU has
        ``max_gpu_tokens`` tokens (any shape); returns two float64 tensors of that shape."""
        fwd = max_gpu_tokens.to(torch.float64) * self.expert_fwd_flops_per_token / self.expert_flops_per_s
        return fwd, 2.0 * fwd

    def all_to_all_s(self, cross_send_G: torch.Tensor, cross_recv_G: torch.Tensor, intra_send_G: torch.Tensor,
                     intra_recv_G: torch.Tensor, relay_G: torch.Tensor | None = None) -> torch.Tensor:
        """One all-to-all (a dispatch, or a combine) in seconds: float64 ``[...]``, the slowest GPU's time.

        Args: token counts per GPU, shape ``[..., G]`` (tokens sent to / received from other
            nodes, and to / from other GPUs of the node); ``relay_G``: ``max(send, receive)``
            of relayed tokens (``planning.relay``), a stage of its own over NVLink before the exchange.
        """
        cross = torch.maximum(cross_send_G, cross_recv_G).to(torch.float64)
        intra = torch.maximum(intra_send_G, intra_recv_G).to(torch.float64)
        per_gpu = self.token_bytes * (cross / self.inter_node_bytes_per_s + intra / self.nvlink_bytes_per_s)
        # the relay is a collective of its own: every rank waits for its slowest GPU, then the exchange's
        relay = 0.0 if relay_G is None else self.token_bytes * relay_G.to(torch.float64).max(-1).values / self.nvlink_bytes_per_s
        return per_gpu.max(-1).values + relay

    def transfer_s(self, cross_send_G: torch.Tensor, cross_recv_G: torch.Tensor,
                   intra_send_G: torch.Tensor, intra_recv_G: torch.Tensor) -> torch.Tensor:
        """Like :meth:`all_to_all_s` but the inputs are bytes, not tokens."""
        cross = torch.maximum(cross_send_G, cross_recv_G).to(torch.float64)
        intra = torch.maximum(intra_send_G, intra_recv_G).to(torch.float64)
        return (cross / self.inter_node_bytes_per_s + intra / self.nvlink_bytes_per_s).max(-1).values

    def replica_counts(self, plan: StepPlan, metrics: PlanMetrics) -> dict[str, torch.Tensor]:
        """Weight fetches and gradient returns per GPU, int64 ``[M, L, G]``, as the layer runs
        them (:func:`~relibra_torch.sim.transfers.replica_traffic`, with this model's
        ``refetch_replicas``): ``fetch_{recv,send}_{cross,intra}`` and
        ``return_{send,recv}_{cross,intra}``."""
        res = metrics.residency if metrics.residency is not None else residencies(plan)
        return replica_traffic(res, self.options.refetch_replicas)

    def replica_s(self, counts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward replica transfer time ``[M, L]`` from :meth:`replica_counts`.

        Forward: the fills; backward: the gradient returns, plus the second fetch when
        replicas are re-fetched (half of the fetches then happen in backward). Second hops
        (``planning.two_hop``, NVLink) are an exchange of their own, after the first hops in
        forward, before them in backward (into the hubs, then home): their time adds.
        """
        w, gb, c = self.expert_weight_bytes, self.expert_grad_bytes, counts
        # with refetch, the first of a micro-batch's two fetches is in forward, the second in backward
        first = [k for k in c if k.startswith("fetch_")]
        fwd = {k: c[k] // 2 if self.options.refetch_replicas else c[k] for k in first}
        bwd = {k: c[k] - fwd[k] for k in fwd}
        z = torch.zeros_like(c["fetch2_send"])
        fill = self.transfer_s(fwd["fetch_send_cross"] * w, fwd["fetch_recv_cross"] * w,
                               fwd["fetch_send_intra"] * w, fwd["fetch_recv_intra"] * w) \
            + self.transfer_s(z, z, c["fetch2_send"] * w, c["fetch2_recv"] * w)
        # backward: a GPU receives its second fetch and sends gradients home (owners the reverse)
        grad = self.transfer_s(bwd["fetch_send_cross"] * w + c["return_send_cross"] * gb,
                               bwd["fetch_recv_cross"] * w + c["return_recv_cross"] * gb,
                               bwd["fetch_send_intra"] * w + c["return_send_intra"] * gb,
                               bwd["fetch_recv_intra"] * w + c["return_recv_intra"] * gb) \
            + self.transfer_s(z, z, c["return2_send"] * gb, c["return2_recv"] * gb)
        return fill, grad

    def migration(self, plan: StepPlan) -> tuple[float, int, float]:
        """``(seconds, migrated experts, bytes)`` of moving experts to ``plan``'s placement.

        All layers move at once; each GPU's sent and received bytes are bounded by its links.
        No previous placement (``None``) means nothing moves.
        """
        if plan.previous_placement_LE is None:
            return 0.0, 0, 0.0
        b = self.migration_bytes_per_expert
        counts_G = plan.topology.moves_per_gpu(plan.previous_placement_LE, plan.placement_LE).sum(1)  # [4, G]
        secs = float(self.transfer_s(*(counts_G * b)))
        n = int(counts_G[0].sum() + counts_G[2].sum())    # every moved expert is sent once
        return secs, n, float(n * b)

    def dense_flops(self, tokens_S: torch.Tensor, attn_pairs_S: torch.Tensor) -> dict[str, torch.Tensor]:
        """Forward FLOPs per rank of the parts every system pays alike.

        Args:
            tokens_S: tokens per rank (``[..., S]``; real tokens, not token-expert pairs).
            attn_pairs_S: causal (query, key) pairs per rank, ``sum_i n_i (n_i + 1) / 2``.
        Returns float64 tensors of that shape: ``attention`` (one layer), ``moe_extra``
        (router + shared experts of one MoE layer), ``dense_ffn`` (one dense layer's FFN),
        ``head`` (LM head).
        """
        m = self.model
        t = tokens_S.to(torch.float64)
        p = attn_pairs_S.to(torch.float64)
        attention = 2.0 * m.attention_projection_params() * t + 2.0 * (m.attention_qk_dim() + m.attention_v_dim()) * p
        moe_extra = (2.0 * m.hidden_size * m.num_experts
                     + 6.0 * m.hidden_size * m.shared_ffn * m.num_shared_experts) * t
        dense_ffn = 6.0 * m.hidden_size * m.dense_ffn * t
        head = 2.0 * m.hidden_size * m.vocab_size * t
        return {"attention": attention, "moe_extra": moe_extra, "dense_ffn": dense_ffn, "head": head}

    def dense_fwd_s_per_token(self) -> float:
        """:meth:`dense_s`'s forward per token on one rank, every layer and the LM head, without
        attention's context term: a lower bound of that forward for a rank's tokens."""
        f = {k: float(v) for k, v in self.dense_flops(torch.ones(()), torch.zeros(())).items()}
        m = self.model
        return (m.num_moe_layers * (f["attention"] + f["moe_extra"]) + m.num_dense_layers
                * (f["attention"] + f["dense_ffn"]) + f["head"]) / self.dense_flops_per_s

    def dense_s(self, tokens_MS: torch.Tensor, attn_pairs_MS: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per micro-batch times (float64 ``[M]``, forward + backward) of the shared parts.

        Returns ``attention_layer_fwd``/``attention_layer_bwd`` (one MoE layer's attention,
        router and shared experts, slowest rank), ``shared_layer_fwd`` (one MoE layer's
        shared experts alone, slowest rank) and ``total`` (all layers, dense layers and LM
        head, forward + backward).
        """
        f = self.dense_flops(tokens_MS, attn_pairs_MS)
        m = self.model
        rate = self.dense_flops_per_s
        moe_layer_fwd = (f["attention"] + f["moe_extra"]).max(-1).values / rate
        dense_layer_fwd = (f["attention"] + f["dense_ffn"]).max(-1).values / rate
        head_fwd = f["head"].max(-1).values / rate
        shared_fwd = (6.0 * m.hidden_size * m.shared_ffn * m.num_shared_experts
                      * tokens_MS.to(torch.float64)).max(-1).values / rate
        total_fwd = m.num_moe_layers * moe_layer_fwd + m.num_dense_layers * dense_layer_fwd + head_fwd
        return {"attention_layer_fwd": moe_layer_fwd, "attention_layer_bwd": 2.0 * moe_layer_fwd,
                "shared_layer_fwd": shared_fwd, "total": 3.0 * total_fwd}

    # --- whole step --------------------------------------------------------------------
    def _combine(self, expert_fwd, expert_bwd, a2a_one, fill_fwd, grad_bwd, dense, migration_s,
                 migrated, migrated_bytes, cross_tokens, intra_tokens, replica_bytes,
                 plan_latency_s: float = 0.0, latency_s_ML: torch.Tensor | None = None) -> StepCost:
        attn_fwd = dense["attention_layer_fwd"].unsqueeze(1)
        attn_bwd = dense["attention_layer_bwd"].unsqueeze(1)
        shared_fwd = dense["shared_layer_fwd"].unsqueeze(1)
        replica = fill_fwd + grad_bwd
        plan = torch.full_like(fill_fwd, float(plan_latency_s))
        if self.options.overlap_replication:
            # planning hides behind shared experts only (it needs the router output); planning
            # and fill together behind attention + shared experts; gradients behind attention bwd
            planning = (plan - shared_fwd).clamp(min=0)
            fill_exposed = (plan + fill_fwd - attn_fwd).clamp(min=0).maximum(planning) - planning
            exposed = fill_exposed + (grad_bwd - attn_bwd).clamp(min=0)
        else:
            planning = plan
            exposed = replica
        expert = expert_fwd + expert_bwd
        a2a = 4.0 * a2a_one  # dispatch + combine, forward and backward
        moe = expert + a2a + exposed + planning
        if latency_s_ML is not None:  # collectives run one after another on the critical path
            moe = moe + latency_s_ML
        attention_dense_s = float(dense["total"].sum())
        step = float(moe.sum()) + attention_dense_s + migration_s
        return StepCost(moe_layer_s_ML=moe, expert_s_ML=expert, all_to_all_s_ML=a2a,
                        replica_s_ML=replica, replica_exposed_s_ML=exposed,
                        attention_dense_s=attention_dense_s, migration_s=migration_s, step_s=step,
                        cross_node_bytes=4.0 * self.token_bytes * float(cross_tokens),
                        intra_node_bytes=4.0 * self.token_bytes * float(intra_tokens),
                        replica_bytes=float(replica_bytes), migrated_experts=migrated,
                        migrated_bytes=migrated_bytes, planning_exposed_s_ML=planning,
                        latency_s_ML=latency_s_ML)

    def step_cost(self, plan: StepPlan, metrics: PlanMetrics, tokens_MS: torch.Tensor,
                  attn_pairs_MS: torch.Tensor, plan_latency_s: float = 0.0) -> StepCost:
        """The step's cost under ``plan``.

        Args:
            plan: the step plan; metrics: ``evaluate(plan, loads_MLSE)``.
            tokens_MS: int ``[M, S]`` tokens per micro-batch and rank.
            attn_pairs_MS: ``[M, S]`` causal attention pairs per micro-batch and rank.
            plan_latency_s: run-time planning per layer and micro-batch (online systems;
                0 for plans made ahead of the step).
        """
        expert_fwd, expert_bwd = self.expert_compute_s(metrics.gpu_load_MLG.max(-1).values)
        if self.options.refetch_replicas:
            # backward recomputes the replica rows' forward before their gradients
            res = metrics.residency if metrics.residency is not None else residencies(plan)
            rows_MLG = (plan.slot_tokens_MLGJ * res.active_MLGJ).sum(-1)
            expert_bwd = self.expert_compute_s((2 * metrics.gpu_load_MLG + rows_MLG).max(-1).values)[0]
        relay = (None if metrics.relay_send_MLG is None
                 else torch.maximum(metrics.relay_send_MLG, metrics.relay_recv_MLG))
        a2a_one = self.all_to_all_s(metrics.cross_send_MLG, metrics.cross_recv_MLG,
                                    metrics.intra_send_MLG, metrics.intra_recv_MLG, relay)
        counts = self.replica_counts(plan, metrics)
        fill_fwd, grad_bwd = self.replica_s(counts)
        fetches = int(sum(counts[k].sum() for k in ("fetch_recv_intra", "fetch_recv_cross", "fetch2_recv")))
        returns = int(sum(counts[k].sum() for k in ("return_send_intra", "return_send_cross", "return2_send")))
        replica_bytes = fetches * self.expert_weight_bytes + returns * self.expert_grad_bytes
        mig_s, migrated, mig_bytes = self.migration(plan)
        dense = self.dense_s(tokens_MS, attn_pairs_MS)
        res = metrics.residency if metrics.residency is not None else residencies(plan)
        latency_ML = self.collective_latency_s(
            layer_collectives_ML(res, plan.topology, self.options.dispatch, self.options.refetch_replicas,
                                 relay_ML=plan_relays_ML(plan, self.options.dispatch)), plan.topology.num_nodes)
        intra = metrics.intra_send_MLG.sum() + (0 if relay is None else metrics.relay_send_MLG.sum())
        out = self._combine(expert_fwd, expert_bwd, a2a_one, fill_fwd, grad_bwd, dense, mig_s, migrated, mig_bytes,
                            metrics.cross_send_MLG.sum(), intra, replica_bytes, plan_latency_s, latency_ML)
        out.cross_node_recv_imbalance = float(imbalance(metrics.cross_recv_MLG).mean())
        return out

    def collective_latency_s(self, collectives_ML: torch.Tensor, num_nodes: int) -> torch.Tensor:
        """float64 ``[M, L]``: the fixed latency of the layer's collectives (``hardware.*_latency_us``
        each; they span nodes when there are several)."""
        hw = self.hardware
        us = hw.inter_node_latency_us if num_nodes > 1 else hw.nvlink_latency_us
        return collectives_ML.to(torch.float64) * us * 1e-6

    def exchange_collectives(self, num_nodes: int, gpus_per_node: int) -> int:
        """``planning.price.exchange_collectives`` under this model's dispatch: what every plan's layer issues per micro-batch."""
        return exchange_collectives(num_nodes, gpus_per_node, self.options.dispatch)

    def uniform_step_cost(self, loads_MLSE: torch.Tensor, num_nodes: int, gpus_per_node: int,
                          tokens_MS: torch.Tensor, attn_pairs_MS: torch.Tensor) -> StepCost:
        """The uniform reference's cost (was ``ideal_step_cost``): mean load everywhere,
        uniform routing's traffic spread evenly, nothing moved. Not a bound."""
        M, L, S, E = loads_MLSE.shape
        G, g = num_nodes * gpus_per_node, gpus_per_node
        loads = loads_MLSE.to(torch.float64)
        mean_ML = loads.sum((2, 3)) / G
        expert_fwd, expert_bwd = self.expert_compute_s(mean_ML)
        send_MLS = loads.sum(3)
        if self.options.dispatch == "hierarchical":
            # one copy per token and remote node: uniform routing's expected remote nodes
            # per token; NVLink one copy per (token, GPU) other than the source (own node)
            # or the landing GPU (other nodes): N (g - 1) GPUs, each needed with uniform
            # routing's chance for a GPU's E / G experts.
            N, K = num_nodes, self.model.top_k
            p_node = uniform_remote_node_probability(E, K, N)
            p_gpu = uniform_remote_node_probability(E, K, G)
            cross_send = send_MLS / K * (N - 1) * p_node
            intra_send = send_MLS / K * N * (g - 1) * p_gpu
        else:
            cross_send = send_MLS * (G - g) / G
            intra_send = send_MLS * (g - 1) / G
        cross_recv = cross_send.mean(-1, keepdim=True).expand_as(cross_send)
        intra_recv = intra_send.mean(-1, keepdim=True).expand_as(intra_send)
        a2a_one = self.all_to_all_s(cross_send, cross_recv, intra_send, intra_recv)
        zero = torch.zeros(M, L, dtype=torch.float64)
        dense = self.dense_s(tokens_MS, attn_pairs_MS)
        latency_ML = self.collective_latency_s(
            torch.full((M, L), self.exchange_collectives(num_nodes, gpus_per_node) + int(G > 1)), num_nodes)  # + plan check
        return self._combine(expert_fwd, expert_bwd, a2a_one, zero, zero, dense, 0.0, 0, 0.0,
                             cross_send.sum(), intra_send.sum(), 0.0, latency_s_ML=latency_ML)

    def reorder_weights(self) -> ReorderWeights:
        """Per-unit costs for a planner's objective, from the same terms as :meth:`step_cost`.

        A planner that minimises ``compute_s_per_token * max_gpu_tokens +
        cross_node_s_per_token * max_gpu_cross_tokens + ...`` summed over micro-batches and
        layers, plus ``migration_s_per_expert * moved_experts`` once per step, is minimising
        this cost model's step time (to first order: the model takes maxima per GPU).
        The formula is :func:`relibra_torch.planning.pricing.reorder_weights`, the one the
        training hook prices its planner with.
        """
        o = self.options
        return reorder_weights(self.model.hidden_size, self.model.moe_ffn, self.hardware,
                               activation_bytes=o.activation_bytes, param_bytes=o.param_bytes,
                               grad_bytes=o.grad_bytes, master_weights=o.master_weights,
                               optimizer_state_bytes=o.optimizer_state_bytes)


def expert_cost_model(dim: int, hidden_dim: int, num_experts: int, top_k: int,
                      hardware: str = "h200", options: CostOptions | None = None) -> CostModel:
    """A :class:`CostModel` for an MoE layer of the given shape on a hardware preset.

    For callers that have a layer rather than a model preset: the per-expert and per-token
    terms depend only on ``dim`` and ``hidden_dim``; the other model fields are
    Qwen3-30B-A3B's and do not enter :meth:`CostModel.reorder_weights`. (The training hook
    prices its planner with :func:`relibra_torch.planning.pricing.priced_config`, which
    needs no simulator.)
    """
    import dataclasses

    from .presets import get_hardware, get_model
    spec = dataclasses.replace(get_model("qwen3-30b-a3b"), name=f"moe-{dim}x{hidden_dim}",
                               hidden_size=dim, moe_ffn=hidden_dim, num_experts=num_experts,
                               top_k=top_k)
    return CostModel(spec, get_hardware(hardware), options)
