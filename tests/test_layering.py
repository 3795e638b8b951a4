"""The package's import structure follows the data flow.

Every module under ``relibra_torch/`` is parsed with ``ast`` (nothing is imported, so a
module that fails to import cannot hide its imports); every import statement counts,
module-level or inside a function, absolute or relative. Checked:

* ``replay`` and ``planning`` (the bottom: data formats, counts, planners) import nothing
  from the layer, ops, distributed, the simulator, the hook, rollout or the integrations;
* the hook and the MoE layer import nothing from the simulator (nor do the examples that
  show the hook);
* no module imports a private name (``_x``) or a private module from another module;
* the module graph has no cycle;
* no file is longer than 450 lines (the Triton kernel file excepted);
* ``distributed`` (collectives, fills, migration) imports nothing from the layer above it.

There are no import exceptions: the modules that moved (the rollout tools to ``rollout/``,
the host-side schedule to ``moe/``) are imported from where they live.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "relibra_torch"
MAX_LINES = 450
LONG_FILES_ALLOWED = {"relibra_torch/ops/triton_kernels.py"}  # generated-style kernel code

BOTTOM = ("relibra_torch.replay", "relibra_torch.planning")
ABOVE_BOTTOM = ("relibra_torch.moe", "relibra_torch.ops", "relibra_torch.distributed", "relibra_torch.sim",
                "relibra_torch.hook", "relibra_torch.rollout", "integrations")
ABOVE_DISTRIBUTED = ("relibra_torch.moe", "relibra_torch.sim", "relibra_torch.hook", "relibra_torch.rollout",
                     "integrations")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _imports(name: str, path: Path, text: str | None = None) -> list[tuple[str, str | None, int]]:
    """``(target module, imported name or None, line)`` for every import in the file.

    ``from X import y`` yields ``(X.y, None)`` when ``X.y`` is a module of the package, else
    ``(X, "y")``. Relative imports are resolved against the module's package.
    """
    package = name if _is_package(name) else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text() if text is None else text, str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((sub, None, node.lineno) if sub in MODULES else (target, alias.name, node.lineno))
    return out


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _within(target: str, prefixes) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def _where(name: str, line: int) -> str:
    return f"{MODULES[name].relative_to(ROOT)}:{line}"


def test_replay_and_planning_are_the_bottom():
    bad = []
    for name, imports in IMPORTS.items():
        if not _within(name, BOTTOM):
            continue
        bad += [f"{_where(name, line)} imports {target}" for target, _, line in imports
                if _within(target, ABOVE_BOTTOM)]
    assert not bad, "replay/planning must not import from higher layers:\n" + "\n".join(bad)


def test_distributed_does_not_import_the_layer():
    checked = [n for n in IMPORTS if _within(n, ("relibra_torch.distributed",))]
    assert "relibra_torch.distributed.collectives" in checked
    bad = [f"{_where(name, line)} imports {target}" for name in checked
           for target, _, line in IMPORTS[name] if _within(target, ABOVE_DISTRIBUTED)]
    assert not bad, "distributed/ sits below the layer:\n" + "\n".join(bad)


def test_hook_and_layer_do_not_use_the_simulator():
    checked = [n for n in IMPORTS if n == "relibra_torch.hook" or _within(n, ("relibra_torch.moe",))]
    assert "relibra_torch.hook" in checked and any(_within(n, ("relibra_torch.moe",)) for n in checked)
    bad = [f"{_where(name, line)} imports {target}" for name in checked
           for target, _, line in IMPORTS[name] if _within(target, ("relibra_torch.sim",))]
    # The example that shows the hook prices its planner without the simulator too.
    example = ROOT / "examples" / "custom_loop.py"
    for node in ast.walk(ast.parse(example.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and _within(node.module, ("relibra_torch.sim",)):
            bad.append(f"examples/custom_loop.py:{node.lineno} imports {node.module}")
    assert not bad, "the runtime path must not depend on the simulator:\n" + "\n".join(bad)


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def test_no_private_cross_module_imports():
    bad = []
    for name, imports in IMPORTS.items():
        for target, imported, line in imports:
            if not _within(target, ("relibra_torch", "integrations")) or target == name:
                continue
            private_module = any(_private(p) for p in target.split("."))
            if private_module or (imported is not None and _private(imported)):
                bad.append(f"{_where(name, line)} imports {imported or '(module)'} from {target}")
    assert not bad, "private names are private to their module:\n" + "\n".join(bad)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"a"}}) == ["a", "a"]


def test_no_import_cycles():
    graph = {name: {t for t, _, _ in imports if t in MODULES and t != name} for name, imports in IMPORTS.items()}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_file_above_the_line_limit():
    long = []
    for path in MODULES.values():
        rel = str(path.relative_to(ROOT))
        n = len(path.read_text().splitlines())
        if n > MAX_LINES and rel not in LONG_FILES_ALLOWED:
            long.append(f"{rel}: {n} lines")
    assert not long, f"files over {MAX_LINES} lines (split them by job):\n" + "\n".join(long)


def test_the_checks_see_every_kind_of_import():
    # The parser must resolve relative, absolute and function-level imports, or the tests
    # above would pass vacuously.
    src = ("from ..sim import cost\nimport relibra_torch.moe\nfrom . import counts\n"
           "def f():\n    from ...relibra_torch.hook import _private_name\n")
    got = {(t, n) for t, n, _ in _imports("relibra_torch.replay.zz_fake", PACKAGE / "replay" / "zz_fake.py", src)}
    assert got == {("relibra_torch.sim.cost", None), ("relibra_torch.moe", None),
                   ("relibra_torch.replay.counts", None), ("relibra_torch.hook", "_private_name")}, got


def test_importing_replay_loads_only_the_bottom():
    code = ("import sys, relibra_torch.replay\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith(('relibra_torch', 'torchtitan', "
            "'integrations')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.split()
    higher = [m for m in out if _within(m, ABOVE_BOTTOM) or m.startswith("torchtitan")]
    assert not higher, f"import relibra_torch.replay loaded {higher}"
    assert "relibra_torch.replay.counts" in out


@pytest.mark.parametrize("reexport,home", [
    ("relibra_torch.hook:relibra_config_for", "relibra_torch.planning.pricing:relibra_config_for"),
    ("relibra_torch.sim.cost:ReorderWeights", "relibra_torch.planning.pricing:ReorderWeights"),
    ("relibra_torch.sim.presets:get_hardware", "relibra_torch.planning.pricing:get_hardware"),
    ("relibra_torch.sim:HardwareSpec", "relibra_torch.planning.pricing:HardwareSpec"),
])
def test_names_used_through_another_module_are_the_same_objects(reexport, home):
    import importlib

    def load(spec):
        module, _, attr = spec.partition(":")
        return getattr(importlib.import_module(module), attr)

    assert load(reexport) is load(home)


@pytest.mark.parametrize("gone", ["relibra_torch.replay.recorder", "relibra_torch.replay.explore",
                                  "relibra_torch.distributed.schedule"])
def test_the_compatibility_modules_are_gone(gone):
    assert gone not in MODULES
    with pytest.raises(ModuleNotFoundError):
        __import__(gone)


def test_replay_and_distributed_do_not_serve_names_from_above():
    import relibra_torch.distributed as distributed
    import relibra_torch.replay as replay

    import relibra_torch.replay.routing as routing

    for package, name in ((replay, "RoutingRecorder"), (replay, "explore_topk"), (distributed, "layer_plans"),
                          (routing, "batch_samples")):
        assert not hasattr(package, name), f"{package.__name__}.{name}"
