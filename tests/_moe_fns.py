"""ReplayBalancedMoE rank functions: what each gloo rank runs in the distributed tests.

Functions run on gloo ranks (spawned processes import this module) are module-level.
Results cross the process boundary as numpy arrays. Cases and references live in
``_moe_cases`` and ``_moe_refs``; their names are re-exported here so that tests use one
namespace (``fns.Case``, ``fns.check_case``, ...).

Legend: T tokens, D dim, E experts, K top-k, S source ranks, G GPUs, J slots per GPU,
M micro-batches, L layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from relibra_torch.moe import LayerPlan, ReplayBalancedMoE, layer_plans
from relibra_torch.planning import Topology, static_plan

from _moe_cases import *  # noqa: F401,F403 - one namespace for the tests
from _moe_cases import (DIM, HIDDEN, Case, build, case_mesh, get_mesh, inputs, loads_of, logical_state, make_routing,
                        planner_plan, with_plan)
from _moe_refs import *  # noqa: F401,F403

def run_case(case: Case) -> dict:
    """Rank side of a numerics case: forward + backward of this rank's tokens."""
    torch.manual_seed(1234 + dist.get_rank())  # different per rank: init must not matter
    r = dist.get_rank()
    m = build(case, case_mesh(case))
    if case.placement_E is not None and case.place_before_load:
        m.apply_placement(case.placement_E)
    m.load_state_dict(logical_state(case))
    if case.placement_E is not None and not case.place_before_load:
        m.apply_placement(case.placement_E)
    if case.native_install:
        from relibra_torch.moe.native import NATIVE
        m.set_plan(case.plan, NATIVE)
    else:
        m.set_plan(case.plan)
    xs, gs = inputs(case)
    x = xs[r].clone().requires_grad_()
    out = m(x, None if case.self_route else case.ids_per_rank[r])
    out.backward(gs[r])
    res = {"out": out.detach().numpy(), "x_grad": x.grad.numpy(), "gate_grad": m.gate.weight.grad.numpy(),
           "native": m.native_experts().numpy(), "expert_tokens": m.last_expert_tokens,
           "slot_tokens": m.last_slot_tokens_J.numpy(), "fills": m.last_fills,
           "replica_live": m.replica_memory.live_bytes, "replica_peak": m.replica_memory.peak_bytes,
           "exchange": None if m.engine.last_exchange is None else m.engine.last_exchange.as_dict()}
    for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
        res[n] = m.get_parameter(n).grad.to_local().numpy()
    if case.shared:
        res["shared_grad"] = m.shared_experts.w1.weight.grad.numpy()
    return res


def ping() -> int:
    return dist.get_rank()


def _full(v):
    from torch.distributed.tensor import DTensor
    return v.full_tensor() if isinstance(v, DTensor) else v


def run_stack(cases: list[Case]) -> dict:
    """Two (or more) layers with residuals, one plan each: backward collectives of several
    layers interleave. Returns this rank's output and input gradient."""
    r = dist.get_rank()
    mods = []
    for case in cases:
        m = build(case, case_mesh(case))
        if case.placement_E is not None:
            m.apply_placement(case.placement_E)
        m.load_state_dict(logical_state(case))
        m.set_plan(case.plan)
        mods.append(m)
    xs, gs = inputs(cases[0])
    x = xs[r].clone().requires_grad_()
    h = x
    for m, case in zip(mods, cases):
        h = h + m(h, case.ids_per_rank[r])
    h.backward(gs[r])
    res = {"out": h.detach().numpy(), "x_grad": x.grad.numpy(),
           "gate_grad": [m.gate.weight.grad.numpy() for m in mods],
           "native": [m.native_experts().numpy() for m in mods]}
    for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
        res[n] = [m.get_parameter(n).grad.to_local().numpy() for m in mods]
    return res


def run_balance(case: Case, plans: list[LayerPlan], ids_m: list[list[torch.Tensor]]) -> list[int]:
    """Run every micro-batch's plan; return the executed expert tokens of this rank per micro-batch."""
    r = dist.get_rank()
    m = build(case, case_mesh(case))
    m.apply_placement(case.placement_E)
    m.load_state_dict(logical_state(case))
    out = []
    gen = torch.Generator().manual_seed(case.seed)
    for plan, ids in zip(plans, ids_m):
        m.set_plan(plan)
        x = torch.randn(ids[r].shape[0], DIM, generator=gen)
        m(x, ids[r])
        out.append((m.last_expert_tokens, int(m.last_slot_tokens_J.sum())))
    return out


def run_training(case: Case, placements: list, lr: float = 1e-2) -> dict:
    """AdamW steps on this rank's tokens; after step ``i``, ``apply_placement(placements[i])``
    moves the experts and their optimizer state. Replicated grads are summed over ranks
    (as data parallelism would). Returns logical weights and logical Adam state."""
    r = dist.get_rank()
    m = build(case, case_mesh(case))
    m.load_state_dict(logical_state(case))
    opt = torch.optim.AdamW(m.parameters(), lr=lr, foreach=False)
    xs, gs = inputs(case)
    for pl in placements:
        opt.zero_grad()
        m.set_plan(None)
        m(xs[r], case.ids_per_rank[r]).backward(gs[r])
        for p in m.parameters():
            if not hasattr(p, "to_local"):
                dist.all_reduce(p.grad)
        opt.step()
        if pl is not None:
            m.apply_placement(pl, opt)
    res = {k: _full(v).numpy() for k, v in m.state_dict().items()}
    native = m.native_experts()
    for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
        for key in ("exp_avg", "exp_avg_sq"):
            local = opt.state[m.get_parameter(n)][key].to_local()
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, local.contiguous())
            nat = [torch.empty_like(native) for _ in range(dist.get_world_size())]
            dist.all_gather(nat, native)
            logical = torch.empty(case.num_experts, *local.shape[1:])
            logical[torch.cat(nat)] = torch.cat(parts)
            res[f"{n}.{key}"] = logical.numpy()
    return res


def run_checkpoint(case: Case, placement_a: torch.Tensor, placement_b: torch.Tensor, path: str) -> dict:
    """State dicts across placements on one mesh, DTensor reload, safetensors export/import."""
    from relibra_torch.moe import load_expert_safetensors, save_expert_safetensors
    r = dist.get_rank()
    mesh = case_mesh(case)
    a = build(case, mesh)
    a.apply_placement(placement_a)
    a.load_state_dict(logical_state(case))
    sd_a = a.state_dict()
    b = build(case, mesh)
    b.apply_placement(placement_b)
    b.load_state_dict(sd_a)  # logical DTensors on the same mesh: moved by all-to-all
    sd_b = b.state_dict()
    xs, _ = inputs(case)
    out_a = a(xs[r], case.ids_per_rank[r]).detach()
    out_b = b(xs[r], case.ids_per_rank[r]).detach()
    save_expert_safetensors(a, path)
    dist.barrier()
    c = build(case, mesh)
    c.apply_placement(placement_b.flip(0))
    load_expert_safetensors(c, path)
    return {"sd_a": {k: _full(v).numpy() for k, v in sd_a.items()},
            "sd_b": {k: _full(v).numpy() for k, v in sd_b.items()},
            "logical_c": {k: v.numpy() for k, v in c.logical_expert_weights().items()},
            "out_a": out_a.numpy(), "out_b": out_b.numpy(),
            "dtensor": type(sd_a["w1_EFD"]).__name__}


def run_errors(num_nodes: int, gpus_per_node: int) -> dict:
    """Bad input on ranks: every rank raises ValueError with a message (never a hang)."""
    r = dist.get_rank()
    mesh = get_mesh(num_nodes, gpus_per_node)
    msgs = {}
    try:
        ReplayBalancedMoE(DIM, HIDDEN, 6, 2, mesh=mesh)
    except ValueError as e:
        msgs["divide"] = str(e)
    m = ReplayBalancedMoE(DIM, HIDDEN, 8, 2, mesh=mesh, replica_slots=1, on_mismatch="raise")
    flat = Topology(1, num_nodes * gpus_per_node, 8, 1)
    G = num_nodes * gpus_per_node
    ids = [torch.randint(0, 8, (3, 2), generator=torch.Generator().manual_seed(s)) for s in range(G)]
    loads = loads_of(ids, 8)
    try:
        m.set_plan(layer_plans(static_plan(loads, flat), loads, 0)[0])
    except ValueError as e:
        msgs["topology"] = str(e)
    m.set_plan(layer_plans(static_plan(loads, m.topology), loads, 0)[0])
    mine = ids[r] if r != 1 else (ids[r] + 1) % 8  # only rank 1 replays other ids
    try:
        m(torch.randn(3, DIM), mine)
    except ValueError as e:
        msgs["mismatch"] = str(e)
    try:
        m(torch.randn(3, DIM), torch.full((3, 2), 9))
    except ValueError as e:
        msgs["range"] = str(e)
    # The layer still works after the errors (no collective was left half done).
    out = m(torch.randn(3, DIM), ids[r])
    msgs["after"] = tuple(out.shape)
    return msgs


def run_degraded(case: Case, planned_ids: list[torch.Tensor]) -> dict:
    """Plan a step with ReplayBalancer from ``planned_ids``, then run ``case.ids_per_rank``
    (which disagree with the plan on some rank): the run degrades on every rank. Returns
    run_case's results plus the warnings and the balancer's degraded micro-batches."""
    import warnings

    import relibra_torch.moe.plan_check as check_mod
    from relibra_torch.hook import ReplayBalancer

    torch.manual_seed(1234)
    r = dist.get_rank()
    m = build(case, case_mesh(case))
    m.load_state_dict(logical_state(case))
    balancer = ReplayBalancer(m, planner="relibra")
    balancer.plan_step([planned_ids[r].unsqueeze(1)])
    balancer.install(0)
    check_mod._MISMATCH_WARNED = False
    xs, gs = inputs(case)
    x = xs[r].clone().requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = m(x, case.ids_per_rank[r])
    out.backward(gs[r])
    res = {"out": out.detach().numpy(), "x_grad": x.grad.numpy(), "gate_grad": m.gate.weight.grad.numpy(),
           "native": m.native_experts().numpy(), "fills": m.last_fills,
           "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
           "degraded": sorted(balancer.report.degraded_micro_batches)}
    for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
        res[n] = m.get_parameter(n).grad.to_local().numpy()
    if case.shared:
        res["shared_grad"] = m.shared_experts.w1.weight.grad.numpy()
    return res


def run_compiled_ep() -> dict:
    """One node of 2 ranks with replicas: aot_eager-compiled layer vs eager (same rank)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    r, G = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(5)
    ids = make_routing("one", [9, 3], 4, 2, gen)  # expert 0 hot: relibra replicates it
    case = Case(1, G, 4, 2, 1, 9, ids, shared=True)
    case = with_plan(case, planner_plan("relibra", case.topology(), loads_of(ids, 4), gen))
    m = build(case, case_mesh(case))
    m.apply_placement(case.placement_E)
    m.load_state_dict(logical_state(case))
    m.set_plan(case.plan)
    xs, gs = inputs(case)

    def run(fn):
        m.zero_grad()
        x = xs[r].clone().requires_grad_()
        out = fn(x, ids[r])
        out.backward(gs[r])
        return [out.detach().numpy(), x.grad.numpy(), m.gate.weight.grad.numpy().copy(),
                m.w1_EFD.grad.to_local().numpy().copy()]

    eager = run(m)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = run(torch.compile(m, backend=counter))
    names = ["out", "x grad", "router grad", "w1 grad"]
    return {"pairs": {n: (a, b) for n, a, b in zip(names, compiled, eager)},
            "graphs": counter.frame_count, "fills": m.last_fills}


def run_memory(cases: list[Case]) -> dict:
    """A stack of layers sharing one ReplicaMemory: peak replica bytes over forward+backward,
    bytes alive at the end of forward, and every layer's fill count on this rank."""
    from relibra_torch.moe import share_replica_memory
    r = dist.get_rank()
    model = torch.nn.ModuleList()
    for case in cases:
        m = build(case, case_mesh(case))
        m.apply_placement(case.placement_E)
        m.load_state_dict(logical_state(case))
        m.set_plan(case.plan)
        model.append(m)
    mem = share_replica_memory(model)
    xs, gs = inputs(cases[0])
    h = xs[r].clone().requires_grad_()
    for m, case in zip(model, cases):
        h = h + m(h, case.ids_per_rank[r])
    after_forward = mem.live_bytes
    h.backward(gs[r])
    return {"peak": mem.peak_bytes, "after_forward": after_forward, "live": mem.live_bytes,
            "fills": [len(m.last_fills) for m in model]}


def run_reshard(case: Case, placement_a: torch.Tensor, placement_b: torch.Tensor) -> dict:
    """Save on a flat 1 x G mesh (logical DTensors), load into the case's 2-D mesh layout."""
    G = dist.get_world_size()
    a = build(case, get_mesh(1, G, True))
    a.apply_placement(placement_a)
    a.load_state_dict(logical_state(case))
    sd = a.state_dict()
    b = build(case, case_mesh(case))
    b.apply_placement(placement_b)
    b.load_state_dict(sd)  # DTensors of another mesh: gathered, then this rank's rows taken
    return {k: v.numpy() for k, v in b.logical_expert_weights().items()}


def run_dispatch_modes(case: Case) -> dict:
    """:func:`run_case` under flat and under hierarchical dispatch, on the same rank."""
    import dataclasses
    return {mode: run_case(dataclasses.replace(case, module_kwargs={**case.module_kwargs, "dispatch": mode}))
            for mode in ("flat", "hierarchical")}


def check_dispatch_modes(case: Case, results: list[dict]) -> None:
    """Hierarchical against one process and against flat (fp32, 1e-5), outputs and every
    gradient; both modes compute the same pairs per slot."""
    hier = [res["hierarchical"] for res in results]
    flat = [res["flat"] for res in results]
    check_case(case, hier)
    for r, (h, f) in enumerate(zip(hier, flat)):
        for key in ("out", "x_grad", "gate_grad", "w1_EFD", "w2_EDF", "w3_EFD"):
            close(h[key], f[key], f"rank {r} {key}: hierarchical vs flat")
        assert (h["slot_tokens"] == f["slot_tokens"]).all() and h["fills"] == f["fills"]
