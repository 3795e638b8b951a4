"""Planner pricing: hardware specs and the formula that turns expert size + hardware into
the cost weights of the relibra planner's objective (:class:`ReLibraConfig`).

The planning side owns this so that the training hook and the layer price their planner
without the simulator; the simulator's cost model (:mod:`relibra_torch.sim.cost`) prices
with the same function, so a planner tuned in simulation sees the same weights in
training. Every hardware number names its source in a comment.

Units: TFLOP/s = 1e12 FLOP/s, GB/s = 1e9 bytes/s, per GPU and per direction. A *token* is
a token-expert pair (a token routed to ``k`` experts counts ``k``).

Legend: D model (hidden) width, F expert FFN width.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_int, check_number
from .relibra import ReLibraConfig

__all__ = [
    "HARDWARE",
    "HardwareSpec",
    "PLAN_FLOOR_NODES_S",
    "PLAN_FLOOR_S",
    "PLAN_LAYER_NODES_S",
    "PLAN_LAYER_S",
    "LIGHT_SHARE",
    "GUARD_FLOORS",
    "PLAN_SCHEDULE_S",
    "ReorderWeights",
    "get_hardware",
    "priced_config",
    "relibra_config_for",
    "reorder_weights",
]


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU type in an HGX/DGX-style cluster (8 GPUs per node on NVLink, one NIC per GPU).

    Attributes:
        name: preset name.
        bf16_tflops: peak dense bf16 tensor-core throughput, TFLOP/s.
        grouped_gemm_efficiency: fraction of ``bf16_tflops`` the expert grouped GEMMs achieve.
        dense_efficiency: fraction of ``bf16_tflops`` attention and dense layers achieve.
        nvlink_gbps: achievable NVLink bandwidth per GPU per direction, GB/s.
        inter_node_gbps: achievable inter-node (RDMA) bandwidth per GPU per direction, GB/s.
        hbm_gb: HBM capacity per GPU, GB (1e9 bytes), as the datasheet lists it.
        hbm_gbps: peak HBM bandwidth per GPU, GB/s (decode and other memory-bound kernels).
        inter_node_latency_us: fixed latency of one collective that spans nodes, us.
        nvlink_latency_us: the same inside one node (NVLink), us.
    """

    name: str
    bf16_tflops: float
    grouped_gemm_efficiency: float
    dense_efficiency: float
    nvlink_gbps: float
    inter_node_gbps: float
    hbm_gb: float
    hbm_gbps: float
    # NCCL's own tuning model (src/graph/tuning.cc) charges a collective a base latency of
    # 6.6-14 us plus a per-step hardware latency of up to 28 us over the network and 0.6-3.4 us
    # over NVLink (Ring/Tree, LL/LL128/Simple); github.com/NVIDIA/nccl/issues/1453 shows its estimate of
    # 25.2 us for a 128-byte collective on an H100 cluster. 25 us across nodes, 12 us inside
    # one: mid-range values (override with --set hardware.inter_node_latency_us=...).
    inter_node_latency_us: float = 25.0
    nvlink_latency_us: float = 12.0

    def __post_init__(self) -> None:
        for f in ("bf16_tflops", "nvlink_gbps", "inter_node_gbps", "hbm_gb", "hbm_gbps"):
            if check_number(f"hardware.{f}", getattr(self, f), 0, strict=True) < 1e-12:  # seconds then overflow
                raise ValueError(f"hardware.{f} = {getattr(self, f)}; allowed: a finite number >= 1e-12")
        for f in ("inter_node_latency_us", "nvlink_latency_us"):
            check_number(f"hardware.{f}", getattr(self, f), 0)
        for f in ("grouped_gemm_efficiency", "dense_efficiency"):  # fractions of peak
            check_number(f"hardware.{f}", getattr(self, f), 0, strict=True, maximum=1)


# --- hardware --------------------------------------------------------------------------
# bf16 dense peak: NVIDIA H100 and H200 datasheets list 1,979 TFLOP/s bf16 *with sparsity*
# for the SXM parts, i.e. 989 TFLOP/s dense (the H200 has the same tensor cores as the H100,
# more and faster HBM: 141 GB HBM3e at 4.8 TB/s vs 80 GB HBM3 at 3.35 TB/s).
# NVLink: 4th-generation NVLink, 900 GB/s total per GPU = 450 GB/s per direction (both
# datasheets). All-to-all over NVSwitch reaches about 80% of that in nccl-tests
# (alltoall busbw of roughly 350-370 GB/s on 8x H100 SXM), hence 360.
# Inter-node: DGX/HGX H100 and H200 pair every GPU with one ConnectX-7 400 Gb/s NIC
# = 50 GB/s per direction; DeepEP's README measures 43-58 GB/s "RDMA bottleneck bandwidth"
# for EP 16-64 dispatch/combine on the same NIC, NCCL all-to-all sees about 90% of line
# rate, hence 45.
# Grouped GEMM: Megatron-Core/TransformerEngine bf16 grouped GEMMs for experts of a few
# thousand tokens reach roughly 55-65% of peak on H100 (smaller, skinnier GEMMs than
# dense layers); the H200's extra memory bandwidth helps these partly memory-bound shapes,
# hence 0.55 (H100) and 0.60 (H200). Attention (FlashAttention-3: 600-750 TFLOP/s forward
# bf16, less backward) and dense projections: 0.55 for both. These two efficiencies are
# estimates: measure your own kernels and override them.
# HBM: H100 SXM 80 GB HBM3 at 3.35 TB/s; H200 SXM 141 GB HBM3e at 4.8 TB/s (NVIDIA H100 and
# H200 datasheets). Capacity is the datasheet's decimal GB; usable memory is less (CUDA
# context, allocator fragmentation): the memory model keeps its own headroom.
HARDWARE: dict[str, HardwareSpec] = {
    "h100": HardwareSpec("h100", bf16_tflops=989.0, grouped_gemm_efficiency=0.55,
                         dense_efficiency=0.55, nvlink_gbps=360.0, inter_node_gbps=45.0,
                         hbm_gb=80.0, hbm_gbps=3350.0),
    "h200": HardwareSpec("h200", bf16_tflops=989.0, grouped_gemm_efficiency=0.60,
                         dense_efficiency=0.55, nvlink_gbps=360.0, inter_node_gbps=45.0,
                         hbm_gb=141.0, hbm_gbps=4800.0),
    # H800 SXM (the ExpertPlex paper's GPU): the H100 SXM's compute and 80 GB HBM3 at
    # 3.35 TB/s, with NVLink cut to 400 GB/s total; DeepEP's README measures ~160 GB/s
    # NVLink per direction at most and 153-158 GB/s intranode dispatch/combine on it, hence
    # 155; one CX7 400 Gb/s NIC per GPU as on H100/H200 (DeepEP: ~50 GB/s max), hence 45.
    "h800": HardwareSpec("h800", bf16_tflops=989.0, grouped_gemm_efficiency=0.55,
                         dense_efficiency=0.55, nvlink_gbps=155.0, inter_node_gbps=45.0,
                         hbm_gb=80.0, hbm_gbps=3350.0),
}


def get_hardware(name: str) -> HardwareSpec:
    """The hardware preset ``name`` (case-insensitive); ``ValueError`` lists the choices."""
    key = str(name).lower()
    if key not in HARDWARE:
        raise ValueError(f"--hardware {name!r} is unknown; choose one of {', '.join(HARDWARE)}")
    return HARDWARE[key]


@dataclass(frozen=True)
class ReorderWeights:
    """Cost weights for a planner objective (seconds; a token is a token-expert pair).

    Attributes:
        compute_s_per_token: forward + backward expert compute of one token on one GPU.
        cross_node_s_per_token: forward + backward all-to-all time of one token sent to
            another node (dispatch and combine, both passes), per GPU link.
        intra_node_s_per_token: the same over NVLink, to another GPU of the node.
        migration_s_per_expert: moving one expert (weights, master copy, optimizer state)
            to another node, once per step.
        intra_migration_s_per_expert: the same move to another GPU of the same node.
        replica_fill_s_per_expert: one replica residency: weights in, gradients back, NVLink.
        cross_replica_fill_s_per_expert: the same from an owner on another node, over the
            inter-node link.
        fill_weight_share: the weights' share of a residency's bytes (the rest is its
            gradient return): a fill moves ``share x`` the fill price in the forward of the
            residency's first micro-batch, its return the rest in the backward of its last.
        inter_node_latency_s, nvlink_latency_s: fixed latency of one collective across nodes
            and inside one node (``HardwareSpec.*_latency_us``).
    """

    compute_s_per_token: float
    cross_node_s_per_token: float
    intra_node_s_per_token: float
    migration_s_per_expert: float
    intra_migration_s_per_expert: float
    replica_fill_s_per_expert: float
    cross_replica_fill_s_per_expert: float
    fill_weight_share: float
    inter_node_latency_s: float
    nvlink_latency_s: float


def reorder_weights(dim: int, hidden_dim: int, hardware: HardwareSpec, *, activation_bytes: int = 2,
                    param_bytes: int = 2, grad_bytes: int = 4, master_weights: bool = True,
                    optimizer_state_bytes: int = 8) -> ReorderWeights:
    """Per-unit costs of one SwiGLU expert ``D x F`` on ``hardware``.

    The same terms as the simulator's step cost (:class:`relibra_torch.sim.cost.CostModel`):
    an expert runs three ``D x F`` GEMMs, ``6 D F`` FLOPs per token forward and twice that
    backward, at ``bf16_tflops * grouped_gemm_efficiency``; dispatch and combine move
    ``D * activation_bytes`` per token, forward and backward (4 passes); a migration moves
    the ``3 D F`` weights, an fp32 master copy (``master_weights``) and the optimizer state;
    a replica residency moves the weights in and their gradients back over NVLink. A planner
    that minimises ``compute_s_per_token * max_gpu_tokens + cross_node_s_per_token *
    max_gpu_cross_tokens + ...`` summed over micro-batches and layers, plus
    ``migration_s_per_expert * moved_experts`` once per step, minimises that step time (to
    first order: the cost model takes maxima per GPU).

    Args:
        dim, hidden_dim: ``D`` and ``F``.
        hardware: a :class:`HardwareSpec` (e.g. ``get_hardware("h200")``).
        activation_bytes, param_bytes, grad_bytes: bytes per activation, weight, gradient
            value on the wire (2 = bf16; gradients 4: the layer returns replica gradients
            in fp32).
        master_weights: migration also moves an fp32 master copy.
        optimizer_state_bytes: optimizer state per parameter moved by migration (8 = Adam).
    """
    D = check_int("dim", dim)
    F = check_int("hidden_dim", hidden_dim)
    if not isinstance(hardware, HardwareSpec):
        raise TypeError(f"hardware is {type(hardware).__name__}; allowed: a HardwareSpec (get_hardware(name))")
    expert_flops_per_s = hardware.bf16_tflops * 1e12 * hardware.grouped_gemm_efficiency
    nvlink_bytes_per_s = hardware.nvlink_gbps * 1e9
    inter_node_bytes_per_s = hardware.inter_node_gbps * 1e9
    token_bytes = D * activation_bytes
    expert_fwd_flops_per_token = 6 * D * F
    expert_params = 3 * D * F
    expert_weight_bytes = expert_params * param_bytes
    expert_grad_bytes = expert_params * grad_bytes
    migration_bytes_per_expert = expert_params * (param_bytes + (4 if master_weights else 0) + optimizer_state_bytes)
    fwd_bwd_passes = 4.0  # dispatch + combine, forward and backward
    return ReorderWeights(
        compute_s_per_token=3.0 * expert_fwd_flops_per_token / expert_flops_per_s,
        cross_node_s_per_token=fwd_bwd_passes * token_bytes / inter_node_bytes_per_s,
        intra_node_s_per_token=fwd_bwd_passes * token_bytes / nvlink_bytes_per_s,
        migration_s_per_expert=migration_bytes_per_expert / inter_node_bytes_per_s,
        intra_migration_s_per_expert=migration_bytes_per_expert / nvlink_bytes_per_s,
        replica_fill_s_per_expert=(expert_weight_bytes + expert_grad_bytes) / nvlink_bytes_per_s,
        cross_replica_fill_s_per_expert=(expert_weight_bytes + expert_grad_bytes) / inter_node_bytes_per_s,
        fill_weight_share=expert_weight_bytes / (expert_weight_bytes + expert_grad_bytes),
        inter_node_latency_s=hardware.inter_node_latency_us * 1e-6,
        nvlink_latency_s=hardware.nvlink_latency_us * 1e-6,
    )


#: The full search's one-thread CPU time on an EP rank's share of ``k`` layers where the fast
#: path does not settle them (``planning.worth``): about ``floor + k * layer * sqrt(top_k *
#: E')`` at 8 micro-batches (``E' = max(E / 64, 1)`` across nodes, 1 on one node), with a
#: fixed part (a few thousand small tensor calls, whatever the layer count) that dominates a
#: share of one or two layers. Least-squares fit on this project's 2-core machine (Python
#: 3.11, torch 2.13 CPU, an AMD EPYC VM about 2.2x slower per thread than the one of the
#: earlier fit) to 4 share sizes of the 120 never-behind stand-ins with 8-64x token factors
#: (``benchmarks/never_behind.py``): one node 33 ms + 2.6 ms per layer, two nodes 47 ms +
#: 9.3 ms per layer; the measured times lie within 0.5-1.5x of the fit for 80% of the points
#: (the search's work also follows the loads: how many copies pay). The per-layer parts add
#: the share's token splits (``moe.schedule_batch.share_splits``, which the rank runs after
#: planning: 0.9-1.2 ms per layer with copies on one node, 1.1-3.1 ms per unit of the
#: square root across nodes), so 3.6 and 11.3 ms. A faster host CPU makes them smaller:
#: measure them with ``benchmarks/planner.py`` on the training cluster.
#:
#: Refit on one node when the balancing code moved its integer work to numpy (the same
#: plans): one-node steps then planned 1.32-1.49x faster (0.70-0.71x of the time on the
#: three one-node reference shares of ``moe.host_speed``), so both one-node parts are
#: multiplied by 0.71: 23.4 ms + 2.56 ms per layer. Across nodes the reference shares got
#: 1.23x faster but the two-node cases checked only 1.04x, so those parts stay as fitted and
#: ``moe.host_speed.FIT_SPREAD`` takes the difference.
PLAN_FLOOR_S = 2.34e-2
PLAN_FLOOR_NODES_S = 4.7e-2
PLAN_LAYER_S = 2.56e-3
PLAN_LAYER_NODES_S = 1.13e-2
#: Every rank builds every layer's schedules for the step (``moe.schedule_batch.rank_schedules``):
#: 0.7-2.0 ms per layer with copies at 8 micro-batches on the same machine (0.06 ms for a
#: layer without copies), so a layer given copies costs this on every rank, out of the
#: window that planning shares (``planning.worth``). Fitted at 1.3 ms; since every
#: micro-batch's residencies are found at once (``residency.step_residency_micro_batches``,
#: not one micro-batch at a time) the same light plans of the 103 never-behind stand-ins
#: with copies take a median 0.82x of the time case by case (per layer 1.10 -> 0.87 ms in the
#: median, p10-p90 0.54-1.37 ms, measured side by side in one session), so 1.3 x 0.82 = 1.1 ms.
PLAN_SCHEDULE_S = 1.1e-3
#: The light plan's fixed host time (``planning.light``: a step-long set on the kept placement,
#: priced against it, with its share's token splits) as a share of the full search's fixed
#: floor: 4-6 ms on one node, 8-12 ms across nodes, measured on a machine that ran the full
#: search in 0.62-0.77x of the floors above (24 ms one node, 36-55 ms across nodes), so
#: 6-8 and 11-17 ms in the floors' time, against 33 and 47 ms (it was 0.4 of the whole
#: floor, per-layer part included, before the tier had a floor of its own); its per-layer part
#: follows the experts rather than top-k (``planning.host_time.LIGHT_LAYER_S`` and
#: ``LIGHT_EXPERT_S``). 0 turns the light tier off.
LIGHT_SHARE = 0.25
#: The guard's host-time fields of ``ReLibraConfig`` as fitted (the simulator's and the hook's).
GUARD_FLOORS = {"plan_floor_s": PLAN_FLOOR_S, "plan_floor_nodes_s": PLAN_FLOOR_NODES_S, "plan_layer_s": PLAN_LAYER_S,
                "plan_layer_nodes_s": PLAN_LAYER_NODES_S, "light_share": LIGHT_SHARE, "plan_schedule_s": PLAN_SCHEDULE_S}


def priced_config(dim: int, hidden_dim: int, hardware: str | HardwareSpec = "h200", **overrides) -> ReLibraConfig:
    """:class:`ReLibraConfig` whose cost weights price a ``D x F`` expert on ``hardware``
    (a preset name or a spec); ``overrides`` set other config fields."""
    spec = hardware if isinstance(hardware, HardwareSpec) else get_hardware(hardware)
    return ReLibraConfig.from_weights(reorder_weights(dim, hidden_dim, spec), **overrides)


def relibra_config_for(layer, hardware: str | HardwareSpec = "h200", **overrides) -> ReLibraConfig:
    """:class:`ReLibraConfig` priced for ``layer``'s expert shape on a hardware preset, with
    the planning floors above (the simulator's default; ``overrides`` win).

    ``layer`` is any MoE layer with ``dim`` and ``hidden_dim`` attributes (e.g.
    :class:`relibra_torch.moe.ReplayBalancedMoE`): migrations and replica fills are then
    charged for its real expert size, so large experts move and replicate only when it pays.
    A layer where no plan can save what the search costs on the host keeps its placement
    (``planning.worth``): on a toy model every layer does; ``plan_floor_s=0,
    plan_floor_nodes_s=0`` plans it anyway (``ReplayBalancer`` does so on CPU layers).
    """
    return priced_config(layer.dim, layer.hidden_dim, hardware, **{**GUARD_FLOORS, **overrides})
