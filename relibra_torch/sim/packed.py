"""Workloads whose samples are (re)packed per step: ``relibra simulate --packing`` / ``--trace``.

Legend: X steps, M micro-batches, L MoE layers, S ranks, E experts, N samples.

One packing per step, computed once from the step's samples and shared by every system
(ideal included), so the systems stay comparable. ``fixed`` is the source's own rule (the
trace family's sequential packing, or :func:`relibra_torch.replay.batch_samples` for a
replay file); ``length`` and ``routepack`` come from
:func:`relibra_torch.planning.packing.plan_packing`, priced by :func:`packing_costs`.
"""

from __future__ import annotations

import torch

from ..planning.packing import PACKING_METHODS, PackingConfig, PackingCosts, per_sample_counts, plan_packing
from ..planning.topology import Topology
from .cost import CostModel
from .presets import ModelSpec
from .trace_families import TRACE_FAMILIES, SampleStep, family_config, generate_sample_trace, packed_loads
from .workload import DEFAULT_SAMPLE_TOKENS, Workload, workload_from_loads

__all__ = ["packing_costs", "sample_workload", "replay_packing_workload"]


def packing_costs(cost: CostModel) -> PackingCosts:
    """The cost model's terms as :class:`PackingCosts` (forward + backward seconds).

    Same FLOP counts as ``CostModel.dense_flops`` / ``dense_s`` (attention projections,
    router, shared experts, dense FFN, LM head, causal pairs) and the planner weights of
    ``CostModel.reorder_weights``.
    """
    m = cost.model
    rate = cost.dense_flops_per_s / 3.0  # backward is twice forward
    attn_tok = 2.0 * m.attention_projection_params()
    w = cost.reorder_weights()
    return PackingCosts(
        num_moe_layers=m.num_moe_layers,
        moe_layer_s_per_token=(attn_tok + 2.0 * m.hidden_size * m.num_experts
                               + 6.0 * m.hidden_size * m.shared_ffn * m.num_shared_experts) / rate,
        s_per_attention_pair=2.0 * (m.attention_qk_dim() + m.attention_v_dim()) / rate,
        num_dense_layers=m.num_dense_layers,
        dense_layer_s_per_token=(attn_tok + 6.0 * m.hidden_size * m.dense_ffn) / rate,
        head_s_per_token=2.0 * m.hidden_size * m.vocab_size / rate,
        compute_s_per_token=w.compute_s_per_token,
        cross_node_s_per_token=w.cross_node_s_per_token,
        intra_node_s_per_token=w.intra_node_s_per_token,
    )


def _pack_steps(steps: list[SampleStep], method: str, topology: Topology, M: int, cap: int,
                cost: CostModel, seed: int):
    """Loads, tokens, pairs of every step under ``method``, and per-step packing notes."""
    S = topology.num_gpus
    costs = packing_costs(cost)
    loads, tokens, pairs, objectives = [], [], [], []
    for x, st in enumerate(steps):
        cfg = PackingConfig(S, M, cap, gpus_per_node=topology.gpus_per_node,
                            method=method, seed=seed + x)
        plan = plan_packing(st.lengths_N, st.counts_NLE, cfg, costs, initial=(st.rank_N, st.micro_batch_N))
        objectives.append({"objective_s": plan.objective_s, **{f"{k}_start_s": v for k, v in
                                                               plan.start_objectives_s.items()}})
        l, t, p = packed_loads(st, plan.rank_N, plan.micro_batch_N, M, S)
        loads.append(l)
        tokens.append(t)
        pairs.append(p)
    return torch.stack(loads), torch.stack(tokens), torch.stack(pairs), objectives


def sample_workload(model: ModelSpec, topology: Topology, cost: CostModel, num_micro_batches: int,
                    tokens_per_rank: int, steps: int, seed: int, trace: str = "long-tail",
                    packing: str = "fixed", sample_tokens: int = DEFAULT_SAMPLE_TOKENS,
                    skew: float = 1.0) -> Workload:
    """A trace family's samples (``--trace``), packed per step by ``packing``; ``skew`` is
    ``TraceConfig.skew`` (1: as calibrated).

    ``fixed`` keeps the family's sequential packing (for ``default`` that is the rule of
    :func:`relibra_torch.sim.traces.generate_load_trace`, with per-sample count draws; the
    bit-identical default trace is :func:`relibra_torch.sim.workload.synthetic_workload`).
    The token cap of ``length`` / ``routepack`` is ``tokens_per_rank`` (``--micro-batch-tokens``).
    """
    if packing not in PACKING_METHODS:
        raise ValueError(f"--packing {packing!r}; allowed: {', '.join(PACKING_METHODS)}")
    fam = TRACE_FAMILIES[trace]
    cfg = family_config(trace, num_experts=model.num_experts, top_k=model.top_k,
                        num_layers=model.num_moe_layers, seed=seed, skew=skew)
    S, M = topology.num_gpus, num_micro_batches
    st = generate_sample_trace(cfg, M, S, tokens_per_rank, steps=steps, truncate=fam.truncate)
    cap = max(tokens_per_rank, 1)
    loads, tokens, pairs, objectives = _pack_steps(st, packing, topology, M, cap, cost, seed)
    wl = workload_from_loads(loads, model, topology, sample_tokens,
                             source=f"synthetic RL trace {trace} (seed {seed}), packing {packing}",
                             tokens_XMS=tokens, attn_pairs_XMS=pairs)
    wl.notes["packing"] = _note(packing, cap, objectives)
    return wl


def _note(method: str, cap, objectives: list[dict]) -> str:
    """One line for the report: method, cap and the per-step objective of each start."""
    caps = cap if isinstance(cap, list) else [cap]
    parts = []
    for x, o in enumerate(objectives):
        starts = ", ".join(f"{k.removesuffix('_start_s')} {v:.4g} s" if v is not None else
                           f"{k.removesuffix('_start_s')} infeasible"
                           for k, v in o.items() if k.endswith("_start_s"))
        parts.append(f"step {x}: {o['objective_s']:.4g} s ({starts})")
    return (f"{method}, at most {'/'.join(map(str, sorted(set(caps))))} tokens per micro-batch (a longer "
            f"sample alone); surrogate objective {'; '.join(parts)}")


def replay_packing_workload(path: str, model: ModelSpec, topology: Topology, cost: CostModel,
                            num_micro_batches: int, packing: str, seed: int = 0,
                            sample_tokens: int = DEFAULT_SAMPLE_TOKENS) -> Workload:
    """A routing replay file packed per recorded step by ``length`` or ``routepack``.

    The fixed start is :func:`relibra_torch.replay.batch_samples` (what ``--packing fixed``
    simulates); the token cap is that rule's largest micro-batch of the step, so a packing
    never puts more tokens in a micro-batch than the fixed rule did.
    """
    from .. import replay
    from .workload import workload_from_file
    base = workload_from_file(path, model, topology, num_micro_batches, sample_tokens)  # checks the file
    rr = replay.load_routing(path)
    if rr.sample_step is not None:
        groups = [(rr.sample_step == s).nonzero().flatten() for s in torch.unique(rr.sample_step).tolist()]
    else:
        groups = [torch.arange(rr.num_samples)]
    S, M = topology.num_gpus, num_micro_batches
    steps, caps = [], []
    for ids in groups:
        part = rr.select(ids) if len(groups) > 1 else rr
        assign = replay.batch_samples(part.sample_lengths, S, num_micro_batches=M)
        steps.append(SampleStep(part.sample_lengths.to(torch.int64), torch.zeros(part.num_samples, dtype=torch.int64),
                                per_sample_counts(part.routed_experts_TLK, part.sample_lengths, part.num_experts), assign.rank_N, assign.micro_batch_N))
        caps.append(int(base.tokens_XMS[len(caps)].max()))
    out = []
    for x, st in enumerate(steps):
        out.append(_pack_steps([st], packing, topology, M, caps[x], cost, seed + x))
    loads = torch.cat([o[0] for o in out])
    wl = workload_from_loads(loads, model, topology, sample_tokens,
                             source=f"{base.source}, packing {packing}",
                             tokens_XMS=torch.cat([o[1] for o in out]), attn_pairs_XMS=torch.cat([o[2] for o in out]))
    wl.notes["packing"] = _note(packing, caps, [o[3][0] for o in out])
    return wl


