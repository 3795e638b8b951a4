"""benchmarks/ablation.py: its rows come from the [relibra] section's switches, and its tables."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ablation  # noqa: E402

from relibra_torch.sim.baselines import SECTIONS, BaselineOptions, baseline_options  # noqa: E402


def test_every_boolean_relibra_switch_is_flipped_once_and_all_default_on_ones_together():
    rows = ablation.switches()
    flags = {name for name, kind in SECTIONS["relibra"].items() if kind is bool}
    single = [sets for _, sets in rows if len(sets) == 1]
    assert sorted(s[0].split("=")[0] for s in single) == sorted(f"relibra.{n}" for n in flags)
    defaults = BaselineOptions()
    for sets in single:
        (text,) = sets
        field, value = text.removeprefix("relibra.").split("=")
        assert (value == "false") == getattr(defaults, f"relibra_{field}")  # flipped from the default
        baseline_options({"relibra": {field: value}})  # a setting the simulator accepts
    on = {n for n in flags if getattr(defaults, f"relibra_{n}")}
    assert {s.removeprefix("relibra.").removesuffix("=false") for s in rows[-1][1]} == on


def test_markdown_names_the_command_and_every_row():
    row = {"row": "balance=false", "step_s": 2.0, "step_over_full": 1.1, "lead_over_eplb_oracle": 0.95,
           "lead_over_fastest": 0.9, "lead_over_static": 1.2, "fraction_of_bound": 0.4}
    text = ablation.markdown([{"run": "default", "command": "relibra simulate --micro-batches 8",
                               "fastest_baseline": "online-node", "rows": [row]}])
    assert "`relibra simulate --micro-batches 8`" in text and "lead over online-node" in text
    assert "| balance=false | 2.000 s | 1.1000 | 0.950x | 0.900x | 1.200x | 0.400 |" in text
