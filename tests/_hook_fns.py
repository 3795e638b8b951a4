"""Rank functions and planners for the planner-hook tests (imported by spawned ranks).

Legend: M micro-batches, L layers, S source ranks, E experts.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import custom_loop  # noqa: E402  (examples/custom_loop.py: the loop under test)
from relibra_torch.planning import Planner, ReLibraPlanner, StepPlan, replicate  # noqa: E402


class ShufflePlanner(Planner):
    """A new random placement every step (seeded by the step), then intra-node replication:
    forces a migration of experts and optimizer state before every step."""

    name = "shuffle"

    def __init__(self, topology, seed: int = 0):
        super().__init__(topology)
        self.seed, self.steps = seed, 0

    def plan(self, loads_MLSE: torch.Tensor) -> StepPlan:
        L, E = loads_MLSE.shape[1], self.topology.num_experts
        gen = torch.Generator().manual_seed(self.seed + self.steps)
        placement_LE = torch.stack([torch.randperm(E, generator=gen) for _ in range(L)])
        slot_expert, slot_tokens = replicate(loads_MLSE, self.topology, placement_LE)
        return StepPlan(self.topology, placement_LE, slot_expert, slot_tokens, self.name,
                        self.previous_placement(L).clone())

    def commit(self, plan, loads_MLSE):
        super().commit(plan, loads_MLSE)
        self.steps += 1


class FailOnRankOne(ShufflePlanner):
    """Raises on EP rank 1 only: every rank must fall back together."""

    def plan(self, loads_MLSE):
        if dist.get_rank() == 1:
            raise RuntimeError("planner exploded on rank 1")
        return super().plan(loads_MLSE)


class FailShareOnRankOne(ReLibraPlanner):
    """relibra whose share of the layers raises on EP rank 1 under split planning: every
    rank must fall back together, and the fallback's token splits come from
    ``rank_schedules`` itself (no rank's share was split and gathered)."""

    def plan_layers(self, loads_MLSE, layers, pairs_LEE=None):
        if dist.get_rank() == 1:
            raise RuntimeError("planner share exploded on rank 1")
        return super().plan_layers(loads_MLSE, layers, pairs_LEE)


class WholeStepShares(ReLibraPlanner):
    """A planner bug: ``plan_layers`` returns every layer, not the rank's share. With fewer
    layers than ranks, ranks 2 and 3 plan nothing: all ranks must fall back together (the
    ranks with a share used to raise outside the failure handling while the others waited
    in the all-gather)."""

    def plan_layers(self, loads_MLSE, layers, pairs_LEE=None):
        return super().plan_layers(loads_MLSE, list(range(loads_MLSE.shape[1])), pairs_LEE)


class RankDependent(ShufflePlanner):
    """Non-deterministic across ranks (seeded by the rank): must be caught, not hang."""

    def plan(self, loads_MLSE):
        self.seed = 1000 * dist.get_rank()
        return super().plan(loads_MLSE)


def train(cfg, planner, planner_kwargs=None):
    return custom_loop.train_rank(cfg, planner, planner_kwargs)


def train_catching_warnings(cfg, planner, planner_kwargs=None):
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = custom_loop.train_rank(cfg, planner, planner_kwargs)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return out


def train_checking_schedules(cfg, planner, planner_kwargs=None):
    """``train_catching_warnings``, and after every ``plan_step`` this rank's installed
    schedules compared field by field with the one-pair path (``layer_plans``,
    ``check_layer_plan``, ``build_rank_schedule``) of the step's plan; returns the steps
    whose schedules differ and the micro-batches the layers degraded."""
    from relibra_torch.hook import ReplayBalancer
    from relibra_torch.moe.schedule import build_rank_schedule, check_layer_plan, layer_plans
    from test_schedule_batch import pair_differs

    differ, degraded, original = [], [], ReplayBalancer.plan_step

    def plan_step(self, *args, **kwargs):
        if self.plan is not None:
            degraded.append(len(self.report.degraded_micro_batches))
        plan = original(self, *args, **kwargs)
        for m in range(plan.num_micro_batches):
            for l, ref in enumerate(layer_plans(plan, self.loads_MLSE, m)):
                ref = check_layer_plan(ref, self.topology, plan.placement_LE[l])
                lp, sched = self._schedules[m][l]
                ref_sched = build_rank_schedule(self.topology, plan.placement_LE[l], ref, self.ep.rank).to("cpu")
                if pair_differs(lp, sched, ref, ref_sched, self.loads_MLSE[m, l]):
                    differ.append((len(degraded), m, l))
        return plan

    ReplayBalancer.plan_step = plan_step
    try:
        out = train_catching_warnings(cfg, planner, planner_kwargs)
    finally:
        ReplayBalancer.plan_step = original
    out.update(differ=differ, degraded=degraded)
    return out


def reference_single_process(cfg) -> dict:
    """The same training on one process without a mesh: every rank's micro-batch ``m``
    concatenated into one micro-batch (the EP loss is the sum over ranks)."""
    torch.manual_seed(cfg.seed)
    model = custom_loop.MoEStack(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, foreach=False)
    world = cfg.nodes * cfg.gpus_per_node
    losses = []
    for step in range(cfg.steps):
        per_rank = [custom_loop.make_data(cfg, step, r) for r in range(world)]
        total = 0.0
        for m in range(cfg.micro_batches):
            x = torch.cat([per_rank[r][m][0] for r in range(world)])
            t = torch.cat([per_rank[r][m][1] for r in range(world)])
            ids = torch.cat([per_rank[r][m][2] for r in range(world)])
            loss = ((model(x, ids) - t) ** 2).sum()
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def split_vs_whole_plans(cfg, steps: int = 3, rank_dependent_config: bool = False,
                         hierarchical: bool = False) -> list[tuple[str, str]]:
    """Plan ``steps`` steps of the loop's routing with split planning (each rank plans every
    G-th layer, parts all-gathered) and, from the same planner state, the whole step in one
    go; return both digests per step. With ``rank_dependent_config`` rank 1 prices its
    planner differently (plan_step must then raise PlanDivergence on every rank)."""
    from relibra_torch.hook import ReplayBalancer, count_loads
    from relibra_torch.moe.schedule import layer_plans
    from relibra_torch.planning import ReLibraConfig, plan_digest

    torch.manual_seed(cfg.seed)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (cfg.nodes, cfg.gpus_per_node), mesh_dim_names=("node", "gpu"))
    model = custom_loop.MoEStack(cfg, mesh)
    config = ReLibraConfig(migration_s_per_expert=0.0 if not rank_dependent_config else 1e-3 * (1 + dist.get_rank()),
                           dispatch="hierarchical" if hierarchical else "flat")
    balancer = ReplayBalancer(model, "relibra", {"config": config})
    out = []
    for step in range(steps):
        ids = [b[2] for b in custom_loop.make_data(cfg, step, dist.get_rank())]
        loads = balancer._gather_loads(count_loads(ids, balancer.num_layers, balancer.topology.num_experts))
        pairs = balancer._gather_pairs(ids)  # the step's co-activation, summed over ranks
        assert (pairs is not None) == hierarchical
        whole = balancer.planner.plan(loads, pairs) if hierarchical else balancer.planner.plan(loads)
        got = plan_digest(balancer.plan_step(ids))
        # the installed splits came from the ranks' shares, all-gathered with the plan: each
        # equals token_split of the whole step's plan
        ref = [layer_plans(whole, loads, m) for m in range(loads.shape[0])]
        splits_equal = all(torch.equal(lp.split_SGJ, ref[m][l].split_SGJ)
                           for m, row in enumerate(balancer._schedules) for l, (lp, _) in enumerate(row))
        out.append((got, plan_digest(whole), splits_equal))
    return out


def eplb_split_vs_whole_plans(cfg, steps: int = 4) -> dict:
    """EPLB (history window 2, rebalance every 2 steps) planned by the hook with split
    planning, and by a twin planner on the whole step that commits its own plans; both
    digests per step, and which layers' replica table this rank holds at the end."""
    from relibra_torch.hook import ReplayBalancer, count_loads
    from relibra_torch.planning import make_planner, plan_digest

    torch.manual_seed(cfg.seed)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (cfg.nodes, cfg.gpus_per_node), mesh_dim_names=("node", "gpu"))
    model = custom_loop.MoEStack(cfg, mesh)
    balancer = ReplayBalancer(model, "eplb", {"interval": 2, "window": 2})
    twin = make_planner("eplb", balancer.topology, interval=2, window=2)
    digests = []
    for step in range(steps):
        ids = [b[2] for b in custom_loop.make_data(cfg, step, dist.get_rank())]
        loads = balancer._gather_loads(count_loads(ids, balancer.num_layers, balancer.topology.num_experts))
        whole = twin.plan(loads)
        twin.commit(whole, loads)
        digests.append((plan_digest(balancer.plan_step(ids)), plan_digest(whole)))
    held = [l for l in range(balancer.num_layers) if bool((balancer.planner.replicas_LGJ[l] >= 0).all())]
    return {"digests": digests, "held": held}


def _two_layer_ep(E: int = 4, replica_slots: int = 0):
    """Two ``ReplayBalancedMoE`` layers (dim 8, hidden 4, top-2) over this process group as one EP mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from relibra_torch.moe import ReplayBalancedMoE
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    return torch.nn.ModuleList([ReplayBalancedMoE(8, 4, E, 2, mesh=mesh, replica_slots=replica_slots)
                                for _ in range(2)])


def agreed_host_scales() -> dict:
    """``ReplayBalancer.host_scales`` where every rank measures another host speed."""
    import relibra_torch.hook as hook
    rank = dist.get_rank()
    hook.measure_host_scale = lambda: (0.25 * (rank + 1), 2.0 - 0.25 * rank)   # this process only
    return hook.ReplayBalancer(list(_two_layer_ep())).host_scales()


def bad_replay_on_one_rank(kind: str) -> str:
    """``plan_step`` where only rank 1's replay is bad (``kind``): the error this rank raised."""
    from relibra_torch.hook import ReplayBalancer
    layers = _two_layer_ep()
    balancer = ReplayBalancer(list(layers))
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(10)]).view(5, 2, 2)
    counts = None
    if dist.get_rank() == 1:
        if kind == "id out of range":
            ids[0, 0, 0] = 7
        elif kind == "top-k":
            ids = torch.cat([ids, ids[..., :1]], -1)
        elif kind == "nan counts":
            ids, counts = None, torch.full((1, 2, 4), float("nan"))
    if counts is None and dist.get_rank() != 1 and kind == "nan counts":
        ids, counts = None, torch.ones(1, 2, 4)
    try:
        balancer.plan_step([ids] if ids is not None else None, counts_MLE=counts)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def migration_without_optimizer() -> list[str]:
    """Two steps of forced migration (:class:`ShufflePlanner`) with ``plan_step(ids)`` and no
    optimizer: the warnings raised (one, the first time experts move)."""
    import warnings

    from relibra_torch.hook import ReplayBalancer
    layers = _two_layer_ep()
    balancer = ReplayBalancer(list(layers), ShufflePlanner(layers[0].topology))
    g = torch.Generator().manual_seed(dist.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            balancer.plan_step([torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(12)]).view(6, 2, 2)])
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)
            and not issubclass(w.category, RuntimeWarning)]
