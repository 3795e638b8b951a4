"""The guard calibrated to its host: ``ReLibraConfig.host_scale`` scales every host-time
constant of ``planning.worth``, ``moe.host_speed`` measures it, the simulator records it.

Legend: M micro-batches, L layers, S source ranks, E experts, T tokens per source, K top-k.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra_torch.cli import main
from relibra_torch.moe import host_speed
from relibra_torch.planning import Topology
from relibra_torch.planning.pricing import GUARD_FLOORS as FLOORS
from relibra_torch.planning.pricing import priced_config
from relibra_torch.planning.relibra import relibra_plan
from relibra_torch.planning.host_time import host_scale, layer_floor_s, light_floor_s, plan_floor_s
from relibra_torch.sim.baselines import BaselineOptions, baseline_options


def _switch_config(scale: float, nodes_scale: float | None = None, **overrides):
    """The simulator's relibra config for a Switch-base expert (768 x 3072) on H200, top-1."""
    return priced_config(768, 3072, "h200", top_k=1, host_scale=scale,
                         host_scale_nodes=scale if nodes_scale is None else nodes_scale, **{**FLOORS, **overrides})


@settings(max_examples=60, deadline=None)
@given(scale=st.floats(0.05, 20.0), nodes=st.sampled_from([1, 2]), experts=st.sampled_from([8, 64, 256]),
       share=st.integers(1, 8), micro_batches=st.integers(1, 32))
def test_host_scale_multiplies_every_host_time_constant(scale, nodes, experts, share, micro_batches):
    topo = Topology(nodes, 8 // nodes, experts, 2)
    # the topology's scale only: one node's where it has one, across nodes' where it has more
    one = _switch_config(1.0)
    scaled = _switch_config(scale, 7.0) if nodes == 1 else _switch_config(7.0, scale)
    assert host_scale(topo, scaled) == scale
    for fn in (layer_floor_s, light_floor_s):
        assert math.isclose(fn(topo, scaled, share, micro_batches), scale * fn(topo, one, share, micro_batches),
                            rel_tol=1e-12)
    assert math.isclose(plan_floor_s(topo, scaled), scale * plan_floor_s(topo, one), rel_tol=1e-12)
    # the same guard as scaling the config's own fields (the light plan's per-layer part is a module constant)
    fields = _switch_config(1.0, **{k: v * scale for k, v in FLOORS.items() if k != "light_share"})
    assert math.isclose(layer_floor_s(topo, fields, share, micro_batches),
                        layer_floor_s(topo, scaled, share, micro_batches), rel_tol=1e-12)


def _collapsed_loads(M=8, L=2, S=8, E=8, T=256, seed=0) -> torch.Tensor:
    """int64 ``[M, L, S, E]``, top-1: 95% of every source's tokens to expert 0."""
    g = torch.Generator().manual_seed(seed)
    hot = torch.rand(M, L, S, T, generator=g) < 0.95
    choice = torch.where(hot, 0, torch.randint(1, E, (M, L, S, T), generator=g))
    return torch.zeros(M, L, S, E, dtype=torch.int64).scatter_add_(3, choice, torch.ones_like(choice))


def test_a_faster_host_gets_the_plan_the_fitted_machine_keeps():
    # a collapsed top-1 router on one node, a rank's share of 2 of 12 layers: on the fitted
    # machine the light plan's host time does not fit the layers' window; on a host 2x faster it does
    # (128 tokens per GPU: at 256 the hot expert's estimate admits the light plan on the fitted
    # machine too, worth.Tiers.light_L)
    topo, loads = Topology(1, 8, 8, 2), _collapsed_loads(T=128)
    copies = {s: bool((relibra_plan(loads, topo, None, _switch_config(s), None, 12).slot_expert_MLGJ[..., 1:] >= 0)
                      .any()) for s in (1.0, 0.5)}
    assert copies == {1.0: False, 0.5: True}


def test_reference_loads_are_valid_top_k_counts_and_seeded():
    loads = host_speed.reference_loads(16, 4, 2, 4, 64, seed=3)
    assert loads.shape == (8, 2, 4, 16)
    assert bool((loads.sum(-1) == 64 * 4).all()) and int(loads.max()) <= 64 and int(loads.min()) >= 0
    assert torch.equal(loads, host_speed.reference_loads(16, 4, 2, 4, 64, seed=3))
    assert not torch.equal(loads, host_speed.reference_loads(16, 4, 2, 4, 64, seed=4))


def test_the_measured_scales_are_quarter_powers_of_two_in_range_and_measured_once():
    scales = host_speed.measure_host_scale()
    assert len(scales) == 2
    for scale in scales:
        steps = 4 * math.log2(scale)
        assert abs(steps - round(steps)) < 1e-9 and 1 / 8 <= scale <= 8
    assert host_speed.measure_host_scale() is scales  # cached: the same object, no second measurement


def test_a_host_scale_must_be_positive():
    with pytest.raises(ValueError, match="relibra.host_scale"):
        baseline_options({"relibra": {"host_scale": "0"}})
    with pytest.raises(ValueError, match="host_scale"):
        _switch_config(-1.0)


SIM = ["simulate", "--model", "qwen3-30b-a3b", "--nodes", "1", "--gpus-per-node", "4", "--micro-batches", "2",
       "--steps", "1", "--micro-batch-tokens", "256", "--ignore-memory", "--systems", "static,relibra", "--no-progress"]


def test_simulate_records_the_scale_it_used(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(host_speed, "measure_host_scale", lambda: (0.75, 1.5))
    out = tmp_path / "run.json"
    assert main([*SIM, "--json", str(out)]) == 0
    recorded = json.loads(out.read_text())["config"]["baseline_options"]
    assert (recorded["relibra_host_scale"], recorded["relibra_host_scale_nodes"]) == (0.75, 1.5)
    assert "relibra's guard: host scale 0.75 on one node, 1.5 across nodes" in capsys.readouterr().out

    def unmeasured():
        raise AssertionError("a given host scale is not measured")
    monkeypatch.setattr(host_speed, "measure_host_scale", unmeasured)
    assert main([*SIM, "--json", str(out), "--set", "relibra.host_scale=2", "--set", "relibra.host_scale_nodes=3"]) == 0
    assert json.loads(out.read_text())["config"]["baseline_options"]["relibra_host_scale_nodes"] == 3.0
    # without relibra nothing is measured, and a guard turned off scales nothing
    assert main([*SIM[:-3], "--systems", "static,eplb", "--no-progress", "--json", str(out)]) == 0
    assert main([*SIM, "--json", str(out), "--set", "planning.overlap_s=1"]) == 0
    assert json.loads(out.read_text())["config"]["baseline_options"]["relibra_host_scale"] == 1.0
    assert BaselineOptions().relibra_host_scale is None
