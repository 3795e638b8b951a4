"""What a memory refusal of ``relibra simulate`` advises: the option changes that make it fit.

The check before planning (:func:`precheck`) and the check of each plan (the simulator's)
refuse with :func:`refusal`: the need (:class:`~relibra_torch.sim.memory.MemoryBreakdown`), the
capacity, and the changes after which the same terms fit (:func:`fit_fixes`): single changes
first, then pairs; only options that exist for the run (``--nodes`` only at EP sizes that
divide the experts and not for a loads file, fewer ``--replica-slots`` only when some are
filled, ``--micro-batch-tokens`` only for a synthetic trace). Memory model: :mod:`.memory`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .memory import (SHARD_LEVELS, MemoryBreakdown, MemoryOptions, activation_bytes_MG, capacity_bytes,
                     check_fits, state_breakdown)
from .presets import HardwareSpec, ModelSpec

__all__ = ["TraceShape", "synthetic_activations", "home_activations", "larger_ep_nodes", "fit_fixes", "refusal",
           "precheck"]


def synthetic_activations(model: ModelSpec, options: MemoryOptions, tokens_per_gpu: int) -> float:
    """The ideal system's activations on ``tokens_per_gpu`` tokens per GPU and micro-batch,
    ``top_k`` rows per token on every GPU: what :func:`workload_activations` finds on a
    synthetic trace of fixed packing (every rank holds ``--micro-batch-tokens``), before it exists."""
    t_MG = torch.full((1, 1), float(tokens_per_gpu), dtype=torch.float64)
    rows_MLG = t_MG.unsqueeze(1).expand(1, model.num_moe_layers, 1) * model.top_k
    return float(activation_bytes_MG(model, options, t_MG, rows_MLG).max())


@dataclass(frozen=True)
class TraceShape:
    """What sets the activations, for a refusal's advice. ``kind``: ``synthetic`` (``tokens``
    is ``--micro-batch-tokens``), ``routing`` (a routing replay file: its tokens spread over
    the GPUs and ``micro_batches``) or ``loads`` (a loads file, used as batched: fixed GPUs
    and tokens); ``tokens``: the most tokens of a GPU in a micro-batch."""

    kind: str
    tokens: int
    micro_batches: int = 1


def home_activations(model: ModelSpec, options: MemoryOptions, workload, warmup_steps: int) -> float:
    """Static's activations over the measured steps: every expert on its home GPU (expert
    ``e`` on GPU ``e // (E / G)``), no replica: the unbalanced plan's busiest GPU."""
    X, M, L, S, E = workload.loads_XMLSE.shape
    return max((float(activation_bytes_MG(model, options, workload.tokens_XMS[x], workload.loads_XMLSE[x].sum(
        2).view(M, L, S, E // S).sum(-1)).max()) for x in range(warmup_steps, X)), default=0.0)


def larger_ep_nodes(model: ModelSpec, topology) -> list[int]:
    """Node counts above ``topology``'s whose EP size (nodes x GPUs per node) divides the experts."""
    g = topology.gpus_per_node
    return [n for n in range(topology.num_nodes + 1, model.num_experts // g + 1) if model.num_experts % (n * g) == 0]


def fit_fixes(b: MemoryBreakdown, model: ModelSpec, topology, hardware: HardwareSpec, options: MemoryOptions,
              trace: TraceShape | None = None, world: int | None = None) -> list[str]:
    """Option changes after which ``b`` fits: every single change that does (its least step
    each: ``--set memory.shard``, ``--replica-slots``, the tokens, ``--nodes``), then pairs
    where the second change is smaller than alone; ``[]`` when none in reach. The same terms
    as ``b``: replica slots scale by ``r / R``, activations by the tokens per GPU (constant
    over ``--nodes`` on a synthetic trace, ``G / G'`` for a routing file); a loads file fixes
    the GPUs. Only EP sizes that divide the experts are tried. ``world``: the GPUs of the
    dense part's data-parallel group when ``topology`` is one of several EP groups
    (``--compare-ep``; None: EP spans every GPU); ``--nodes`` is then not tried, since it
    changes the number of groups, not the EP size."""
    cap, g, G0, R = capacity_bytes(hardware, options), topology.gpus_per_node, topology.num_gpus, topology.replica_slots
    kind = trace.kind if trace else ""
    nodes = [] if kind == "loads" or world is not None else larger_ep_nodes(model, topology)
    shards = list(SHARD_LEVELS[SHARD_LEVELS.index(options.shard) + 1:])
    slots = list(range(R - 1, -1, -1)) if b.replica_slots > 0 else []

    def parts(n, sh, r):  # persistent + staging, slots, activations at 1x tokens
        G = G0 if n is None else n * g
        st = state_breakdown(model, G, dataclasses.replace(options, shard=sh or options.shard), 0,
                             b.migration_staging > 0, world=world)
        act = b.activations * (G0 / G if kind == "routing" else 1.0)
        return st, b.replica_slots * (R if r is None else r) / max(R, 1), act

    def fits(n, sh, r, scale=1.0):
        st, sl, act = parts(n, sh, r)
        return dataclasses.replace(st, replica_slots=sl, activations=act * scale).peak <= cap

    def tokens(n, sh, r):  # the least token change that fits, as text, or None
        st, sl, act = parts(n, sh, r)
        room = cap - st.persistent - sl
        if not trace or act <= 0 or room <= 0 or cap - st.persistent < st.migration_staging:
            return None
        s, T, M = room / act, trace.tokens, trace.micro_batches
        if s >= 1:  # fits without a token change
            return None
        if kind == "synthetic" and int(T * s) >= 1 and fits(n, sh, r, int(T * s) / T):
            return f"--micro-batch-tokens {int(T * s)} (now {T})"
        if kind == "routing" and fits(n, sh, r, M / -(-M // s)):
            return f"--micro-batches {int(-(-M // s))} (now {M}; if each rank holds that many samples a step)"
        if kind == "loads" and fits(n, sh, r, 1 / -(-1 // s)):
            return (f"a loads file with {int(-(-1 // s))}x smaller micro-batches (its tokens per micro-batch, "
                    f"up to {T} per GPU, set the activations; --micro-batch-tokens does not apply)")
        return None

    texts = {"shard": lambda v: f"--set memory.shard={v} (now {options.shard})",
             "slots": lambda v: f"--replica-slots {v} (now {R})", "nodes": lambda v: f"--nodes {v} (EP {v * g})"}
    dims = {"shard": shards, "slots": slots, "nodes": nodes}
    at = {"shard": lambda v: (None, v, None), "slots": lambda v: (None, None, v), "nodes": lambda v: (v, None, None)}
    single = {d: next((texts[d](v) for v in vals if fits(*at[d](v))), None) for d, vals in dims.items()}
    single["tokens"] = tokens(None, None, None)
    fixes = [t for t in single.values() if t]
    for first in ("shard", "slots", "nodes"):
        for second in ("slots", "nodes", "tokens"):
            if second == first or (first, second) == ("nodes", "slots"):
                continue
            for v in dims[first]:
                n, sh, r = at[first](v)
                if second == "tokens":
                    t = tokens(n, sh, r)
                else:
                    t = next((texts[second](w) for w in dims[second]
                              if fits(*[x if x is not None else y for x, y in zip((n, sh, r), at[second](w))])), None)
                if t and t != single[second] and not (second == "tokens" and single["tokens"]):
                    fixes.append(f"{texts[first](v)} with {t}")
                    break
    return fixes


def refusal(b: MemoryBreakdown, model: ModelSpec, topology, hardware: HardwareSpec, options: MemoryOptions,
            what: str, trace: TraceShape | None = None, advice: MemoryBreakdown | None = None,
            after: str = "", world: int | None = None) -> str | None:
    """:func:`check_fits` with the :func:`fit_fixes` of ``b`` as the advice (and, when no
    larger EP size divides the experts, the EP sizes that do); ``advice``: the terms the fixes
    must fit instead of ``b``'s; ``after``: said after the advice (what the fixes count);
    ``world``: as for :func:`fit_fixes` (EP groups of ``--compare-ep``)."""
    cap = capacity_bytes(hardware, options)
    if b.peak <= cap:
        return None
    fixes = fit_fixes(advice or b, model, topology, hardware, options, trace, world)
    E, G = model.num_experts, topology.num_gpus
    note, tried = "", "--set memory.shard, --replica-slots, --nodes, the tokens"
    if world is not None:  # --compare-ep sets the EP size; --nodes would only add data-parallel groups
        tried = "--set memory.shard, --replica-slots, the tokens"
        note = "" if fixes else "; a larger --compare-ep size spreads the experts over more GPUs"
    elif not larger_ep_nodes(model, topology):
        note = (f" (more --nodes cannot help: no EP size above {G} divides the {E} experts; EP sizes: "
                f"{', '.join(str(d) for d in range(1, E + 1) if E % d == 0)})")
    elif trace and trace.kind == "loads":
        note = " (a loads file is used as batched: its GPUs are fixed)"
    advice = "fix: " + "; or ".join(fixes) if fixes else f"nothing in reach by one or two of {tried}"
    return check_fits(b, cap, what, advice + note + after)


def precheck(model: ModelSpec, topology, hardware: HardwareSpec, options: MemoryOptions,
             replicating: bool, activations: float = 0.0, trace: TraceShape | None = None,
             advice_activations: float = 0.0, world: int | None = None) -> str | None:
    """The check before any planning: weights, gradients, optimizer state, every replica
    slot filled (when a replicating system runs; EPLB fills them all), migration staging and
    ``activations`` (the ideal system's, a lower bound for every plan). ``None`` if it fits,
    else the one-line message with the changes that make it fit (:func:`fit_fixes`), counted
    with ``advice_activations`` when larger (:func:`home_activations`: static's plan).
    ``world``: the cluster's GPUs when ``topology`` is one of ``world / G`` data-parallel EP
    groups (``--compare-ep``; the dense state is sharded over all of them); None: EP spans
    every GPU."""
    R, g = topology.replica_slots, topology.gpus_per_node
    ep = topology.num_gpus > 1  # on one GPU every expert is native: no replica, no move
    L = model.num_moe_layers if replicating and ep else 0
    b = dataclasses.replace(state_breakdown(model, topology.num_gpus, options, L * R, migrates=ep, world=world),
                            activations=activations)
    what = (f"{model.name} on {topology.num_nodes} x {g} {hardware.name} "
            f"(EP {topology.num_gpus}, R={R})")
    if world is not None:
        what = (f"{model.name} at EP {topology.num_gpus} on {topology.num_nodes} x {g} {hardware.name} "
                f"(one of {world // topology.num_gpus} data-parallel EP groups, R={R})")
    if advice_activations <= activations:
        return refusal(b, model, topology, hardware, options, what, trace, world=world)
    # the fixes make the busiest GPU of the unbalanced plan fit too (a plan's own check)
    worst = dataclasses.replace(b, activations=advice_activations)
    return refusal(b, model, topology, hardware, options, what, trace, worst,
                   f" (the fixes count static's activations, {advice_activations / 1e9:,.1f} GB)", world=world)
