"""What a new user meets first on the command line: runs that talk, errors that come before
the run, and output piped into ``head``.

* ``relibra simulate`` prints plain progress lines (phase, step, seconds elapsed) when
  stderr is not a terminal (pytest's capture is not one), none with ``--no-progress``;
* bad ``--json`` / ``--plot`` paths and a ``--warmup-steps`` that leaves no measured step
  are one-line errors raised before any trace is generated or any planner runs;
* ``relibra inspect FILE | head`` and ``relibra simulate ... | head`` end without a traceback.

Shapes: qwen3-30b-a3b dims (48 layers, 128 experts, top-8) on 1 node x 4 GPUs, a loads file
of 2 micro-batches of 64 tokens per rank. Legend: X steps, M micro-batches, L layers,
S source ranks, E experts.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch

import relibra_torch.sim.cli as sim_cli
from relibra_torch.cli import main
from relibra_torch.replay import save_loads
from relibra_torch.sim.run_checks import PlainProgress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a full-size model on 4 GPUs does not fit the memory model: these runs are what-ifs
SMALL = ["--nodes", "1", "--gpus-per-node", "4", "--ignore-memory", "--systems", "static"]


def loads_file(path, X=1):
    g = torch.Generator().manual_seed(0)
    picks = torch.rand(X, 2, 48, 4, 64, 128, generator=g).topk(8, -1).indices
    loads = torch.zeros(X, 2, 48, 4, 128, dtype=torch.int64)
    loads.scatter_add_(-1, picks.flatten(-2), torch.ones_like(picks.flatten(-2)))
    save_loads(str(path), loads, 8)


def test_progress_lines_when_stderr_is_not_a_terminal(tmp_path, capsys):
    f = tmp_path / "l.safetensors"
    loads_file(f, X=2)
    assert main(["simulate", str(f), *SMALL]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("relibra simulate: 0.") and err[0].endswith(f"reading {f}")
    assert any(line.endswith("2 step(s) x 2 micro-batches; planning static, uniform, bound") for line in err)
    for step in ("planning static: step 1/2", "planning static: step 2/2", "planning uniform: step 2/2",
                 "planning bound: step 2/2"):
        assert any(line.endswith(step) for line in err), (step, err)
    # "done" ends the progress lines (the what-if's memory warnings may follow it)
    assert [line for line in err if "warning (--ignore-memory)" not in line][-1].endswith(": done")
    assert main(["simulate", str(f), *SMALL, "--no-progress"]) == 0
    # no progress at all: only the what-if's memory warnings remain
    assert all("warning (--ignore-memory)" in line for line in capsys.readouterr().err.splitlines())


def test_plain_progress_prints_first_last_and_then_every_few_seconds():
    out = io.StringIO()
    p = PlainProgress(out, every_s=3600.0)
    for x in range(1, 6):
        p("relibra", x, 5)
    lines = out.getvalue().splitlines()
    assert [line.split(": ", 2)[2] for line in lines] == ["planning relibra: step 1/5", "planning relibra: step 5/5"]
    p = PlainProgress(out := io.StringIO(), every_s=0.0)
    for x in range(1, 4):
        p("eplb", x, 3)
    assert len(out.getvalue().splitlines()) == 3


def _never(*args, **kwargs):
    raise AssertionError("the run started although an option was bad")


@pytest.mark.parametrize("argv,match", [
    (["--plot", "{tmp}/out.jpg"], r"--plot '.*out.jpg' has the wrong extension; allowed: .png, .svg, .pdf"),
    (["--json", "{tmp}/out.txt"], r"--json '.*out.txt' has the wrong extension; allowed: .json"),
    (["--json", "{tmp}"], r"--json '.*' is a folder; pass a file name such as '.*out.json'"),
    (["--plot", "{tmp}/l.safetensors/p.png"], r"--plot '.*p.png': '.*l.safetensors' is a file, not a folder"),
    (["--steps", "2", "--warmup-steps", "2"], r"--warmup-steps 2 leaves no measured step: the synthetic trace "
                                              r"\(--steps\) holds 2 step\(s\); allowed: 0..1"),
    (["FILE", "--warmup-steps", "3"], r"--warmup-steps 3 leaves no measured step: the file '.*' holds 3 "
                                      r"step\(s\); allowed: 0..2"),
])
def test_bad_outputs_and_warmup_fail_before_the_run(tmp_path, capsys, monkeypatch, argv, match):
    import re
    f = tmp_path / "l.safetensors"
    loads_file(f, X=3)
    for name in ("simulate", "synthetic_workload", "sample_workload", "workload_from_file"):
        monkeypatch.setattr(sim_cli, name, _never)
    argv = [str(f) if a == "FILE" else a.replace("{tmp}", str(tmp_path)) for a in argv]
    rc = main(["simulate", *SMALL, *argv])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, lines
    assert re.search(match, lines[0]), lines[0]


def test_good_output_paths_pass_and_missing_folders_are_created(tmp_path, capsys):
    f = tmp_path / "l.safetensors"
    loads_file(f)
    out = tmp_path / "new" / "deeper"
    assert main(["simulate", str(f), *SMALL, "--no-progress", "--json", str(out / "r.json"),
                 "--plot", str(out / "r.svg")]) == 0
    assert (out / "r.json").exists() and (out / "r.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize("command", ["inspect", "simulate"])
def test_output_into_a_closed_pipe_ends_without_a_traceback(tmp_path, command):
    f = tmp_path / "l.safetensors"
    loads_file(f)
    argv = [sys.executable, "-m", "relibra_torch.cli", command, str(f)]
    if command == "simulate":
        argv += [*SMALL, "--no-progress"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env)
    proc.stdout.close()  # the reader is gone before the first line (what `| head -0` does)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_every_column_of_the_tables_has_a_legend_line_under_it(tmp_path, capsys):
    from relibra_torch.sim.report import LEGEND, TIME_COLUMNS, TRAFFIC_COLUMNS
    assert set(TIME_COLUMNS[1:]) | set(TRAFFIC_COLUMNS[1:]) <= set(LEGEND)
    f = tmp_path / "l.safetensors"
    loads_file(f)
    assert main(["simulate", str(f), *SMALL, "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    for title, columns in (("step time", TIME_COLUMNS), ("traffic and planning", TRAFFIC_COLUMNS)):
        start = next(i for i, line in enumerate(out) if line.strip() == title)
        after = out[start + 3 + 3:]  # title, header, rule, static, uniform, bound
        assert after[: len(columns) - 1] == [f"{c}: {LEGEND[c]}" for c in columns[1:]], after
    assert all(len(f"{c}: {text}") <= 100 for c, text in LEGEND.items())
