"""Experts swapped between GPUs of a node where no replica slot exists (planning/gpu_pack.py)."""

import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relibra_torch.planning import ReLibraConfig, Topology, relibra_plan
from relibra_torch.planning.gpu_pack import pack_gpus, swap_can_pay

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from standin_loads import standin_loads  # noqa: E402

CFG = ReLibraConfig(compute_s_per_token=1e-6, intra_migration_s_per_expert=1e-4)


def objective_L(placement_LE, load_LME, prev_gpu_LE, topo, cfg):
    """float64 ``[L]``: pack_gpus's objective, summed over nodes (it never rises node by node)."""
    L, M, E = load_LME.shape
    gpu_LE = placement_LE // topo.experts_per_gpu
    gl_LMG = torch.zeros(L, M, topo.num_gpus, dtype=torch.int64).scatter_add_(
        2, gpu_LE.unsqueeze(1).expand(L, M, E), load_LME)
    busiest_L = gl_LMG.view(L, M, topo.num_nodes, topo.gpus_per_node).amax(-1).sum((1, 2))
    moved_L = (gpu_LE != prev_gpu_LE).sum(1)
    return (busiest_L.to(torch.float64) * cfg.compute_s_per_token
            + moved_L.to(torch.float64) * cfg.intra_migration_s_per_expert / 2)


def test_two_hot_experts_on_one_gpu_are_split():
    """One node of two GPUs, two experts each; the two hot experts share GPU 0: one swap
    halves the busiest GPU's load, and pays its two moves."""
    topo = Topology(1, 2, 4, 0)
    placement = torch.arange(4).view(1, 4)
    load = torch.tensor([[[1000, 900, 10, 20]]])                   # [L=1, M=1, E=4]
    out = pack_gpus(placement, load, placement // 2, topo, CFG)
    gpu = (out // 2)[0]
    assert gpu[0] != gpu[1]
    assert sorted(out[0].tolist()) == [0, 1, 2, 3]
    assert swap_can_pay(load.transpose(0, 1), placement, topo, CFG)


def test_nothing_changes_with_replica_slots_one_expert_per_gpu_or_a_dear_move():
    load = torch.tensor([[[1000, 900, 10, 20]]])
    placement = torch.arange(4).view(1, 4)
    for topo, cfg in ((Topology(1, 2, 4, 1), CFG), (Topology(1, 4, 4, 0), CFG),
                      (Topology(1, 2, 4, 0), ReLibraConfig(compute_s_per_token=1e-6, intra_migration_s_per_expert=1.0))):
        assert torch.equal(pack_gpus(placement, load, placement // topo.experts_per_gpu, topo, cfg), placement)
        assert not swap_can_pay(load.transpose(0, 1), placement, topo, cfg)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), shape=st.sampled_from([(1, 1, 4), (1, 2, 4), (1, 4, 16), (2, 2, 8), (2, 4, 32), (4, 2, 16)]),
       M=st.sampled_from([1, 2, 8]), tokens=st.sampled_from([16, 256, 4096]), k=st.sampled_from([1, 2, 8]),
       zipf=st.sampled_from([0.0, 1.0, 1.5]), price=st.sampled_from([0.0, 1e-5, 1e-3]), shuffled=st.booleans())
def test_pack_keeps_nodes_and_slots_and_never_raises_its_objective(seed, shape, M, tokens, k, zipf, price, shuffled):
    N, g, E = shape
    topo = Topology(N, g, E, 0)
    k = min(k, E)
    loads_MLSE = standin_loads(E, k, 3, M, N * g, tokens, steps=1, zipf=zipf, seed=seed)[0]
    load_LME = loads_MLSE.sum(2).transpose(0, 1).contiguous()
    gen = torch.Generator().manual_seed(seed)
    placement = torch.stack([torch.randperm(E, generator=gen) for _ in range(3)]) if shuffled \
        else topo.static_placement(3)
    prev_gpu = torch.stack([torch.randperm(E, generator=gen) for _ in range(3)]) // topo.experts_per_gpu
    cfg = ReLibraConfig(compute_s_per_token=1e-7, intra_migration_s_per_expert=price)
    out = pack_gpus(placement, load_LME, prev_gpu, topo, cfg)
    assert torch.equal(out.sort(1).values, torch.arange(E).expand(3, E))           # a permutation of the slots
    assert torch.equal(out // topo.experts_per_node, placement // topo.experts_per_node)   # nodes kept
    assert bool((objective_L(out, load_LME, prev_gpu, topo, cfg)
                 <= objective_L(placement, load_LME, prev_gpu, topo, cfg) * (1 + 1e-12)).all())
    assert torch.equal(out, pack_gpus(placement, load_LME, prev_gpu, topo, cfg))   # deterministic
    # the fast path's proof: from the previous placement, where no move can be undone
    kept_gpu = placement // topo.experts_per_gpu
    if not swap_can_pay(load_LME.transpose(0, 1), placement, topo, cfg):
        assert torch.equal(pack_gpus(placement, load_LME, kept_gpu, topo, cfg) // topo.experts_per_gpu, kept_gpu)


def test_relibra_at_r0_evens_the_gpus_of_a_node():
    """At R = 0 on a skewed load relibra's plan has a busiest GPU no higher than static
    placement's on every layer and 10% lower over the step (no copy can lower it)."""
    topo = Topology(2, 4, 32, 0)
    loads = standin_loads(32, 2, 4, 8, 8, 2048, steps=1, zipf=1.2, seed=3)[0]
    cfg = ReLibraConfig(compute_s_per_token=5.7e-8, intra_migration_s_per_expert=1.5e-4,
                        migration_s_per_expert=1.3e-3)
    plan = relibra_plan(loads, topo, None, cfg)
    load_MLE = loads.sum(2)

    def busiest_L(placement_LE):
        M, L, E = load_MLE.shape
        gpu = torch.zeros(M, L, topo.num_gpus, dtype=torch.int64).scatter_add_(
            2, (placement_LE // topo.experts_per_gpu).unsqueeze(0).expand(M, L, E), load_MLE)
        return gpu.amax(-1).sum(0)
    after_L, before_L = busiest_L(plan.placement_LE), busiest_L(topo.static_placement(4))
    assert bool((after_L <= before_L).all()) and int(after_L.sum()) < 0.9 * int(before_L.sum())


def test_the_light_plan_swaps_gpus_where_no_slot_exists():
    """At R = 0 the light tier (planning/light.py) is the kept placement with GPU swaps, kept
    per layer only where the plain plan's exact price falls; a layer with nothing to gain,
    or a charge no saving reaches, keeps its placement."""
    from relibra_torch.planning.fastpath import keep_plan
    from relibra_torch.planning.light import light_plan
    from relibra_torch.planning.plain import layers_price
    from relibra_torch.planning.price import moe_seconds_ML

    topo = Topology(1, 4, 16, 0)
    loads = standin_loads(16, 2, 2, 8, 4, 4096, steps=1, zipf=1.5, seed=5)[0]
    loads[:, 0] = 1024                                                            # layer 0: even, no swap pays
    cfg = ReLibraConfig(compute_s_per_token=5.7e-8, intra_migration_s_per_expert=1.5e-4)
    kept = keep_plan(loads, topo, topo.static_placement(2), cfg)
    out = light_plan(loads, kept, cfg)
    idx = torch.arange(2)
    before_L = moe_seconds_ML(kept, loads, cfg).sum(0)
    after_L = layers_price(out, idx, loads, cfg)
    assert not torch.equal(out.placement_LE[1], kept.placement_LE[1]) and float(after_L[1]) < float(before_L[1])
    assert torch.equal(out.placement_LE[0], kept.placement_LE[0])
    assert bool((out.slot_expert_MLGJ[..., topo.experts_per_gpu:] < 0).all())    # no slot, no copy
    assert torch.equal(out.placement_LE // topo.experts_per_node, kept.placement_LE // topo.experts_per_node)
    dear = light_plan(loads, kept, cfg, torch.full((2,), 1.0))                      # a 1 s charge: keep
    assert torch.equal(dear.placement_LE, kept.placement_LE)
