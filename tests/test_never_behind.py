"""Issue 22's "never behind" bar on real-shaped stand-in loads files (benchmarks/never_behind.py).

Each case writes a ``relibra.loads/1`` file of stand-in counts (benchmarks/standin_loads.py),
reads it back as ``relibra simulate FILE`` does and runs every system. relibra's step may be
at most 1% longer than static's and than every baseline's. The steps compared are the cost
model's, without host work charged beyond the overlap window: that charge is one thread's
measured CPU time, which depends on the machine and its load (benchmarks/planner.py and
its test hold the planning-time bar). For the same reason the planning guard
(``planning/worth.py``), which keeps a layer's placement where the search's host time
cannot be repaid, is off here (``PLANS``): these tests hold the plans' quality; the guard's
bound and decisions are tested in tests/test_worth.py.

The cases cover what the benchmark's matrix finds (144 cases; ``python
benchmarks/never_behind.py``): a collapsed top-1 router on one node, Zipf top-8 and top-2
routers at 16-64 tokens per GPU and multiplied by 8 and 64, a collapsed top-1 router on two
nodes under hierarchical dispatch, real per-domain counts whose hot experts move between
micro-batches, and one case where every system should do nothing; and three that the
step-long candidates of ``planning.step_set`` and the shared two-hop fills fixed.
"""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import never_behind as nb  # noqa: E402

PLANS = ["relibra.plan_floor_s=0", "relibra.plan_floor_nodes_s=0"]  # the guard off: plan quality alone

CASES = [
    # top-1, 95% of tokens to one expert, one node: a copy of the hot expert pays
    nb.Case("switch-8", "collapsed", 32, 8, 1, 8),
    # top-8, 64 real tokens per GPU: balancing copies that cost more than they save
    nb.Case("qwen3", "zipf", 64, 1, 1, 8),
    # top-2, 8 experts, counts x 64: step-long replicas (EPLB) against per-micro-batch ones
    nb.Case("mixtral", "zipf", 16, 64, 1, 8),
    # top-1, 64 experts collapsed, two nodes, hierarchical dispatch, counts x 64
    nb.Case("switch-64", "collapsed", 64, 64, 2, 8),
    # top-8, 64 experts, one real domain per micro-batch and rank (hot experts move), x 8
    nb.Case("olmoe", "domains", 32, 8, 1, 8),
    # top-2, 32 experts, 16 real tokens per GPU on two nodes: nothing pays, relibra = static
    nb.Case("top2-32", "zipf", 16, 1, 2, 8),
    # top-1, 8 experts collapsed on two nodes, x 64: the hot expert's copies pay only all step
    # (their fills shared by the micro-batches; was 1.21x online-global-planned)
    nb.Case("switch-8", "collapsed", 16, 64, 2, 4),
    # top-8 collapsed on two nodes: the hot expert's traffic replica shared over its node by
    # two-hop copies (was 1.035x online-node)
    nb.Case("qwen3", "collapsed", 16, 64, 2, 8),
    # top-2, 8 experts, real domains, x 64, one node: copies over every free slot all step,
    # quotas per micro-batch (was 1.075x eplb-oracle)
    nb.Case("mixtral", "domains", 64, 64, 1, 8),
]

SETTINGS = argparse.Namespace(layers=4, micro_batches=8, steps=2, replica_slots=2, hardware="h200", seed=0,
                              vary_seed=False)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_relibra_is_never_more_than_one_percent_behind(case, tmp_path):
    row = nb.run_case(case, SETTINGS, nb._options(PLANS), tmp_path)
    step = row["model_step_s"]
    behind = {name: round(step[nb.MINE] / s, 4) for name, s in step.items()
              if name not in nb.REFERENCES and name != nb.MINE and step[nb.MINE] > nb.BAR * s}
    assert not behind, f"{case.name}: relibra's step over these systems' exceeds {nb.BAR}: {behind}"


# Settings the defaults above do not cover (docs/results.md, "A reviewer's attempt to break
# never behind"): cases each behind before its fix.
OTHER_SETTINGS = [
    # H800's slower NVLink: balancing copies admitted by their own rule whose fills exceed the
    # compute they save (was 1.025x static); each plan without them is now weighed
    (nb.Case("mixtral", "domains", 16, 64, 1, 8), dict(hardware="h800")),
    # 16 micro-batches on H800: eplb's step-long table spread over the step beat relibra's
    # step-long set, whose hot expert's owner filled most copies (was 1.024x eplb); the set
    # with at most c copies filled from one GPU is now weighed (planning.step_set)
    (nb.Case("switch-8", "zipf", 16, 64, 1, 8), dict(hardware="h800", micro_batches=16)),
    # R = 1, top-2 collapsed on one node, 256 tokens per GPU: per-micro-batch balancing gave
    # the hot expert 4-5 copies all filled from its owner, whose link then carried 4-5 fills
    # per micro-batch (was 1.032x eplb-oracle); the step-long set with at most c copies
    # filled from one GPU is weighed where the first choice has no traffic slots (0.785x)
    (nb.Case("mixtral", "collapsed", 32, 8, 1, 8), dict(replica_slots=1)),
]


@pytest.mark.parametrize("case,overrides", OTHER_SETTINGS, ids=lambda x: x.name if isinstance(x, nb.Case) else
                         ",".join(f"{k}={v}" for k, v in x.items()))
def test_relibra_is_never_more_than_one_percent_behind_on_other_settings(case, overrides, tmp_path):
    row = nb.run_case(case, argparse.Namespace(**{**vars(SETTINGS), **overrides}), nb._options(PLANS), tmp_path)
    step = row["model_step_s"]
    behind = {name: round(step[nb.MINE] / s, 4) for name, s in step.items()
              if name not in nb.REFERENCES and name != nb.MINE and step[nb.MINE] > nb.BAR * s}
    assert not behind, f"{case.name} {overrides}: relibra's step over these systems' exceeds {nb.BAR}: {behind}"


def test_stand_in_loads_depend_on_their_seed_only():
    """The drift's gamma draws use torch's global generator: seeded inside, state restored."""
    import torch
    from standin_loads import standin_loads

    torch.manual_seed(1)
    a = standin_loads(16, 2, 2, 3, 4, 8, seed=5)
    state = torch.get_rng_state()
    torch.manual_seed(2)
    b = standin_loads(16, 2, 2, 3, 4, 8, seed=5)
    assert torch.equal(a, b) and not torch.equal(a, standin_loads(16, 2, 2, 3, 4, 8, seed=6))
    torch.manual_seed(1)
    standin_loads(16, 2, 2, 3, 4, 8, seed=5)
    assert torch.equal(state, torch.get_rng_state())  # the caller's generator as it was


def test_stand_in_loads_are_deterministic_and_real_shaped(tmp_path):
    """Same case, same figures; the counts multiplied by the factor keep the tokens' routing."""
    case = nb.Case("switch-8", "zipf", 16, 4, 1, 8)
    a = nb.run_case(case, SETTINGS, nb._options(PLANS), tmp_path)
    b = nb.run_case(case, SETTINGS, nb._options(PLANS), tmp_path)
    # equal up to float rounding: the host charge (measured CPU) is subtracted from each step
    assert a["model_step_s"] == pytest.approx(b["model_step_s"], rel=1e-12)
    assert a["static_imbalance"] == b["static_imbalance"] > 1.0
    assert a["experts"] == 8 and a["top_k"] == 1 and a["dispatch"] == "flat"


def test_benchmark_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "nb.json"
    assert nb.main(["--only", "top2-32/zipf/t16x1/2x8", "--layers", "2", "--micro-batches", "2", "--jobs", "1",
                    "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "top2-32/zipf/t16x1/2x8" in text and "worst case" in text
    import json
    doc = json.loads(out.read_text())
    (row,) = doc["cases"]
    assert row["dispatch"] == "hierarchical" and row["nodes"] == 2
    assert set(row["step_s"]) >= {"static", "relibra", "eplb-oracle", "eplb-node-demand", "bound"}


def test_each_layer_plans_alone_as_in_the_whole_step(tmp_path):
    """Split planning (the training hook's default, and the simulator's) assembles the EP
    ranks' layer shares. On this case traffic replicas pay in layer 0 only, and the plain
    plan once weighed its no-traffic alternative in every layer when any layer made one: layer
    2 then planned differently alone than in the whole step."""
    import torch

    from relibra_torch.sim.cost import CostModel
    from relibra_torch.sim.simulator import default_planner_factory

    loads, workload, config = nb.case_workload(nb.Case("mixtral", "collapsed", 64, 64, 2, 4), SETTINGS,
                                               nb._options(PLANS), tmp_path)
    planner = default_planner_factory("relibra", config.topology,
                                      CostModel(config.model, config.hardware, config.cost_options))
    loads_MLSE = workload.loads_XMLSE[0]
    full = planner.plan(loads_MLSE)
    for layer in range(loads_MLSE.shape[1]):
        part = planner.plan_layers(loads_MLSE, [layer])
        assert torch.equal(part.slot_expert_MLGJ, full.slot_expert_MLGJ[:, [layer]]), layer
        assert torch.equal(part.slot_tokens_MLGJ, full.slot_tokens_MLGJ[:, [layer]]), layer


# With the guard on, at a fixed host scale (docs/results.md, "The guard calibrated to its
# host"): the stand-ins that were behind only because the guard priced host work for a host
# 2-2.5x slower than the one it ran on (at scale 1 each is 1.20-1.23x behind)
HOST_BOUND = [nb.Case("switch-8", "collapsed", 32, 8, 1, 8), nb.Case("switch-8", "zipf", 16, 64, 1, 8),
              nb.Case("switch-256", "collapsed", 32, 8, 2, 8)]


@pytest.mark.parametrize("case", HOST_BOUND, ids=lambda c: c.name)
def test_a_guard_scaled_to_a_faster_host_plans_the_host_bound_stand_ins(case, tmp_path):
    fixed = ["relibra.host_scale=0.5", "relibra.host_scale_nodes=0.5"]
    row = nb.run_case(case, argparse.Namespace(**{**vars(SETTINGS), "layers": nb._layers_arg("real")}),
                      nb._options(fixed), tmp_path)
    step = row["model_step_s"]
    behind = {name: round(step[nb.MINE] / s, 4) for name, s in step.items()
              if name not in nb.REFERENCES and name != nb.MINE and step[nb.MINE] > nb.BAR * s}
    assert not behind, f"{case.name}: relibra's step over these systems' exceeds {nb.BAR}: {behind}"
    assert row["host_scale"] == [0.5, 0.5]
