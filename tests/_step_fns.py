"""Whole training steps (several micro-batches, several layers, optimizer steps) on gloo ranks
against one process: kept replicas over residencies, refills, migration at step boundaries.

Legend: M micro-batches, L layers, S source ranks, G GPUs, J slots per GPU, E experts,
T tokens, K top-k, D dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from _moe_cases import DIM, Case, build, get_mesh, logical_state, make_routing
from relibra_torch.moe import layer_plans
from relibra_torch.moe.schedule_batch import rank_schedules
from relibra_torch.planning import StepPlan, Topology, validate_plan

PARAMS = ("w1_EFD", "w2_EDF", "w3_EFD")


@dataclass
class StepCase:
    """Steps of an ``L``-layer residual stack: per step a plan and per-micro-batch routing."""

    num_nodes: int
    gpus_per_node: int
    num_experts: int
    top_k: int
    replica_slots: int
    seed: int
    plans: list            # one StepPlan per step
    ids: list              # [step][m][s] int64 [T, L, K]
    refetch: bool = False
    compile: bool = False
    lr: float = 0.01
    batched: bool = False  # install the step's schedules built ahead (rank_schedules: NATIVE layers too)

    @property
    def num_layers(self) -> int:
        return self.ids[0][0][0].shape[1]

    def layer_case(self, l: int) -> Case:
        return Case(self.num_nodes, self.gpus_per_node, self.num_experts, self.top_k, self.replica_slots,
                    self.seed + 17 * l, [], refetch=self.refetch, shared=True)

    def loads(self, step: int) -> torch.Tensor:
        """int64 ``[M, L, S, E]`` of one step's routing."""
        E = self.num_experts
        return torch.stack([torch.stack([torch.stack([torch.bincount(ids[:, l].reshape(-1) + 1, minlength=E + 1)[1:]
                                                      for ids in per_rank])
                                         for l in range(self.num_layers)])
                            for per_rank in self.ids[step]])

    def tensors(self, step: int, m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.seed * 1000 + step * 100 + m)
        xs = [torch.randn(i.shape[0], DIM, generator=gen) for i in self.ids[step][m]]
        gs = [torch.randn(i.shape[0], DIM, generator=gen) for i in self.ids[step][m]]
        return xs, gs


def random_routing(S: int, M: int, L: int, E: int, K: int, gen: torch.Generator, max_tokens: int = 7) -> list:
    """``[m][s]`` int64 ``[T, L, K]`` skewed routing (each layer its own hot experts)."""
    out = []
    for _ in range(M):
        tokens = torch.randint(0, max_tokens + 1, (S,), generator=gen).tolist()
        per_layer = [make_routing("skewed", tokens, E, K, gen) for _ in range(L)]
        out.append([torch.stack([per_layer[l][s] for l in range(L)], 1) for s in range(S)])
    return out


def random_step_plan(topology: Topology, loads_MLSE: torch.Tensor, gen: torch.Generator,
                     placement_LE: torch.Tensor | None = None, keep_p: float = 0.6,
                     zero_p: float = 0.3, start: dict | None = None) -> StepPlan:
    """A valid multi-micro-batch plan with replicas that persist (``keep_p``), change expert
    mid-step and sometimes get no tokens (``zero_p``), on any GPU (across nodes too).
    ``start``: ``{layer: int64 [G, J]}`` replica-slot contents of micro-batch 0."""
    start = start or {}
    M, L, S, E = loads_MLSE.shape
    G, J, El = topology.num_gpus, topology.slots_per_gpu, topology.experts_per_gpu
    if placement_LE is None:
        placement_LE = torch.stack([torch.randperm(E, generator=gen) for _ in range(L)])
    se = torch.full((M, L, G, J), -1, dtype=torch.int64)
    st = torch.zeros(M, L, G, J, dtype=torch.int64)
    for l in range(L):
        native = torch.empty(E, dtype=torch.int64)
        native[placement_LE[l]] = torch.arange(E)
        for m in range(M):
            se[m, l, :, :El] = native.view(G, El)
            for gpu in range(G):
                for j in range(El, J):
                    if m == 0 and l in start:   # continue the slot contents of a previous step
                        se[m, l, gpu, j] = start[l][gpu, j]
                        continue
                    prev = int(se[m - 1, l, gpu, j]) if m else -1
                    if m and prev not in se[m, l, gpu].tolist() and float(torch.rand(1, generator=gen)) < keep_p:
                        se[m, l, gpu, j] = prev
                        continue
                    pool = [e for e in range(E) if e not in se[m, l, gpu].tolist()]
                    if pool and float(torch.rand(1, generator=gen)) < 0.8:
                        se[m, l, gpu, j] = pool[int(torch.randint(len(pool), (1,), generator=gen))]
            load_E = loads_MLSE[m, l].sum(0)
            for e in range(E):
                inst = (se[m, l] == e).nonzero().tolist()
                n = int(load_E[e])
                cuts = sorted(torch.randint(n + 1, (len(inst) - 1,), generator=gen).tolist()) if n else [0] * (len(inst) - 1)
                bounds = [0] + cuts + [n]
                parts = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
                home = next(i for i, (_, j) in enumerate(inst) if j < El)
                for i, (gpu, j) in enumerate(inst):
                    if j >= El and float(torch.rand(1, generator=gen)) < zero_p:
                        parts[home] += parts[i]   # a tokenless replica: its share stays native
                        parts[i] = 0
                for (gpu, j), q in zip(inst, parts):
                    st[m, l, gpu, j] = q
    plan = StepPlan(topology, placement_LE, se, st, "random-step")
    validate_plan(plan, loads_MLSE, intra_node_replicas=False)
    return plan


def _stack(case: StepCase, mesh):
    mods = torch.nn.ModuleList()
    for l in range(case.num_layers):
        lc = case.layer_case(l)
        m = build(lc, mesh)
        m.load_state_dict(logical_state(lc))
        mods.append(m)
    return mods


def _logical(mod, name: str, t: torch.Tensor) -> np.ndarray:
    """Logical ``[E, ...]`` of a physical local tensor (all-gathered over the EP ranks)."""
    native = mod.native_experts()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    nat = [torch.empty_like(native) for _ in range(dist.get_world_size())]
    dist.all_gather(nat, native)
    out = torch.empty(mod.num_experts, *t.shape[1:], dtype=t.dtype)
    out[torch.cat(nat)] = torch.cat(parts)
    return out.numpy()


def run_steps(case: StepCase) -> dict:
    """Rank side: every step plans, migrates, runs each micro-batch forward + backward, all-reduces
    the replicated parameters' gradients (data parallelism), takes an SGD step."""
    r = dist.get_rank()
    mods = _stack(case, get_mesh(case.num_nodes, case.gpus_per_node))
    fwd = [torch.compile(m, backend="aot_eager") if case.compile else m for m in mods]
    opt = torch.optim.SGD(mods.parameters(), lr=case.lr)
    outs, grads, fills = [], [], []
    for step, plan in enumerate(case.plans):
        loads = case.loads(step)
        for l, m in enumerate(mods):
            m.apply_placement(plan.placement_LE[l], opt)
        opt.zero_grad(set_to_none=True)
        built = rank_schedules(plan, loads, r) if case.batched else None
        for mb in range(plan.num_micro_batches):
            for m, lp in zip(mods, layer_plans(plan, loads, mb) if built is None else built[mb]):
                m.set_plan(*((lp,) if built is None else lp))
            xs, gs = case.tensors(step, mb)
            x = xs[r].clone().requires_grad_()
            h = x
            for l, f in enumerate(fwd):
                h = h + f(h, case.ids[step][mb][r][:, l])
            h.backward(gs[r])
            outs.append((h.detach().numpy(), x.grad.numpy()))
            fills.append([len(m.last_fills) for m in mods])
        for p in mods.parameters():
            if not hasattr(p, "to_local"):
                dist.all_reduce(p.grad)
        grads.append([{n: _logical(m, n, m.get_parameter(n).grad.to_local()) for n in PARAMS}
                      | {"gate": m.gate.weight.grad.numpy().copy()} for m in mods])
        opt.step()
    final = [{n: _logical(m, n, m.get_parameter(n).to_local().detach()) for n in PARAMS} for m in mods]
    return {"outs": outs, "grads": grads, "final": final, "fills": fills,
            "live": mods[0].replica_memory.live_bytes}


def reference_steps(case: StepCase) -> dict:
    """One process, all ranks' tokens, no plans: the same steps."""
    mods = _stack(case, None)
    opt = torch.optim.SGD(mods.parameters(), lr=case.lr)
    outs, grads = [], []
    for step, plan in enumerate(case.plans):
        opt.zero_grad(set_to_none=True)
        for mb in range(plan.num_micro_batches):
            xs, gs = case.tensors(step, mb)
            x = torch.cat(xs).requires_grad_()
            ids = torch.cat(case.ids[step][mb])
            h = x
            for l, m in enumerate(mods):
                h = h + m(h, ids[:, l])
            h.backward(torch.cat(gs))
            outs.append((h.detach().numpy(), x.grad.numpy()))
        grads.append([{n: m.get_parameter(n).grad.numpy().copy() for n in PARAMS}
                      | {"gate": m.gate.weight.grad.numpy().copy()} for m in mods])
        opt.step()
    final = [{n: m.get_parameter(n).detach().numpy() for n in PARAMS} for m in mods]
    return {"outs": outs, "grads": grads, "final": final}


def run_misuse(case: StepCase, cut: int) -> dict:
    """Forward-only (``no_grad``) steps free every buffer; a step cut short, or one backward over
    several micro-batches, raises on every rank instead of losing gradient."""
    r = dist.get_rank()
    mods = _stack(case, get_mesh(case.num_nodes, case.gpus_per_node))
    plan, loads = case.plans[0], case.loads(0)
    for l, m in enumerate(mods):
        m.apply_placement(plan.placement_LE[l])
    res = {}
    with torch.no_grad():  # evaluation: same outputs, nothing kept
        outs = []
        for mb in range(plan.num_micro_batches):
            for m, lp in zip(mods, layer_plans(plan, loads, mb)):
                m.set_plan(lp)
            h = case.tensors(0, mb)[0][r]
            for l, m in enumerate(mods):
                h = h + m(h, case.ids[0][mb][r][:, l])
            outs.append(h.numpy())
        res["eval_outs"] = outs
        res["eval_live"] = mods[0].replica_memory.live_bytes
        res["eval_held"] = sum(m.engine.residents.held_bytes for m in mods)
    # a step cut short after micro-batch ``cut``, inside a residency: the next install says
    # which gradients never went home
    for mb in range(cut + 1):
        for m, lp in zip(mods, layer_plans(plan, loads, mb)):
            m.set_plan(lp)
        h = case.tensors(0, mb)[0][r].clone().requires_grad_()
        for l, m in enumerate(mods):
            h = h + m(h, case.ids[0][mb][r][:, l])
        h.sum().backward()
    try:
        for m, lp in zip(mods, layer_plans(plan, loads, 0)):
            m.set_plan(lp)
        res["cut_short"] = ""
    except RuntimeError as exc:
        res["cut_short"] = str(exc)
    # one backward over the summed losses of every micro-batch (autograd order, not forward order)
    for m in mods:
        m.engine.residents.pending_GJ.zero_()
        m.set_plan(None)
    total = 0
    try:
        for mb in range(plan.num_micro_batches):
            for m, lp in zip(mods, layer_plans(plan, loads, mb)):
                m.set_plan(lp)
            h = case.tensors(0, mb)[0][r].clone().requires_grad_()
            for l, m in enumerate(mods):
                h = h + m(h, case.ids[0][mb][r][:, l])
            total = total + h.sum()
        total.backward()
        res["one_backward"] = ""
    except RuntimeError as exc:
        res["one_backward"] = str(exc)
    return res
