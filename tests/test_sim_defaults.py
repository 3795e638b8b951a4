"""Defaults a practitioner would recognise: hierarchical dispatch across nodes, flat inside one."""

from __future__ import annotations

import json

import pytest

from relibra_torch.cli import main

ARGS = ["simulate", "--gpus-per-node", "2", "--no-progress", "--systems", "static", "--micro-batches", "2",
        "--micro-batch-tokens", "256", "--steps", "1", "--ignore-memory"]  # full-size model on a few GPUs: a memory what-if


@pytest.mark.parametrize("nodes, extra, expect", [
    ("2", [], "hierarchical"),       # more than one node: DeepEP-style dispatch by default
    ("1", [], "flat"),               # one node: nothing crosses nodes, the two modes agree
    ("2", ["--dispatch", "flat"], "flat"),  # flat stays available
])
def test_default_dispatch(tmp_path, nodes, extra, expect):
    path = tmp_path / "out.json"
    assert main([*ARGS, "--nodes", nodes, *extra, "--json", str(path)]) == 0
    assert json.loads(path.read_text())["config"]["cost_options"]["dispatch"] == expect
