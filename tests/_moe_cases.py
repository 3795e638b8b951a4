"""ReplayBalancedMoE test cases: the Case type, routing and plan generation, model setup.

Imported by the test modules and by spawned gloo ranks (module-level functions only).

Legend: T tokens, D dim, E experts, K top-k, S source ranks, G GPUs, J slots per GPU,
M micro-batches, L layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

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
    native_install: bool = False  # set_plan(plan, NATIVE): the native path, counts exchanged at run time

    @property
    def world(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def topology(self) -> Topology:
        return Topology(self.num_nodes, self.gpus_per_node, self.num_experts, self.replica_slots)


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
    """int64 ``[1, 1, S, E]`` counts of per-rank ids (pads, ``-1``, count nowhere)."""
    return torch.stack([torch.bincount(i.reshape(-1) + 1, minlength=num_experts + 1)[1:]
                        for i in ids_per_rank]).view(1, 1, len(ids_per_rank), num_experts)


def with_pads(ids_per_rank: list[torch.Tensor], gen: torch.Generator, token_p: float = 0.25,
              slot_p: float = 0.2) -> list[torch.Tensor]:
    """Copies of ``ids_per_rank`` with pads: whole tokens (every k ``-1``) with probability
    ``token_p`` and single (token, k) slots with probability ``slot_p``."""
    out = []
    for ids in ids_per_rank:
        ids = ids.clone()
        if ids.numel():
            ids[torch.rand(ids.shape[0], generator=gen) < token_p] = -1
            ids[torch.rand(ids.shape, generator=gen) < slot_p] = -1
        out.append(ids)
    return out


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


# One mesh per layout and process (a rank builds several cases on the same mesh).
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


def with_plan(case: Case, plan: StepPlan | None) -> Case:
    """The case running ``plan`` (its placement applied, its layer plan installed)."""
    if plan is None:
        return case
    lp = layer_plans(plan, loads_of(case.ids_per_rank, case.num_experts), 0)[0]
    return dataclasses.replace(case, plan=lp, placement_E=plan.placement_LE[0].clone())
