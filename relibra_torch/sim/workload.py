"""The loads a simulation runs on, with the per-rank token counts the dense cost needs.

Legend (shape suffixes): X steps, M micro-batches, L MoE layers, S source ranks (= G EP
ranks), E experts.

A :class:`Workload` comes from the synthetic RL trace generator
(:mod:`relibra_torch.sim.traces`), from a loads file (used as batched) or from a routing
replay file (batched into ranks and micro-batches by :mod:`relibra_torch.replay`'s
deterministic rule). The attention cost needs sample lengths; when the source has none
(synthetic loads, loads files) every rank's micro-batch is taken as packed samples of
``sample_tokens`` tokens, and the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checks import check_int
from ..planning.topology import Topology
from .data_refs import qwen3_expert_heat
from .dispatch import TokenRouting, token_routing_from_bins
from .presets import ModelSpec

__all__ = ["Workload", "causal_pairs", "packed_pairs", "workload_from_loads", "synthetic_workload",
           "workload_from_file", "fit_micro_batches", "measured_micro_batches", "DEFAULT_SAMPLE_TOKENS"]

# RL post-training responses run from a few hundred to tens of thousands of tokens (long
# chain-of-thought); 4096 is a middle value for the quadratic attention term when a source
# carries no sample lengths. Override with --sample-tokens.
DEFAULT_SAMPLE_TOKENS = 4096


@dataclass
class Workload:
    """Loads of ``X`` steps plus the per-rank token and attention-pair counts.

    Attributes:
        loads_XMLSE: int64 ``[X, M, L, S, E]`` token-expert pairs.
        tokens_XMS: int64 ``[X, M, S]`` tokens per rank and micro-batch.
        attn_pairs_XMS: float64 ``[X, M, S]`` causal attention (query, key) pairs.
        source: a short description for reports.
        notes: assumptions made while building it (for the report's config section).
        routing: per-token expert ids grouped by (step, micro-batch, rank), when the source
            has them (routing replay files); hierarchical dispatch then counts each
            token's remote nodes exactly instead of estimating them from counts.
    """

    loads_XMLSE: torch.Tensor
    tokens_XMS: torch.Tensor
    attn_pairs_XMS: torch.Tensor
    source: str
    notes: dict = field(default_factory=dict)
    routing: "TokenRouting | None" = None

    @property
    def num_steps(self) -> int:
        return self.loads_XMLSE.shape[0]

    @property
    def num_micro_batches(self) -> int:
        return self.loads_XMLSE.shape[1]


def measured_micro_batches(workload: Workload, warmup_steps: int) -> torch.Tensor:
    """bool ``[X - warmup_steps, M]``: the measured micro-batches that hold tokens on some rank.

    Empty ones (e.g. a loads file of dynamic batches with trailing empty micro-batches) get
    a note in ``workload.notes``; measured steps with no token at all are refused
    (``ValueError``): every system's step would cost nothing and the speedups say nothing.
    """
    active_XM = workload.tokens_XMS[warmup_steps:].sum(-1) > 0
    if not bool(active_XM.any()):
        last = workload.num_steps - 1
        steps = f"step {last}" if warmup_steps == last else f"steps {warmup_steps}..{last}"
        where = "" if not bool(workload.tokens_XMS.any()) else (
            f" in its measured {steps} (after --warmup-steps={warmup_steps}); pass fewer --warmup-steps")
        raise ValueError(f"{workload.source} holds no tokens{where}")
    empty = int((~active_XM).sum())
    if empty:
        workload.notes["empty micro-batches"] = (f"{empty} of {active_XM.numel()} measured micro-batches hold no "
                                                 f"tokens; left out of the imbalance figures")
    return active_XM


def causal_pairs(lengths: torch.Tensor) -> torch.Tensor:
    """``n (n + 1) / 2`` per sample length ``n`` (int64, any shape): the causal attention pairs."""
    n = lengths.to(torch.int64)
    return n * (n + 1) // 2


def packed_pairs(tokens: torch.Tensor, sample_tokens: int) -> torch.Tensor:
    """Causal pairs of ``tokens`` packed as samples of ``sample_tokens`` (last one shorter).

    Args: tokens: int ``[...]``. Returns float64 ``[...]``.
    """
    check_int("--sample-tokens", sample_tokens, 1)
    t = tokens.to(torch.int64)
    full, rest = t // sample_tokens, t % sample_tokens
    return (full * causal_pairs(torch.tensor(sample_tokens)) + causal_pairs(rest)).to(torch.float64)


def _check_loads(loads: torch.Tensor, model: ModelSpec, topology: Topology, what: str) -> torch.Tensor:
    if loads.dtype not in (torch.int16, torch.int32, torch.int64):
        raise TypeError(f"{what}: loads has dtype {loads.dtype}; allowed: int16, int32 or int64")
    if loads.dim() == 4:
        loads = loads.unsqueeze(0)
    if loads.dim() != 5:
        raise ValueError(f"{what}: loads must be [M, L, S, E] or [steps, M, L, S, E], "
                         f"got shape {tuple(loads.shape)}")
    X, M, L, S, E = loads.shape
    if E != model.num_experts:
        raise ValueError(f"{what}: the loads have {E} experts but --model {model.name} has "
                         f"{model.num_experts}; pass --model-config or the matching --model")
    if L != model.num_moe_layers:
        raise ValueError(f"{what}: the loads have {L} MoE layers but --model {model.name} has "
                         f"{model.num_moe_layers}; pass --model-config or the matching --model")
    if S != topology.num_gpus:
        raise ValueError(f"{what}: the loads were batched for {S} ranks but --nodes x "
                         f"--gpus-per-node = {topology.num_gpus}; a loads file is used as batched")
    if X == 0 or M == 0:
        raise ValueError(f"{what}: the loads have no steps or micro-batches (shape {tuple(loads.shape)})")
    if (loads < 0).any():
        raise ValueError(f"{what}: the loads have negative counts")
    return loads.to(torch.int64)


def workload_from_loads(loads: torch.Tensor, model: ModelSpec, topology: Topology,
                        sample_tokens: int = DEFAULT_SAMPLE_TOKENS, source: str = "loads",
                        tokens_XMS: torch.Tensor | None = None,
                        attn_pairs_XMS: torch.Tensor | None = None) -> Workload:
    """Build a :class:`Workload` from ``[X, M, L, S, E]`` (or ``[M, L, S, E]``) loads.

    Without ``tokens_XMS``, a rank's tokens are its layer-0 load divided by ``top_k`` (each
    token picks ``top_k`` distinct experts); a load not divisible by ``top_k`` is an error,
    since then the counts cannot come from this model. Without ``attn_pairs_XMS``, tokens
    are packed into samples of ``sample_tokens``.
    """
    loads = _check_loads(loads, model, topology, source)
    notes: dict = {}
    if tokens_XMS is None:
        per_rank_XMLS = loads.sum(-1)
        if (per_rank_XMLS % model.top_k).any():
            raise ValueError(f"{source}: a rank's load is not a multiple of top_k={model.top_k} "
                             f"of --model {model.name}; the file's top-k disagrees with the model")
        if not torch.equal(per_rank_XMLS, per_rank_XMLS[:, :, :1].expand_as(per_rank_XMLS)):
            raise ValueError(f"{source}: a rank's load differs between layers; every layer "
                             f"routes the same tokens, so this cannot be a loads tensor")
        tokens_XMS = per_rank_XMLS[:, :, 0] // model.top_k
    if attn_pairs_XMS is None:
        attn_pairs_XMS = packed_pairs(tokens_XMS, sample_tokens)
        notes["sample_tokens_assumed"] = sample_tokens
    return Workload(loads, tokens_XMS.to(torch.int64), attn_pairs_XMS.to(torch.float64), source, notes)


def synthetic_workload(model: ModelSpec, topology: Topology, num_micro_batches: int,
                       tokens_per_rank: int, steps: int, seed: int,
                       sample_tokens: int = DEFAULT_SAMPLE_TOKENS, trace: str = "default",
                       skew: float = 1.0) -> Workload:
    """A synthetic RL trace (seeded, mixed tasks) from :mod:`relibra_torch.sim.traces`:
    ``trace`` names a family of ``relibra_torch.sim.traces.families.FAMILIES`` (``default``:
    the calibrated trace of docs/traces.md); ``skew`` is ``TraceConfig.skew`` (1: as calibrated)."""
    try:
        from . import traces
        from .traces.families import FAMILIES
    except ImportError as exc:  # the trace generator ships separately
        raise ValueError("the synthetic trace generator (relibra_torch.sim.traces) is not "
                         f"available ({exc}); pass a loads or routing replay file") from None
    if trace not in FAMILIES:
        raise ValueError(f"--trace = {trace!r}; allowed: one of {', '.join(FAMILIES)}")
    family = trace
    cfg = _trace_config(traces, model, seed, skew)
    trace = FAMILIES[family](cfg, num_micro_batches, topology.num_gpus, tokens_per_rank, steps=steps)
    X, M, S = trace.tokens_XMS.shape
    pairs_XMS = torch.zeros(X * M * S, dtype=torch.int64).index_add_(
        0, trace.sample_bin_N, causal_pairs(trace.sample_length_N)).view(X, M, S)
    wl = workload_from_loads(trace.loads_XMLSE, model, topology, sample_tokens,
                               source=(f"synthetic RL trace (seed {seed}, tasks {','.join(trace.tasks)})"
                                       if family == "default" else
                                       f"synthetic RL trace '{family}' (seed {seed}, tasks {','.join(trace.tasks)})"),
                               tokens_XMS=trace.tokens_XMS, attn_pairs_XMS=pairs_XMS.to(torch.float64))
    E0 = qwen3_expert_heat().heat_LE.shape[1]   # the heat the trace is calibrated on
    if model.num_experts != E0:  # say how it was mapped to the model's experts
        how = "merged" if model.num_experts < E0 else "resampled by quantile"
        wl.notes["trace heat"] = (f"Qwen3-30B-A3B's {E0} experts {how} to {model.num_experts} (docs/traces.md, "
                                  "'Other expert counts'); --set trace.skew=S scales it, or pass your routing")
    return wl


def _trace_config(traces, model: ModelSpec, seed: int, skew: float = 1.0):
    """A ``TraceConfig`` for ``model``: fills the fields the generator has by their names."""
    import dataclasses
    wanted = {"num_experts": model.num_experts, "top_k": model.top_k,
              "num_layers": model.num_moe_layers, "seed": seed, "skew": skew}
    names = {f.name for f in dataclasses.fields(traces.TraceConfig)}
    missing = {"num_experts", "top_k", "num_layers"} - names
    if missing:
        raise ValueError(f"relibra_torch.sim.traces.TraceConfig lacks fields {sorted(missing)}")
    return traces.TraceConfig(**{k: v for k, v in wanted.items() if k in names})


def fit_micro_batches(step_lengths: list[torch.Tensor], num_ranks: int, requested: int) -> tuple[int, dict]:
    """The micro-batch count a replay file can fill, and notes saying what was fitted.

    A micro-batch needs a sample on every rank: ``M = max(1, min(requested, fewest samples
    any rank holds in any step))``, ranks as :func:`relibra_torch.replay.batch_samples`
    assigns them (greedy by tokens; that does not depend on ``M``). More micro-batches than
    a rank has samples leave micro-batches with no tokens, and their imbalance would say
    nothing about the file (a 32-sample file on 32 ranks with 32 micro-batches fills 1 of
    them). A note also says when some ranks hold no sample at all (fewer samples than ranks).

    Args:
        step_lengths: per recorded step, the int ``[N_x]`` sample lengths.
        num_ranks: ``G``, the EP ranks the samples are batched into.
        requested: ``--micro-batches``.
    Returns:
        ``(M, notes)``; ``notes`` is empty when nothing was changed or left idle.
    """
    from ..replay import batch_samples
    per_rank_XS = torch.stack([torch.bincount(batch_samples(lengths, num_ranks, num_micro_batches=1).rank_N,
                                              minlength=num_ranks) for lengths in step_lengths])
    fewest = int(per_rank_XS.min())
    fitted = max(1, min(requested, fewest))
    notes: dict = {}
    if fitted < requested:
        notes["micro-batches"] = (f"{fitted}, not {requested}: a micro-batch needs a sample on every rank; "
                                  f"max(1, min(--micro-batches {requested}, fewest samples a rank holds in a "
                                  f"step = {fewest}))")
    idle = int((per_rank_XS == 0).sum(1).max())
    if idle:
        smallest = min(int(lengths.numel()) for lengths in step_lengths)
        notes["idle ranks"] = (f"{idle} of {num_ranks} ranks hold no sample (the file has {smallest} samples "
                               f"in a step); they send no tokens and only receive expert work: pass fewer "
                               f"--nodes/--gpus-per-node, or a file with >= {num_ranks} samples per step")
    return fitted, notes


def workload_from_file(path: str, model: ModelSpec, topology: Topology, num_micro_batches: int,
                       sample_tokens: int = DEFAULT_SAMPLE_TOKENS) -> Workload:
    """A ``relibra.loads/1`` file (used as batched) or a ``relibra.routing/1`` replay file.

    Replay files are batched by :func:`relibra_torch.replay.batch_samples` with
    ``num_ranks = G`` and ``num_micro_batches`` fitted to the file by
    :func:`fit_micro_batches` (the workload's notes say when it was lowered; samples in file order go to the rank with
    the fewest tokens so far; on each rank, each sample goes to the micro-batch where its
    midpoint falls when the rank's tokens are cut into equal parts). With a ``sample_step``
    tensor each recorded step is batched separately, in increasing step order; without one
    the whole file is one step. Sample lengths are known, so the attention term uses them.
    """
    import os
    if not os.path.exists(path):
        raise FileNotFoundError(f"REPLAY_OR_LOADS_FILE {path!r} does not exist")
    from .. import replay
    from ..replay.fileio import read_header
    fmt = read_header(path).metadata.get("format")
    name = os.path.basename(path)
    if fmt == replay.LOADS_FORMAT:
        lf = replay.load_loads(path)
        if lf.top_k != model.top_k:
            raise ValueError(f"{path!r} has top_k={lf.top_k} but --model {model.name} has top_k="
                             f"{model.top_k}; pass --model-config or the matching --model")
        return workload_from_loads(lf.loads_XMLSE, model, topology, sample_tokens,
                                   source=f"loads file {name}", tokens_XMS=lf.tokens())
    if fmt != replay.ROUTING_FORMAT:
        raise ValueError(f"{path!r} has format {fmt!r}; allowed: {replay.ROUTING_FORMAT!r} or "
                         f"{replay.LOADS_FORMAT!r}")
    rr = replay.load_routing(path)
    for what, got, want in (("num_experts", rr.num_experts, model.num_experts),
                            ("top_k", rr.top_k, model.top_k),
                            ("num_layers", rr.num_layers, model.num_moe_layers)):
        if got != want:
            raise ValueError(f"{path!r} has {what}={got} but --model {model.name} has {want}; "
                             f"pass --model-config or the matching --model")
    if rr.sample_step is not None:
        step_ids = torch.unique(rr.sample_step).tolist()
        groups = [(rr.sample_step == s).nonzero().flatten() for s in step_ids]
    else:
        groups = [torch.arange(rr.num_samples)]
    G = topology.num_gpus
    parts = [rr.select(ids) if len(groups) > 1 else rr for ids in groups]
    num_micro_batches, fit_notes = fit_micro_batches([p.sample_lengths for p in parts], G, num_micro_batches)
    loads, tokens, pairs, bins = [], [], [], []
    for part in parts:
        lengths = part.sample_lengths
        assign = replay.batch_samples(lengths, G, num_micro_batches=num_micro_batches)
        bins.append(assign.micro_batch_N * G + assign.rank_N)
        loads.append(part.counts(assign))
        flat = assign.micro_batch_N * G + assign.rank_N
        M = assign.num_micro_batches
        tokens.append(torch.zeros(M * G, dtype=torch.int64).scatter_add_(0, flat, lengths).view(M, G))
        pairs.append(torch.zeros(M * G, dtype=torch.int64).scatter_add_(0, flat, causal_pairs(lengths))
                     .view(M, G).to(torch.float64))
    wl = workload_from_loads(torch.stack(loads), model, topology, sample_tokens,
                             source=f"routing replay {name} ({rr.num_samples} samples)",
                             tokens_XMS=torch.stack(tokens), attn_pairs_XMS=torch.stack(pairs))
    wl.notes.update(fit_notes)
    wl.routing = token_routing_from_bins(rr.routed_experts_TLK, rr.sample_offsets, bins, groups,
                                         num_micro_batches * G, G)
    if rr.coverage == "completion-only":  # relibra convert --completion-only: say it under every table
        wl.notes["coverage"] = "completion-only: some samples lack their prompt tokens' rows (loads understated)"
    return wl
