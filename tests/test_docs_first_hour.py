"""The user docs say what a new user needs and nothing they cannot follow.

* the README's part table names each part once, its layout lists every example, and it
  states the run time of every example;
* docs/simulator.md lists every ``--trace`` family the CLI has;
* no user doc and no ``--help`` text cites an issue number (users cannot look those up).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from relibra_torch.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "integrations" / "torchtitan" / "README.md",
             ROOT / "integrations" / "torchtitan" / "example" / "README.md"]
ISSUE = re.compile(r"\bissues?\s*(#\s*)?\d+", re.I)


def test_readme_names_each_part_once():
    parts = re.findall(r"^\| `([^`]+)` \|", README, re.M)
    assert "relibra_torch.inference" in parts
    assert len(parts) == len(set(parts)), sorted(p for p in parts if parts.count(p) > 1)


def test_readme_layout_and_run_times_cover_every_example():
    layout = README.split("## Layout", 1)[1]
    examples_line = next(line for line in layout.splitlines() if line.startswith("examples/"))
    for path in sorted((ROOT / "examples").glob("*.py")):
        assert path.name in examples_line, path.name
        if path.name == "tiny_lm.py":  # the model the other examples import, not run by itself
            continue
        line = next((ln for ln in README.splitlines() if f"examples/{path.name}" in ln and "wall" in ln), None)
        assert line is not None and re.search(r"\d+ s wall", line), f"no run time for examples/{path.name}"
    titan = README.split("torchtitan's own trainer with relibra", 1)[1].split("\n\n", 1)[0]
    assert re.search(r"training \d+ s wall", titan), titan


def test_simulator_docs_list_every_trace_family():
    from relibra_torch.sim.cli import ALL_TRACES
    text = (ROOT / "docs" / "simulator.md").read_text()
    listed = re.search(r"`--trace \{([a-z,-]+)\}`", text).group(1).split(",")
    assert sorted(listed) == sorted(ALL_TRACES)


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_docs_cite_no_issue_numbers(path):
    hits = [line.strip() for line in path.read_text().splitlines() if ISSUE.search(line)]
    assert not hits, hits


def test_help_texts_cite_no_issue_numbers():
    parser = build_parser()
    texts = [parser.format_help()]
    sub = next(a for a in parser._actions if a.dest == "command")
    texts += [p.format_help() for p in sub.choices.values()]
    hits = [line for text in texts for line in text.splitlines() if ISSUE.search(line)]
    assert not hits, hits
