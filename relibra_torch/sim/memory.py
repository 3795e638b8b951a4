"""Memory per GPU of a training step: what the simulator refuses when it does not fit.

Legend (shape suffixes): M micro-batches, L MoE layers, G GPUs (EP ranks), J slots per GPU.
D hidden size, F expert width, E experts, V vocabulary, T tokens of a GPU's micro-batch.

Parallelism (fixed; docs/simulator.md, "Memory"): the routed experts are sharded by expert
parallelism over all ``G`` GPUs (EP = G, ``E / G`` experts per GPU); every GPU holds every
layer (no pipeline or tensor parallelism). The dense weights (attention, router, shared
experts, dense FFNs, embedding, LM head) are replicated on every GPU; their gradients and
optimizer state may be sharded over the data-parallel group, which is all ``G`` GPUs. The
experts' data-parallel group (Megatron's expert-data-parallel group, ``world / EP``) has one
GPU here, so expert state is never sharded.

The default recipe (:class:`MemoryOptions`, frozen): Megatron-Core's distributed optimizer
with bf16 weights and fp32 gradients (``main_grad``), fp32 master weights and Adam's two
fp32 moments sharded over the data-parallel group: ``6 + 12 / d`` bytes per parameter
(Megatron-Core developer guide, "Distributed Optimizer"); full activation recomputation
per layer (Megatron's ``--recompute-granularity full --recompute-method uniform
--recompute-num-layers 1``): each layer's bf16 input is kept, ``2 D`` bytes per token per
layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4: ``2 s b h`` per layer), and one layer is recomputed at a time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..checks import check_choice, check_int, check_number
from .bound import REFERENCES
from .presets import HardwareSpec, ModelSpec, parse_override

__all__ = ["MemoryOptions", "MemoryBreakdown", "SHARD_LEVELS", "RECOMPUTE_MODES", "memory_options",
           "param_counts", "capacity_bytes", "state_breakdown", "activation_bytes_MG",
           "plan_memory", "ideal_memory", "check_fits", "memory_settings",
           "memory_verdict", "replicating", "workload_activations", "peak_warnings"]

SHARD_LEVELS = ("none", "optimizer", "grads", "params")
RECOMPUTE_MODES = ("full", "none")


@dataclass(frozen=True)
class MemoryOptions:
    """The training recipe the memory model assumes (``--set memory.FIELD=VALUE``).

    Attributes:
        param_bytes: bytes per weight as the layers hold it (2 = bf16).
        grad_bytes: bytes per gradient value (4 = fp32 ``main_grad``); also the dtype of a
            replica slot's gradient buffer (it accumulates for the owner's gradient).
        master_bytes: bytes per fp32 master weight (0: none).
        optimizer_bytes: optimizer state per parameter (8 = Adam's two fp32 moments).
        activation_bytes: bytes per activation value (2 = bf16).
        shard: what is sharded over the data-parallel group: ``none``; ``optimizer``
            (master weights and optimizer state: Megatron's distributed optimizer, ZeRO-1;
            the default); ``grads`` (also gradients, ZeRO-2); ``params`` (also the weights:
            ZeRO-3 / FSDP, two layers' weights gathered at a time).
        recompute: ``full`` (keep each layer's input, recompute one layer at a time in
            backward; the default) or ``none`` (keep every layer's activations).
        reserve_fraction: share of HBM left out of the capacity: CUDA context, NCCL
            buffers, allocator fragmentation.
    """

    param_bytes: int = 2
    grad_bytes: int = 4
    master_bytes: int = 4
    optimizer_bytes: int = 8
    activation_bytes: int = 2
    shard: str = "optimizer"
    recompute: str = "full"
    reserve_fraction: float = 0.10

    def __post_init__(self) -> None:
        for f in ("param_bytes", "grad_bytes", "activation_bytes"):
            check_int(f"memory.{f}", getattr(self, f), 1)
        for f in ("master_bytes", "optimizer_bytes"):
            check_int(f"memory.{f}", getattr(self, f), 0)
        check_choice("memory.shard", self.shard, SHARD_LEVELS)
        check_choice("memory.recompute", self.recompute, RECOMPUTE_MODES)
        check_number("memory.reserve_fraction", self.reserve_fraction, 0.0, maximum=0.9)


def memory_options(fields: dict) -> MemoryOptions:
    """:class:`MemoryOptions` from ``{FIELD: VALUE}`` (strings from ``--set`` are parsed)."""
    kinds = {f.name: f.type for f in dataclasses.fields(MemoryOptions)}
    values = {}
    for name, raw in fields.items():
        if name not in kinds:
            raise ValueError(f"memory.{name} is not a setting; allowed: "
                             f"{', '.join('memory.' + k for k in kinds)}")
        kind = kinds[name]
        try:
            if kind == "int":
                values[name] = int(raw) if isinstance(raw, str) else raw
            elif kind == "float":
                values[name] = float(raw) if isinstance(raw, (str, int)) else raw
            else:
                values[name] = str(raw).strip().lower()
        except ValueError:
            raise ValueError(f"memory.{name} = {raw!r}; allowed: a{'n int' if kind == 'int' else ' number'}") from None
    return MemoryOptions(**values)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU (the busiest GPU for the parts that differ between GPUs).

    ``peak = expert_weights + dense_weights + gradients + optimizer + max(replica_slots +
    activations, migration_staging)``: migration runs between steps, when the step's
    replica buffers and activations are freed.
    """

    expert_weights: float
    dense_weights: float
    gradients: float
    optimizer: float
    replica_slots: float
    activations: float
    migration_staging: float

    @property
    def persistent(self) -> float:
        return self.expert_weights + self.dense_weights + self.gradients + self.optimizer

    @property
    def peak(self) -> float:
        return self.persistent + max(self.replica_slots + self.activations, self.migration_staging)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "peak": self.peak}


def param_counts(model: ModelSpec) -> dict[str, int]:
    """Parameter counts: ``experts`` (all routed experts of all layers), ``dense`` (everything
    else: attention, norms, router, shared experts, dense FFNs, embedding and an untied LM
    head) and ``largest_dense_unit`` (the biggest of one layer's dense weights and the
    embedding: what ZeRO-2/3 reduce or gather at once)."""
    D = model.hidden_size
    norms = 2 * D
    attention = model.attention_projection_params() + norms
    moe_dense = attention + D * model.num_experts + 3 * D * model.shared_ffn * model.num_shared_experts
    dense_layer = attention + 3 * D * model.dense_ffn
    embedding = model.vocab_size * D
    dense = (model.num_moe_layers * moe_dense + model.num_dense_layers * dense_layer + 2 * embedding + D)
    largest = max(moe_dense, dense_layer if model.num_dense_layers else 0, embedding)
    return {"experts": model.num_moe_layers * model.num_experts * model.expert_params(),
            "dense": dense, "largest_dense_unit": largest}


def capacity_bytes(hardware: HardwareSpec, options: MemoryOptions) -> float:
    """Usable bytes per GPU: the preset's HBM less ``reserve_fraction``."""
    return hardware.hbm_gb * 1e9 * (1.0 - options.reserve_fraction)


def state_breakdown(model: ModelSpec, num_gpus: int, options: MemoryOptions, live_slots: int = 0,
                    migrates: bool = True, world: int | None = None) -> MemoryBreakdown:
    """Weights, gradients, optimizer state, ``live_slots`` replica buffers and migration
    staging per GPU, activations 0 (see :func:`activation_bytes_MG`).

    Args:
        model: the model; num_gpus: ``G``, the EP size.
        world: the data-parallel size of the dense part (default ``G``: EP over every GPU);
            the experts' data-parallel group is then ``world / G`` GPUs
            (``relibra simulate --compare-ep`` runs EP groups smaller than the cluster).
        live_slots: replica slots alive at once on the GPU, summed over MoE layers; each
            holds an expert's weights (``param_bytes``) and a gradient buffer (``grad_bytes``).
        migrates: whether experts move between steps (staging, see below).

    Migration staging is what ``ExpertEngine.apply_placement`` allocates: it moves one
    expert tensor of one layer at a time (each of w1, w2, w3 and its gradient and optimizer
    state) with ``distributed.migration.move_expert_rows``, holding the rows it sends, the
    rows it receives and the rearranged ``[El, ...]`` output, at most 3 copies of the GPU's
    rows of one ``D x F`` weight, in the widest dtype moved.
    """
    o = options
    G = check_int("num_gpus", num_gpus)
    d = check_int("world", G if world is None else world)  # data-parallel group of the dense part
    if d % G:
        raise ValueError(f"world = {d}; allowed: a multiple of the EP size {G}")
    n = param_counts(model)
    ed = d // G  # the experts' data-parallel group (1 when EP spans every GPU)
    shard = SHARD_LEVELS.index(o.shard)
    experts_here = n["experts"] / G
    unit = n["largest_dense_unit"]
    if ed > 1:  # a sharded unit then also holds the layer's experts of this EP rank
        unit = max(unit, n["experts"] / model.num_moe_layers / G + n["largest_dense_unit"])
    dense_w = o.param_bytes * n["dense"] / (d if shard >= 3 else 1)
    dense_g = o.grad_bytes * n["dense"] / (d if shard >= 2 else 1)
    if shard >= 3:  # FSDP gathers a unit's weights, prefetching the next one
        dense_w += 2 * o.param_bytes * unit
    if shard >= 2:  # one unit's full gradient before its reduce-scatter
        dense_g += o.grad_bytes * unit
    opt_per_param = o.master_bytes + o.optimizer_bytes
    dense_opt = opt_per_param * n["dense"] / (d if shard >= 1 else 1)
    experts_w = experts_here / (ed if shard >= 3 else 1)
    experts_g = experts_here / (ed if shard >= 2 else 1)
    experts_opt = experts_here / (ed if shard >= 1 else 1)
    slot_bytes = model.expert_params() * (o.param_bytes + o.grad_bytes)
    El = model.num_experts // G
    widest = max(o.param_bytes, o.grad_bytes, 4 if (o.master_bytes or o.optimizer_bytes) else 0)
    staging = 3 * El * model.hidden_size * model.moe_ffn * widest if migrates else 0
    return MemoryBreakdown(
        expert_weights=o.param_bytes * experts_w, dense_weights=dense_w,
        gradients=o.grad_bytes * experts_g + dense_g,
        optimizer=opt_per_param * experts_opt + dense_opt,
        replica_slots=float(live_slots * slot_bytes), activations=0.0,
        migration_staging=float(staging))


def _per_token_bytes(model: ModelSpec, a: int) -> dict[str, float]:
    """Bytes per token (``attention``, ``moe_token``, ``dense_ffn``) and per routed row
    (``row``) of the activations one layer's backward reads."""
    D, h = model.hidden_size, model.num_heads
    if model.is_mla:
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        q = h * qk + model.q_lora_rank
        k = h * qk + model.kv_lora_rank + model.qk_rope_head_dim
        v = o = h * model.v_head_dim
    else:
        q = o = h * model.head_dim
        k = v = model.num_kv_heads * model.head_dim
    # norm input and output, Q, K, V, the attention output (O projection input); FlashAttention
    # keeps no score matrix, only an fp32 log-sum-exp per head
    attention = a * (2 * D + q + k + v + o) + 4 * h
    # norm input and output, fp32 router probabilities, shared experts' gate, up, product
    moe_token = a * (2 * D + 3 * model.shared_ffn * model.num_shared_experts) + 4 * model.num_experts
    dense_ffn = a * (2 * D + 3 * model.dense_ffn)
    # a routed row: dispatched input, gate, up, SwiGLU product, expert output before combine
    row = a * (2 * D + 3 * model.moe_ffn)
    return {"attention": attention, "moe_token": moe_token, "dense_ffn": dense_ffn, "row": row}


def activation_bytes_MG(model: ModelSpec, options: MemoryOptions, tokens_MG: torch.Tensor,
                        rows_MLG: torch.Tensor) -> torch.Tensor:
    """Activation bytes per micro-batch and GPU, float64 ``[M, G]``.

    Args:
        tokens_MG: tokens each GPU runs attention for in each micro-batch.
        rows_MLG: token-expert rows each GPU's experts receive per MoE layer (the dispatch
            receive buffer, ``PlanMetrics.gpu_load_MLG``).

    Full recompute: every layer's input (``activation_bytes * D`` per token), plus the larger
    of the LM head's logits (bf16, and the fp32 copy the loss computes in) and one layer's
    activations together with their gradients (2x). No recompute: every layer's activations,
    plus the larger of the logits and one layer's gradients.
    """
    a = options.activation_bytes
    b = _per_token_bytes(model, a)
    t = tokens_MG.to(torch.float64)
    rows = rows_MLG.to(torch.float64)
    moe_LMG = (t * (b["attention"] + b["moe_token"])).unsqueeze(1) + rows * b["row"]  # [M, L, G]
    dense_MG = t * (b["attention"] + b["dense_ffn"]) if model.num_dense_layers else torch.zeros_like(t)
    logits_MG = t * model.vocab_size * (a + 4)
    one_layer_MG = torch.maximum(moe_LMG.max(1).values, dense_MG)
    if options.recompute == "full":
        kept = t * model.num_layers * model.hidden_size * a
        return kept + torch.maximum(logits_MG, 2.0 * one_layer_MG)
    kept = moe_LMG.sum(1) + model.num_dense_layers * dense_MG
    return kept + torch.maximum(logits_MG, one_layer_MG)


def live_slots_MG(plan) -> torch.Tensor:
    """int64 ``[M, G]``: replica slots holding an expert, summed over layers (a persistent
    replica keeps its weight and gradient buffers over its residency, so every occupied slot
    of a micro-batch is alive at its backward)."""
    El = plan.topology.experts_per_gpu
    return (plan.slot_expert_MLGJ[..., El:] >= 0).sum((1, 3))


def plan_memory(model: ModelSpec, options: MemoryOptions, plan, gpu_load_MLG: torch.Tensor,
                tokens_MS: torch.Tensor, world: int | None = None) -> MemoryBreakdown:
    """The busiest GPU's memory under one step plan: the state, the plan's live replica
    slots and activations at the worst (micro-batch, GPU); staging when experts moved."""
    topo = plan.topology
    migrates = plan.previous_placement_LE is not None and not torch.equal(
        plan.previous_placement_LE // topo.experts_per_gpu, plan.owner_gpu_LE())
    base = state_breakdown(model, topo.num_gpus, options, 0, migrates, world)
    slot_bytes = model.expert_params() * (options.param_bytes + options.grad_bytes)
    step_MG = live_slots_MG(plan) * float(slot_bytes) + activation_bytes_MG(
        model, options, tokens_MS, gpu_load_MLG)
    worst = int(step_MG.argmax())
    m, g = divmod(worst, step_MG.shape[1])
    slots = float(live_slots_MG(plan)[m, g]) * slot_bytes
    return dataclasses.replace(base, replica_slots=slots, activations=float(step_MG[m, g]) - slots)


def ideal_memory(model: ModelSpec, options: MemoryOptions, loads_MLSE: torch.Tensor,
                 tokens_MS: torch.Tensor, world: int | None = None) -> MemoryBreakdown:
    """Memory of the ideal system: no replicas, no migration, the mean load on every GPU.
    A lower bound on every system's need for the same step."""
    M, L, S, _ = loads_MLSE.shape
    mean_ML = loads_MLSE.sum((2, 3), dtype=torch.float64) / S
    act_MG = activation_bytes_MG(model, options, tokens_MS, mean_ML.unsqueeze(-1).expand(M, L, S))
    return dataclasses.replace(state_breakdown(model, S, options, 0, False, world), activations=float(act_MG.max()))


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB"


def check_fits(b: MemoryBreakdown, capacity: float, what: str, advice: str) -> str | None:
    """``None`` when ``b.peak`` fits ``capacity``; else the one-line message (for a
    ``ValueError``, or a warning under ``--ignore-memory``)."""
    if b.peak <= capacity:
        return None
    parts = (f"expert weights {_gb(b.expert_weights)}, dense weights {_gb(b.dense_weights)}, "
             f"gradients {_gb(b.gradients)}, optimizer {_gb(b.optimizer)}, replica slots "
             f"{_gb(b.replica_slots)}, activations {_gb(b.activations)}, migration staging "
             f"{_gb(b.migration_staging)}")
    return (f"memory: {what} needs {_gb(b.peak)} per GPU ({parts}) but {_gb(capacity)} is available; "
            f"{advice}; or --ignore-memory for a what-if run")


# --- the CLI's side: settings, the checks around planning, warnings ----------------------
def memory_settings(file_cfg: dict, sets: list[str]) -> MemoryOptions:
    """The ``[memory]`` table of ``--config``, then ``--set memory.X=..`` over it."""
    raw = file_cfg.get("memory")
    if raw is not None and not isinstance(raw, dict):
        raise ValueError(f"--config: 'memory' must be a table of FIELD = VALUE, got {raw!r}")
    fields = dict(raw or {})
    for text in sets:
        section, name, value = parse_override(text)
        if section == "memory":
            fields[name] = value
    try:
        return memory_options(fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--set/--config: {exc}") from None


def memory_verdict(message: str | None, ignore: bool, warnings: list[str]) -> list[str]:
    """Raise ``message`` as the refusal, or keep it as a warning under ``--ignore-memory``
    (one warning before the run is enough)."""
    if message and not ignore:
        raise ValueError(message)
    if message and not warnings:
        warnings.append(message)
    return warnings


def replicating(systems) -> bool:
    """Whether any of ``systems`` fills replica slots: every planner but static. The
    references the simulator always adds (``bound.REFERENCES``) hold no weights of their
    own, so a static-only run is not refused for slots it never fills."""
    return any(name not in ("static", *REFERENCES) for name in systems)


def workload_activations(model: ModelSpec, options: MemoryOptions, workload, warmup_steps: int) -> float:
    """The ideal system's activations over the measured steps (0 when there are none)."""
    steps = range(warmup_steps, workload.num_steps)
    return max((ideal_memory(model, options, workload.loads_XMLSE[x], workload.tokens_XMS[x]).activations
                for x in steps), default=0.0)


def peak_warnings(doc: dict) -> list[str]:
    """One line per system of a report whose peak exceeds the usable memory."""
    cap = doc["config"]["memory_capacity_bytes"]
    return [f"{name} needs {_gb(f['memory_peak_bytes'])} per GPU, {_gb(cap)} available"
            for name, f in doc["systems"].items() if f["memory_peak_bytes"] > cap]
