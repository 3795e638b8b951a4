"""planning.plain.no_worse_than_keeping: a moved layer keeps its previous placement where
that prices no higher. On count-only loads the cost model's step (planning.price and the
simulator's CostModel) is never higher with the check than without it, and the split
plans (each EP rank a share of layers) equal the whole step's."""

import dataclasses
import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import relibra_torch.planning.relibra as relibra_mod
from relibra_torch.planning import Topology, evaluate, relibra_plan, validate_plan
from relibra_torch.planning.base import join_layer_shares, layer_share
from relibra_torch.planning.price import step_seconds
from relibra_torch.sim.cost import CostOptions, expert_cost_model
from relibra_torch.sim.dispatch import hierarchical_metrics
from relibra_torch.sim.simulator import default_planner_factory

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from standin_loads import standin_loads  # noqa: E402


def same_plan(a, b):
    return (torch.equal(a.placement_LE, b.placement_LE) and torch.equal(a.slot_expert_MLGJ, b.slot_expert_MLGJ)
            and torch.equal(a.slot_tokens_MLGJ, b.slot_tokens_MLGJ))


def previous(kind: str, L: int, E: int, El: int, seed: int) -> torch.Tensor | None:
    """None (static), a random placement, or static with each GPU's slots shuffled (a
    'move' that changes no owner: the keep/move tie)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "static":
        return None
    if kind == "random":
        return torch.stack([torch.randperm(E, generator=g) for _ in range(L)])
    rows = torch.arange(E).view(-1, El)
    return torch.stack([torch.stack([r[torch.randperm(El, generator=g)] for r in rows]).flatten() for _ in range(L)])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), shape=st.sampled_from([(1, 4, 1), (2, 2, 2), (2, 4, 1), (4, 2, 1), (2, 1, 2), (2, 2, 4)]),
       R=st.sampled_from([0, 1, 3]), M=st.sampled_from([1, 2, 4]), L=st.sampled_from([1, 3]),
       k=st.sampled_from([1, 2, 4]), tokens=st.sampled_from([16, 256, 1024]), zipf=st.sampled_from([0.0, 1.0, 1.5]),
       collapse=st.sampled_from([0.0, 0.95]), factor=st.sampled_from([1, 8]),
       model=st.sampled_from([(2048, 768), (768, 3072), (4096, 14336)]), dispatch=st.sampled_from(["flat", "hierarchical"]), hw=st.sampled_from(["h200", "h800"]),
       prev=st.sampled_from(["static", "random", "within"]), choose=st.booleans())
# layers where keeping prices above the move (a check that kept them would raise the step)
@example(seed=75, shape=(4, 2, 4), R=3, M=2, L=1, k=4, tokens=1024, zipf=1.5, collapse=0.95, factor=8,
         model=(4096, 14336), dispatch="flat", hw="h800", prev="random", choose=False)
@example(seed=273, shape=(2, 2, 4), R=1, M=2, L=3, k=4, tokens=1024, zipf=1.0, collapse=0.0, factor=8,
         model=(2048, 768), dispatch="flat", hw="h200", prev="random", choose=False)
def test_the_check_never_raises_the_step(monkeypatch, seed, shape, R, M, L, k, tokens, zipf, collapse, factor,
                                         model, dispatch, hw, prev, choose):
    N, g, El = shape
    E = N * g * El
    topo = Topology(N, g, E, R)
    cost = expert_cost_model(*model, E, k, hw, CostOptions(dispatch=dispatch))
    cfg = dataclasses.replace(default_planner_factory("relibra", topo, cost).config, plan_floor_s=0.0,
                              plan_floor_nodes_s=0.0, choose=choose)
    loads = standin_loads(E, k, L, M, N * g, tokens, steps=1, zipf=zipf, collapse=collapse, factor=factor,
                          seed=seed)[0]
    tokens_MS = loads[:, 0].sum(-1) // k
    prev_LE = previous(prev, L, E, El, seed)
    checked = relibra_plan(loads, topo, prev_LE, cfg)
    with monkeypatch.context() as m:
        m.setattr(relibra_mod, "no_worse_than_keeping", lambda plan, *a, **kw: plan)
        unchecked = relibra_plan(loads, topo, prev_LE, cfg)
    validate_plan(checked, loads)
    assert same_plan(checked, relibra_plan(loads, topo, prev_LE, cfg))  # deterministic

    def simulated(plan):
        metrics = evaluate(plan, loads)
        if dispatch == "hierarchical":
            metrics = hierarchical_metrics(plan, metrics, loads, tokens_MS, k)
        return cost.step_cost(plan, metrics, tokens_MS, tokens_MS.double()).step_s

    assert step_seconds(checked, loads, cfg) <= step_seconds(unchecked, loads, cfg) * (1 + 1e-12)
    assert simulated(checked) <= simulated(unchecked) * (1 + 1e-12)
    if not choose:  # split planning: every EP rank a share of the layers
        P = prev_LE if prev_LE is not None else topo.static_placement(L)
        for G in (2, 3):
            parts = [relibra_plan(loads[:, ls], topo, P[ls], cfg, None, L)
                     for r in range(G) if (ls := layer_share(r, G, L))]
            assert same_plan(join_layer_shares(parts, G, P, "relibra"), checked)
