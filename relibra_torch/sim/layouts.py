"""Compare expert-parallel layouts of one model on one cluster (``relibra simulate --compare-ep``).

A cluster of ``W = nodes * gpus_per_node`` GPUs can run a model at any EP size ``g`` that
divides ``W`` (and the expert count): ``W / g`` EP groups then each hold a full copy of the
experts, sharded ``E / g`` per GPU, and train data-parallel. The comparison keeps the work
fixed: the same trace of ``W`` ranks (the same tokens on every GPU) is split into ``W / g``
consecutive, node-aligned groups of ``g`` ranks, and each group is simulated on its own
``g``-GPU topology with every system. The optimizer step waits for the slowest group, so a
system's step is, per measured step, the maximum over groups, plus the expert gradients'
data-parallel synchronisation (absent at ``g = W``):

* experts are replicated over the ``W / g`` groups, so every expert's gradient is reduced
  over a data-parallel group of ``W / g`` GPUs (one GPU with the same EP rank in each group).
  Megatron-Core's distributed optimizer reduce-scatters fp32 gradients and all-gathers the
  updated bf16 weights: ``(n - 1) / n * P * (4 + 2)`` bytes per GPU for ``P`` expert
  parameters on it and ``n = W / g``, over the slowest link of that group (inter-node once
  the group spans nodes, NVLink otherwise), not overlapped with the backward pass (a
  conservative choice: Megatron can overlap it; the time is printed so it can be discounted).
* dense (attention, shared-expert, dense-layer) gradients are all-reduced over all ``W``
  GPUs at every EP size and for every system alike: left out here as in the single-layout
  tables.

Throughput is tokens per GPU-second: the step's tokens over ``W * step seconds``.

The cluster may hold more GPUs than the model has experts, or a count that does not divide
them (Mixtral's 8 experts on 2 x 8 GPUs): no single EP group then spans it, so there is no
whole-cluster :class:`Topology`. The trace is still made for all ``W`` ranks (a
:class:`Cluster` gives the generators their rank and node counts) and each group is planned on
its own topology; the memory check before planning runs at the largest EP size asked for.

Legend: X steps, M micro-batches, L MoE layers, S source ranks, E experts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from ..planning.topology import Topology
from .memory_fit import home_activations
from .model_choice import ep_hint
from .report import format_seconds, static_imbalance
from .simulator import REFERENCES, SimConfig, simulate
from .workload import Workload

__all__ = ["Cluster", "LayoutRow", "cluster_layout", "compare_layouts", "run_compare", "expert_grad_sync_s",
           "group_home_activations", "parse_ep_sizes", "split_workload"]

# Megatron-Core distributed optimizer: fp32 gradient reduce-scatter + bf16 weight all-gather
GRAD_SYNC_BYTES_PER_PARAM = 4 + 2


@dataclass(frozen=True)
class Cluster:
    """``num_nodes`` x ``gpus_per_node`` GPUs, ranks node-major: the cluster's shape without
    an expert count. What the workload generators read of a topology (``num_gpus`` ranks,
    ``gpus_per_node`` for packing), so a trace can be made for a cluster whose GPU count does
    not divide the experts."""

    num_nodes: int
    gpus_per_node: int

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


def node_aligned_sizes(num_gpus: int, num_experts: int, gpus_per_node: int) -> list[int]:
    """EP sizes, ascending, that divide the ``num_gpus`` GPUs and the ``num_experts`` experts
    and fill whole nodes of ``gpus_per_node`` or divide one (so that groups are node-aligned)."""
    return [d for d in range(1, num_gpus + 1) if num_gpus % d == 0 and num_experts % d == 0
            and (d % gpus_per_node == 0 or gpus_per_node % d == 0)]


def parse_ep_sizes(text: str, num_gpus: int, num_experts: int, gpus_per_node: int) -> tuple[int, ...]:
    """``"8,16,32"`` -> sorted EP sizes; each must divide the cluster and the expert count and
    fill whole nodes or divide one node (so that groups are node-aligned)."""
    try:
        sizes = sorted({int(s) for s in str(text).split(",") if s.strip()})
    except ValueError:
        raise ValueError(f"--compare-ep {text!r}; allowed: comma-separated EP sizes, e.g. 8,16,32") from None
    if not sizes:
        raise ValueError("--compare-ep is empty; allowed: comma-separated EP sizes, e.g. 8,16,32")
    for g in sizes:
        if g < 1 or num_gpus % g or num_experts % g or (g % gpus_per_node and gpus_per_node % g):
            ok = node_aligned_sizes(num_gpus, num_experts, gpus_per_node)
            raise ValueError(f"--compare-ep {g}: an EP size must divide the {num_gpus} GPUs and the "
                             f"{num_experts} experts and fill whole nodes of {gpus_per_node} or divide one; "
                             f"allowed: {','.join(map(str, ok))}")
    return tuple(sizes)


def cluster_layout(nodes: int, gpus_per_node: int, num_experts: int, replica_slots: int, compare_ep: str | None,
                   model_name: str) -> tuple[Topology, Topology | Cluster, tuple[int, ...]]:
    """The topology to plan and check memory on, the shape to make the trace for, and the EP
    sizes of ``--compare-ep`` (``()`` without it).

    When ``nodes * gpus_per_node`` divides the experts: the whole cluster's :class:`Topology`,
    twice (a plain run and ``--compare-ep`` as before). Otherwise only ``--compare-ep`` can run
    it, as data-parallel EP groups: the topology of one group at the largest size asked for
    (the memory check's; each size is planned on its own in :func:`compare_layouts`) and a
    :class:`Cluster`. A plain run is refused, naming the EP sizes and ``--compare-ep``.
    """
    G = nodes * gpus_per_node
    sizes = parse_ep_sizes(compare_ep, G, num_experts, gpus_per_node) if compare_ep else ()
    if num_experts % G == 0:
        topology = Topology(nodes, gpus_per_node, num_experts, replica_slots)
        return topology, topology, sizes
    if sizes:
        g = sizes[-1]
        group = Topology(max(1, g // gpus_per_node), min(g, gpus_per_node), num_experts, replica_slots)
        return group, Cluster(nodes, gpus_per_node), sizes
    divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
    msg = (f"--nodes {nodes} x --gpus-per-node {gpus_per_node} = {G} GPUs does not divide the "
           f"{num_experts} experts of {model_name}; allowed EP sizes: "
           f"{', '.join(map(str, divisors))}; e.g. {ep_hint(num_experts, nodes, gpus_per_node)}")
    groups = node_aligned_sizes(G, num_experts, gpus_per_node)
    if groups:  # the same cluster as data-parallel EP groups of a size that divides the experts
        msg += (f"; or keep the {G} GPUs as {G // groups[-1]} data-parallel EP groups: --compare-ep {groups[-1]} "
                f"(sizes: {','.join(map(str, groups))})")
    raise ValueError(msg)


def group_home_activations(model, options, workload: Workload, warmup_steps: int, ep_size: int) -> float:
    """:func:`~relibra_torch.sim.memory_fit.home_activations` at ``ep_size``: static's busiest
    GPU over the ``S / ep_size`` EP groups, each with its own home placement (``E / ep_size``
    experts per GPU), for the memory check of a cluster that no single EP group spans."""
    return max(home_activations(model, options, part, warmup_steps) for part in split_workload(workload, ep_size))


def split_workload(workload: Workload, ep_size: int) -> list[Workload]:
    """The ``S / ep_size`` EP groups of consecutive ranks, each a workload of its own.

    Per-token routing (routing files) is not split: the groups' hierarchical traffic is then
    estimated from counts, and each group's notes say so.
    """
    S = workload.loads_XMLSE.shape[3]
    out = []
    for first in range(0, S, ep_size):
        ranks = slice(first, first + ep_size)
        notes = dict(workload.notes)
        if workload.routing is not None:
            notes["layouts"] = "EP groups use counts: hierarchical traffic is estimated per group"
        out.append(Workload(workload.loads_XMLSE[:, :, :, ranks].contiguous(),
                            workload.tokens_XMS[:, :, ranks].contiguous(),
                            workload.attn_pairs_XMS[:, :, ranks].contiguous(),
                            f"{workload.source}, ranks {first}-{first + ep_size - 1}", notes))
    return out


def expert_grad_sync_s(config: SimConfig, ep_size: int, num_gpus: int, gpus_per_node: int | None = None) -> float:
    """Seconds per step of the expert gradients' data-parallel synchronisation at ``ep_size``
    on a cluster of ``num_gpus`` GPUs, ``gpus_per_node`` to a node (None: the topology's of
    ``config``, when it is the whole cluster); see the module docstring. 0 when one EP group
    spans the cluster."""
    n = num_gpus // ep_size
    if n == 1:
        return 0.0
    model, hw = config.model, config.hardware
    params = model.num_moe_layers * (model.num_experts // ep_size) * model.expert_params()
    gpn = config.topology.gpus_per_node if gpus_per_node is None else gpus_per_node
    # peers sit ep_size ranks apart: on other nodes unless several groups share one node
    gbps = hw.nvlink_gbps if ep_size * (n - 1) < gpn else hw.inter_node_gbps
    return (n - 1) / n * params * GRAD_SYNC_BYTES_PER_PARAM / (gbps * 1e9)


@dataclass(frozen=True)
class LayoutRow:
    """One (EP size, system) of a layout comparison; times are seconds per measured step."""

    ep_size: int
    groups: int
    system: str
    step_s: float
    slowest_group_s: float
    grad_sync_s: float
    tokens_per_gpu_s: float
    static_imbalance: float


def compare_layouts(workload: Workload, config: SimConfig, ep_sizes: tuple[int, ...],
                    progress: Callable[[str], None] | None = None,
                    refused: dict[int, str] | None = None,
                    cluster: Topology | Cluster | None = None) -> list[LayoutRow]:
    """Every system of ``config`` at every EP size (see the module docstring).

    Args:
        workload: the whole cluster's trace, ``[X, M, L, S, E]`` loads with ``S = W`` ranks.
        config: model, hardware, systems, options; its topology gives the replica slots (and
            the cluster when ``cluster`` is None).
        ep_sizes: from :func:`parse_ep_sizes`.
        progress: called with a line before each group is simulated.
        refused: EP sizes whose plans do not fit the GPUs (``config.memory_check``) are left
            out of the rows and written here with the memory model's reason.
        cluster: the cluster (nodes x GPUs per node, ``W`` GPUs); None: ``config.topology``,
            which can only be the cluster when ``W`` divides the experts.
    Returns:
        One :class:`LayoutRow` per (EP size that fits, system), EP sizes ascending.
    """
    cluster = config.topology if cluster is None else cluster
    W, gpn = cluster.num_gpus, cluster.gpus_per_node
    E, R = config.model.num_experts, config.topology.replica_slots
    if workload.loads_XMLSE.shape[3] != W:
        raise ValueError(f"--compare-ep: the trace has {workload.loads_XMLSE.shape[3]} ranks but the cluster "
                         f"{cluster.num_nodes} x {gpn} has {W} GPUs; make the trace for the whole cluster")
    tokens_per_step = float(workload.tokens_XMS[config.warmup_steps:].sum()) / (
        workload.num_steps - config.warmup_steps)
    rows = []
    for g in ep_sizes:
        group_topo = Topology(max(1, g // gpn), min(g, gpn), E, R)
        group_cfg = dataclasses.replace(config, topology=group_topo, memory_world=W)  # dense DP: all W GPUs
        per_group = []  # per group: {system: [step seconds per measured step]}
        groups = split_workload(workload, g)
        for i, wl in enumerate(groups):  # a plain run takes empty ranks; an EP group of them has no step
            if not bool(wl.tokens_XMS[config.warmup_steps:].any()):
                raise ValueError(f"--compare-ep {g}: EP group {i + 1} of {len(groups)} (ranks {i * g}-{i * g + g - 1}) "
                                 f"holds no tokens in the measured steps ({workload.source} is too small to fill "
                                 f"every group of {g}); drop {g} from --compare-ep, or use more samples")
        try:
            for i, wl in enumerate(groups):
                if progress is not None:
                    progress(f"EP {g}: group {i + 1} of {len(groups)}")
                res = simulate(wl, group_cfg)
                per_group.append({name: [float(c.step_s) for c in r.costs] for name, r in res.systems.items()})
        except ValueError as exc:  # the memory model refuses a plan: this layout does not fit
            if refused is None or "GB per GPU" not in str(exc):
                raise
            refused[g] = str(exc)
            continue
        sync = expert_grad_sync_s(config, g, W, gpn)
        imb = static_imbalance(workload.loads_XMLSE[config.warmup_steps:], g)
        for name in per_group[0]:
            steps = torch.tensor([grp[name] for grp in per_group], dtype=torch.float64)  # [groups, X]
            slowest = float(steps.max(0).values.mean())
            step = slowest + sync
            rows.append(LayoutRow(g, len(groups), name, step, slowest, sync,
                                  tokens_per_step / (W * step), imb))
    return rows




def headline(rows: list[LayoutRow]) -> dict:
    """Where to compare: the EP size at which the fastest *baseline* (any system but static,
    relibra and reference rows) has the most tokens per GPU-second, relibra there, and
    relibra at its own best EP size."""
    base = [r for r in rows if r.system not in ("static", "relibra", *REFERENCES)]
    if not base:
        return {}
    best = max(base, key=lambda r: (r.tokens_per_gpu_s, -r.ep_size))
    out = {"baseline": best.system, "baseline_ep": best.ep_size, "baseline_tokens_per_gpu_s": best.tokens_per_gpu_s}
    mine = [r for r in rows if r.system == "relibra"]
    if mine:
        there = next(r for r in mine if r.ep_size == best.ep_size)
        own = max(mine, key=lambda r: (r.tokens_per_gpu_s, -r.ep_size))
        out.update({"relibra_at_baseline_ep": there.tokens_per_gpu_s / best.tokens_per_gpu_s,
                    "relibra_best_ep": own.ep_size,
                    "relibra_best_vs_baseline": own.tokens_per_gpu_s / best.tokens_per_gpu_s})
    return out


def layouts_json(rows: list[LayoutRow]) -> dict:
    """``{"layouts": [row dicts], "headline": headline(rows)}``."""
    return {"layouts": [dataclasses.asdict(r) for r in rows], "headline": headline(rows)}


def print_layouts(rows: list[LayoutRow], console) -> None:
    """A rich table (EP size x system) and the headline line."""
    from rich import box
    from rich.table import Table

    table = Table(title="EP layouts (same tokens per GPU)", title_justify="left", box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True, padding=(0, 1), show_edge=False)
    for i, col in enumerate(("EP", "groups", "static imb", "system", "step", "grad sync", "tok/GPU-s",
                             "vs static")):
        table.add_column(col, justify="left" if col == "system" else "right", no_wrap=True)
    static = {r.ep_size: r.step_s for r in rows if r.system == "static"}
    for r in rows:
        table.add_row(str(r.ep_size), str(r.groups), f"{r.static_imbalance:.2f}", r.system, format_seconds(r.step_s),
                      format_seconds(r.grad_sync_s), f"{r.tokens_per_gpu_s:,.0f}", f"{static[r.ep_size] / r.step_s:.3f}x")
    console.print(table)
    h = headline(rows)
    if h:
        line = (f"fastest baseline: {h['baseline']} at EP {h['baseline_ep']} "
                f"({h['baseline_tokens_per_gpu_s']:,.0f} tokens per GPU-second)")
        if "relibra_best_ep" in h:
            line += (f"; relibra there: {h['relibra_at_baseline_ep']:.3f}x its throughput; relibra's best "
                     f"layout EP {h['relibra_best_ep']}: {h['relibra_best_vs_baseline']:.3f}x")
        console.print(line, highlight=False)
    console.print("step = slowest EP group + expert gradient sync over the groups (fp32 reduce-scatter + "
                  "bf16 all-gather, not overlapped); dense gradient sync is the same for every row and left out",
                  highlight=False)


def run_compare(args, s: dict, workload, config) -> int:
    """``--compare-ep``: every system at every EP size (relibra_torch.sim.layouts)."""
    from rich.console import Console

    from .report import write_json

    cluster, sizes, R = s["cluster"], s["ep_sizes"], s["topology"].replica_slots  # checked by cluster_layout
    if s["plot"]:
        raise ValueError("--plot does not apply to --compare-ep (use --json)")
    err = Console(stderr=True)
    for text in s["memory_warnings"]:  # only under --ignore-memory: otherwise refused before
        err.print(f"relibra simulate: warning (--ignore-memory): {text}", highlight=False, soft_wrap=True)
    refused: dict[int, str] = {}
    rows = compare_layouts(workload, config, sizes, refused=refused, cluster=cluster,
                           progress=None if args.no_progress else lambda line: err.print(line, highlight=False))
    if not rows:  # an empty table with exit 0 would read as success
        raise ValueError("--compare-ep: no EP size fits in memory: " + "; ".join(
            f"EP {g}: {why.split('; fix: ')[0]}" for g, why in refused.items())
            + "; allowed: an EP size that fits (a larger one spreads the experts), or --ignore-memory for a what-if run")
    out = Console() if Console().is_terminal else Console(width=200)
    cfg = s["model_spec"]
    out.print(f"{cfg.name} on {cluster.num_nodes} x {cluster.gpus_per_node} {s['hardware_spec'].name} "
              f"(R={R}), {s['dispatch']} dispatch, {workload.num_micro_batches} micro-batches, "
              f"source: {workload.source}", highlight=False)
    print_layouts(rows, out)
    for g, why in refused.items():
        out.print(f"EP {g}: does not fit, left out ({why.split('; ')[0]})", highlight=False)
    if s["json"]:
        write_json({"config": {"model": cfg.name, "nodes": cluster.num_nodes, "gpus_per_node": cluster.gpus_per_node,
                               "replica_slots": R, "dispatch": s["dispatch"],
                               "source": workload.source}, **layouts_json(rows),
                    "refused": {str(g): why for g, why in refused.items()}}, s["json"])
        out.print(f"wrote {s['json']}")
    return 0
