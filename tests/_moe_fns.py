"""Helpers for the ReplayBalancedMoE tests: case generation, reference runs, rank functions.

Functions run on gloo ranks (spawned processes import this module) are module-level.
Results cross the process boundary as numpy arrays.

Legend: T tokens, D dim, E experts, K top-k, S source ranks, G GPUs, J slots per GPU,
M micro-batches, L layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from relibra_torch.moe import LayerPlan, ReplayBalancedMoE, layer_plans
from relibra_torch.planning import StepPlan, Topology, make_planner, static_plan, validate_plan

DIM, HIDDEN = 16, 8


@dataclass
class Case:
    """One numerics case: everything both the ranks and the reference need."""

    num_nodes: int
    gpus_per_node: int
    num_experts: int
    top_k: int
    replica_slots: int
    seed: int
    ids_per_rank: list  # S tensors int64 [T_s, K]
    plan: LayerPlan | None = None
    placement_E: torch.Tensor | None = None  # applied before the forward
    place_before_load: bool = True
    refetch: bool = False
    shared: bool = False
    score_func: str = "softmax"
    route_norm: bool = False
    route_scale: float = 1.0
    expert_bias: bool = False
    flat_mesh: bool = False
    self_route: bool = False  # route with the layer's own router (ids_per_rank only give T)
    module_kwargs: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def topology(self) -> Topology:
        return Topology(self.num_nodes, self.gpus_per_node, self.num_experts, self.replica_slots)


# ---------------------------------------------------------------------------- routing

def make_routing(mode: str, tokens: list[int], num_experts: int, top_k: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Per-rank ``[T_s, K]`` expert ids (distinct per token) for a routing ``mode``.

    Modes: ``random`` (uniform), ``skewed`` (Zipf-like, a few hot experts), ``one`` (every
    token's first choice is expert 0: all tokens on one expert), ``sparse`` (only a third of
    the experts used: many empty experts).
    """
    out = []
    E, K = num_experts, top_k
    if mode == "skewed":
        w = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.5
        w = w[torch.randperm(E, generator=gen)]
    elif mode == "sparse":
        w = torch.zeros(E, dtype=torch.float64)
        w[torch.randperm(E, generator=gen)[: max(K, E // 3)]] = 1.0
    else:
        w = torch.ones(E, dtype=torch.float64)
    for T in tokens:
        if T == 0:
            out.append(torch.zeros(0, K, dtype=torch.int64))
            continue
        ids = torch.stack([torch.multinomial(w, K, replacement=False, generator=gen) for _ in range(T)])
        if mode == "one":
            # Expert 0 first for every token, the others random but distinct from 0.
            rest = torch.stack([torch.randperm(E - 1, generator=gen)[: K - 1] + 1 for _ in range(T)])
            ids = torch.cat([torch.zeros(T, 1, dtype=torch.int64), rest], 1)
        out.append(ids)
    return out


def loads_of(ids_per_rank: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """int64 ``[1, 1, S, E]`` counts of per-rank ids."""
    return torch.stack([torch.bincount(i.reshape(-1), minlength=num_experts) for i in ids_per_rank]).view(
        1, 1, len(ids_per_rank), num_experts)


# ---------------------------------------------------------------------------- plans

def random_plan(topology: Topology, loads_MLSE: torch.Tensor, gen: torch.Generator, mode: str) -> StepPlan:
    """A random valid one-layer plan.

    Modes: ``native`` (random placement, no replicas), ``intra`` (replica slots filled with
    experts of the same node, relibra's rule), ``general`` (any expert in any slot, across
    nodes, and native slots overridden too). Quotas: a random composition of every expert's
    load over its instances.
    """
    M, L, S, E = loads_MLSE.shape
    assert M == 1 and L == 1
    G, J, El, g = topology.num_gpus, topology.slots_per_gpu, topology.experts_per_gpu, topology.gpus_per_node
    placement = torch.randperm(E, generator=gen)
    native = torch.empty(E, dtype=torch.int64)
    native[placement] = torch.arange(E)
    owner = placement // El
    se = torch.full((G, J), -1, dtype=torch.int64)
    se[:, :El] = native.view(G, El)
    if mode != "native":
        for gpu in range(G):
            node = gpu // g
            for j in range(El, J):
                if torch.rand(1, generator=gen).item() < 0.25:
                    continue  # leave some replica slots empty
                if mode == "intra":
                    pool = [e for e in range(E) if owner[e] // g == node and owner[e] != gpu]
                else:
                    pool = list(range(E))
                pool = [e for e in pool if e not in se[gpu].tolist()]
                if pool:
                    se[gpu, j] = pool[int(torch.randint(len(pool), (1,), generator=gen))]
        if mode == "general":
            # Override a native slot when its expert keeps an instance elsewhere.
            for gpu in range(G):
                if torch.rand(1, generator=gen).item() < 0.5:
                    continue
                j = int(torch.randint(El, (1,), generator=gen))
                e0 = int(se[gpu, j])
                if (se == e0).sum() < 2:
                    continue
                pool = [e for e in range(E) if e not in se[gpu].tolist()]
                if pool:
                    se[gpu, j] = pool[int(torch.randint(len(pool), (1,), generator=gen))]
    quota = torch.zeros(G, J, dtype=torch.int64)
    load_E = loads_MLSE[0, 0].sum(0)
    for e in range(E):
        inst = (se == e).nonzero().tolist()
        if not inst:
            raise AssertionError("every expert keeps an instance")
        n = int(load_E[e])
        cuts = sorted(torch.randint(n + 1, (len(inst) - 1,), generator=gen).tolist()) if n else [0] * (len(inst) - 1)
        bounds = [0] + cuts + [n]
        for (gpu, j), a, b in zip(inst, bounds[:-1], bounds[1:]):
            quota[gpu, j] = b - a
    plan = StepPlan(topology, placement.view(1, E), se.view(1, 1, G, J), quota.view(1, 1, G, J), f"random-{mode}")
    validate_plan(plan, loads_MLSE, intra_node_replicas=(mode in ("native", "intra")))
    return plan


def planner_plan(name: str, topology: Topology, loads_MLSE: torch.Tensor, gen: torch.Generator) -> StepPlan:
    """A plan from a project planner (``static``, ``eplb``, ``eplb-oracle``, ``relibra``) or a
    random one (``random-native``, ``random-intra``, ``random-general``)."""
    if name.startswith("random-"):
        return random_plan(topology, loads_MLSE, gen, name.split("-", 1)[1])
    if name == "static":
        return static_plan(loads_MLSE, topology)
    planner = make_planner(name, topology)
    if name == "eplb":
        # History-based: feed it a different past step so its plan does not fit exactly.
        past = loads_MLSE.flip(-1)
        planner.commit(planner.plan(past), past)
    plan = planner.plan(loads_MLSE)
    validate_plan(plan, loads_MLSE)
    return plan


# ---------------------------------------------------------------------------- weights

def logical_state(case: Case) -> dict[str, torch.Tensor]:
    """Deterministic logical weights of a case (scaled so outputs are O(1))."""
    gen = torch.Generator().manual_seed(case.seed)
    E = case.num_experts
    sd = {
        "gate.weight": torch.randn(E, DIM, generator=gen),
        "w1_EFD": torch.randn(E, HIDDEN, DIM, generator=gen) / DIM ** 0.5,
        "w2_EDF": torch.randn(E, DIM, HIDDEN, generator=gen) / HIDDEN ** 0.5,
        "w3_EFD": torch.randn(E, HIDDEN, DIM, generator=gen) / DIM ** 0.5,
    }
    if case.shared:
        for n, shape in (("w1", (HIDDEN, DIM)), ("w2", (DIM, HIDDEN)), ("w3", (HIDDEN, DIM))):
            sd[f"shared_experts.{n}.weight"] = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
    if case.expert_bias:
        sd["expert_bias_E"] = torch.randn(E, generator=gen) * 0.1
    return sd


def inputs(case: Case) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-rank inputs ``[T_s, D]`` and output gradients (random: a stride-0 gradient breaks
    ``torch._grouped_mm``'s backward)."""
    gen = torch.Generator().manual_seed(case.seed + 1)
    xs = [torch.randn(i.shape[0], DIM, generator=gen) for i in case.ids_per_rank]
    gs = [torch.randn(i.shape[0], DIM, generator=gen) for i in case.ids_per_rank]
    return xs, gs


def build(case: Case, mesh) -> ReplayBalancedMoE:
    return ReplayBalancedMoE(DIM, HIDDEN, case.num_experts, case.top_k, mesh=mesh,
                             replica_slots=case.replica_slots, refetch_replicas=case.refetch,
                             num_shared_experts=1 if case.shared else 0, score_func=case.score_func,
                             route_norm=case.route_norm, route_scale=case.route_scale,
                             expert_bias=case.expert_bias, **case.module_kwargs)


def reference(case: Case) -> dict[str, np.ndarray]:
    """The same layer on one process over all ranks' tokens: outputs and gradients."""
    torch.manual_seed(0)
    m = build(case, None)
    m.load_state_dict(logical_state(case))
    xs, gs = inputs(case)
    x = torch.cat(xs).requires_grad_()
    ids = None if case.self_route else torch.cat(case.ids_per_rank)
    out = m(x, ids)
    out.backward(torch.cat(gs))
    res = {"out": out.detach().numpy(), "x_grad": x.grad.numpy(), "gate_grad": m.gate.weight.grad.numpy()}
    for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
        res[n] = m.get_parameter(n).grad.numpy()
    if case.shared:
        res["shared_grad"] = m.shared_experts.w1.weight.grad.numpy()
    return res


# ---------------------------------------------------------------------------- rank side

_MESHES: dict = {}


def get_mesh(num_nodes: int, gpus_per_node: int, flat: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    key = (num_nodes, gpus_per_node, flat)
    if key not in _MESHES:
        if flat:
            _MESHES[key] = init_device_mesh("cpu", (num_nodes * gpus_per_node,), mesh_dim_names=("ep",))
        else:
            _MESHES[key] = init_device_mesh("cpu", (num_nodes, gpus_per_node), mesh_dim_names=("node", "gpu"))
    return _MESHES[key]


def case_mesh(case: Case):
    if case.flat_mesh:
        assert case.num_nodes == 1
        return get_mesh(1, case.gpus_per_node, True)
    return get_mesh(case.num_nodes, case.gpus_per_node)


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
    m.set_plan(case.plan)
    xs, gs = inputs(case)
    x = xs[r].clone().requires_grad_()
    out = m(x, None if case.self_route else case.ids_per_rank[r])
    out.backward(gs[r])
    res = {"out": out.detach().numpy(), "x_grad": x.grad.numpy(), "gate_grad": m.gate.weight.grad.numpy(),
           "native": m.native_experts().numpy(), "expert_tokens": m.last_expert_tokens,
           "slot_tokens": m.last_slot_tokens_J.numpy(), "fills": m.last_fills,
           "replica_live": m.replica_memory.live_bytes, "replica_peak": m.replica_memory.peak_bytes}
    for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
        res[n] = m.get_parameter(n).grad.to_local().numpy()
    if case.shared:
        res["shared_grad"] = m.shared_experts.w1.weight.grad.numpy()
    return res


def assemble_logical(results: list[dict], name: str, num_experts: int) -> np.ndarray:
    """Logical ``[E, ...]`` from every rank's physical local rows."""
    first = results[0][name]
    out = np.zeros((num_experts, *first.shape[1:]), dtype=first.dtype)
    seen = np.zeros(num_experts, dtype=bool)
    for res in results:
        for i, e in enumerate(res["native"]):
            out[e] = res[name][i]
            seen[e] = True
    assert seen.all()
    return out


def close(a: np.ndarray, b: np.ndarray, what: str, rel: float = 1e-5, floor: float = 1e-6) -> None:
    """fp32 check: max |a - b| <= rel * max |b| + floor.

    Relative to the tensor's scale; the absolute ``floor`` (far below ``rel`` for the O(1)
    tensors of these tests) only matters for tensors that are zero in exact arithmetic
    (e.g. the router gradient with top_k = 1 and route_norm, where the gate is always 1).
    """
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    scale = float(np.abs(b).max()) if b.size else 0.0
    err = float(np.abs(a - b).max()) if b.size else 0.0
    assert err <= rel * scale + floor, f"{what}: max abs error {err:.3g} > {rel:g} x scale {scale:.3g} + {floor:g}"


def check_case(case: Case, results: list[dict]) -> None:
    """Compare rank results with the one-process reference."""
    ref = reference(case)
    start = 0
    for r, res in enumerate(results):
        T = case.ids_per_rank[r].shape[0]
        close(res["out"], ref["out"][start : start + T], f"rank {r} output")
        close(res["x_grad"], ref["x_grad"][start : start + T], f"rank {r} input gradient")
        start += T
    gate_grad = sum(res["gate_grad"] for res in results)
    if case.top_k == 1 and case.route_norm:
        # Gates are always 1: zero in exact arithmetic, rounding noise on both sides.
        assert np.abs(gate_grad).max() <= 1e-5 * np.abs(ref["x_grad"]).max()
    else:
        close(gate_grad, ref["gate_grad"], "router gradient")
    for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
        close(assemble_logical(results, n, case.num_experts), ref[n], f"expert gradient {n}")
    if case.shared:
        close(sum(res["shared_grad"] for res in results), ref["shared_grad"], "shared expert gradient")


def with_plan(case: Case, plan: StepPlan | None) -> Case:
    """The case running ``plan`` (its placement applied, its layer plan installed)."""
    if plan is None:
        return case
    lp = layer_plans(plan, loads_of(case.ids_per_rank, case.num_experts), 0)[0]
    return dataclasses.replace(case, plan=lp, placement_E=plan.placement_LE[0].clone())


def ping() -> int:
    return dist.get_rank()


# ---------------------------------------------------------------------------- naive reference

def naive_moe(sd: dict, x_TD: torch.Tensor, ids_TK: torch.Tensor | None, top_k: int,
              score_func: str = "softmax", route_norm: bool = False, route_scale: float = 1.0) -> torch.Tensor:
    """Token-by-token MoE from a logical state dict: the independent reference."""
    scores = x_TD.float() @ sd["gate.weight"].float().t()
    scores = scores.softmax(-1) if score_func == "softmax" else scores.sigmoid()
    if ids_TK is None:
        choice = scores + sd["expert_bias_E"] if "expert_bias_E" in sd else scores
        ids_TK = choice.topk(top_k, dim=-1).indices
    gates = scores.gather(1, ids_TK)
    if route_norm:
        gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)
    gates = gates * route_scale
    rows = []
    for t in range(x_TD.shape[0]):
        acc = torch.zeros(x_TD.shape[1])
        for k in range(ids_TK.shape[1]):
            e = int(ids_TK[t, k])
            h = torch.nn.functional.silu(sd["w1_EFD"][e] @ x_TD[t]) * (sd["w3_EFD"][e] @ x_TD[t])
            acc = acc + gates[t, k] * (sd["w2_EDF"][e] @ h)
        if "shared_experts.w1.weight" in sd:
            h = (torch.nn.functional.silu(sd["shared_experts.w1.weight"] @ x_TD[t])
                 * (sd["shared_experts.w3.weight"] @ x_TD[t]))
            acc = acc + sd["shared_experts.w2.weight"] @ h
        rows.append(acc)
    return torch.stack(rows) if rows else x_TD.new_zeros(0, x_TD.shape[1])


# ---------------------------------------------------------------------------- more rank functions

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


def reference_stack(cases: list[Case]) -> dict:
    mods = []
    for case in cases:
        m = build(case, None)
        m.load_state_dict(logical_state(case))
        mods.append(m)
    xs, gs = inputs(cases[0])
    x = torch.cat(xs).requires_grad_()
    h = x
    for m, case in zip(mods, cases):
        h = h + m(h, torch.cat(case.ids_per_rank))
    h.backward(torch.cat(gs))
    res = {"out": h.detach().numpy(), "x_grad": x.grad.numpy(),
           "gate_grad": [m.gate.weight.grad.numpy() for m in mods]}
    for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
        res[n] = [m.get_parameter(n).grad.numpy() for m in mods]
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


def reference_training(case: Case, steps: int, lr: float = 1e-2) -> dict:
    m = build(case, None)
    m.load_state_dict(logical_state(case))
    opt = torch.optim.AdamW(m.parameters(), lr=lr, foreach=False)
    xs, gs = inputs(case)
    for _ in range(steps):
        opt.zero_grad()
        m(torch.cat(xs), torch.cat(case.ids_per_rank)).backward(torch.cat(gs))
        opt.step()
    res = {k: v.numpy() for k, v in m.state_dict().items()}
    for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
        for key in ("exp_avg", "exp_avg_sq"):
            res[f"{n}.{key}"] = opt.state[m.get_parameter(n)][key].numpy()
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
    m = ReplayBalancedMoE(DIM, HIDDEN, 8, 2, mesh=mesh, replica_slots=1)
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


# ---------------------------------------------------------------------------- measurement

def bench_replica_modes(layers: int = 4, dim: int = 256, hidden: int = 512, tokens: int = 256,
                        iters: int = 6, seed: int = 0) -> dict:
    """Keep vs re-fetch replicas on the ranks of the calling pool (2 nodes x G/2 GPUs):
    median forward+backward seconds and peak replica bytes per mode. Modes alternate per
    iteration so machine load hits both alike. Not a test; see docs/moe.md."""
    import time
    import statistics
    from relibra_torch.moe import share_replica_memory
    r, G = dist.get_rank(), dist.get_world_size()
    N = 2 if G % 2 == 0 and G > 2 else 1
    gen = torch.Generator().manual_seed(seed)
    E, K = 2 * G, 2
    topo = Topology(N, G // N, E, 2)
    ids_l = [make_routing("skewed", [tokens] * G, E, K, gen) for _ in range(layers)]
    loads = torch.cat([loads_of(ids, E) for ids in ids_l], dim=1)  # [1, L, S, E]
    plan = make_planner("relibra", topo).plan(loads)
    lps = layer_plans(plan, loads, 0)
    mesh = get_mesh(N, G // N)
    models = {}
    for refetch in (False, True):
        mods = torch.nn.ModuleList()
        for l in range(layers):
            m = ReplayBalancedMoE(dim, hidden, E, K, mesh=mesh, replica_slots=2, refetch_replicas=refetch)
            m.apply_placement(plan.placement_LE[l])
            m.set_plan(lps[l])
            mods.append(m)
        models[refetch] = (mods, share_replica_memory(mods))
    x = torch.randn(tokens, dim, generator=gen)
    g = torch.randn(tokens, dim, generator=gen)
    times = {False: [], True: []}
    for it in range(iters + 1):
        for refetch in ((False, True) if it % 2 else (True, False)):
            mods, mem = models[refetch]
            dist.barrier()
            t0 = time.perf_counter()
            h = x.clone().requires_grad_()
            for m, ids in zip(mods, ids_l):
                h = h + m(h, ids[r])
            h.backward(g)
            dist.barrier()
            if it:  # the first round warms up
                times[refetch].append(time.perf_counter() - t0)
    fills = sum(len(m.last_fills) for m in models[False][0])
    return {"keep_s": statistics.median(times[False]), "refetch_s": statistics.median(times[True]),
            "keep_peak": models[False][1].peak_bytes, "refetch_peak": models[True][1].peak_bytes,
            "fills": fills, "fill_bytes": fills * 3 * dim * hidden * 4}


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
