"""The record of one GPU check run: every check's outcome, printed as it finishes, and the
JSON + markdown summary written at the end.

A check is a function returning a JSON-able detail (dict, str, number); an exception marks
it failed (recorded with its message and the end of its traceback) and the run goes on.
:class:`Skip` marks it skipped with a reason (missing torchtitan, one GPU, ...).
"""

from __future__ import annotations

import importlib.util
import json
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

#: The checkout the gpu-check runs from (``PYTHONPATH=.``): its benchmarks and pyproject.
CHECKOUT = Path(__file__).resolve().parents[2]


class Skip(Exception):
    """Raised by a check that does not apply here; the message says why."""


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` of the checkout as a module (``Skip`` when it is not there).

    Import errors of the script itself propagate: the caller decides whether they skip.
    """
    path = CHECKOUT / "benchmarks" / f"{name}.py"
    if not path.exists():
        raise Skip(f"{path} is not in this checkout")
    spec = importlib.util.spec_from_file_location(f"relibra_bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Report:
    """Outcomes of the checks of one run, in order; ``failed`` decides the exit status."""

    def __init__(self, mode: str, out_dir: Path | None = None):
        self.mode = mode
        #: where the outputs go; when set, they are rewritten after every check (marked
        #: ``partial``) so a run cut short by a time limit still leaves what it measured
        self.out_dir = out_dir
        self.env: dict[str, Any] = {}
        self.checks: list[dict[str, Any]] = []
        #: extra top-level keys of gpu_check.json (e.g. ``expertplex``: its measured tile time)
        self.keys: dict[str, Any] = {}
        self.t0 = time.perf_counter()

    def check(self, part: str, name: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` as check ``name`` of ``part``; returns its detail (None if it failed)."""
        t0 = time.perf_counter()
        row: dict[str, Any] = {"part": part, "name": name}
        detail = None
        try:
            detail = fn()
            row.update(status="ok", detail=detail)
        except Skip as e:
            row.update(status="skipped", reason=str(e))
        except Exception as e:  # record and go on: one broken check must not hide the others
            row.update(status="failed", error=f"{type(e).__name__}: {e}"[:3000],
                       traceback=traceback.format_exc()[-4000:])
        _cuda_settle()
        row["seconds"] = round(time.perf_counter() - t0, 2)
        self.checks.append(row)
        note = row.get("error") or row.get("reason") or ""
        print(f"[{row['status']:7}] {part}: {name} ({row['seconds']:.1f} s){' -- ' + note if note else ''}",
              flush=True)
        if self.out_dir is not None:
            self.write(self.out_dir, [], partial=True)
        return detail

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [c for c in self.checks if c["status"] == "failed"]

    def counts(self) -> dict[str, int]:
        out = {"ok": 0, "failed": 0, "skipped": 0}
        for c in self.checks:
            out[c["status"]] += 1
        return out

    def write(self, out_dir: Path, highlights: list[str], partial: bool = False) -> tuple[Path, Path]:
        """Write ``gpu_check.json`` and ``summary.md`` into ``out_dir``; return both paths.

        ``partial``: the run is still going (the files say so and are rewritten at its end).
        """
        out_dir.mkdir(parents=True, exist_ok=True)
        data = {"mode": self.mode, "partial": partial, "seconds": round(time.perf_counter() - self.t0, 1),
                "counts": self.counts(),
                "env": self.env, "highlights": highlights, "checks": self.checks, **self.keys}
        json_path = out_dir / "gpu_check.json"
        json_path.write_text(json.dumps(data, indent=1, default=str))
        md_path = out_dir / "summary.md"
        md_path.write_text(self.markdown(highlights, data["seconds"], partial))
        return json_path, md_path

    def markdown(self, highlights: list[str], seconds: float, partial: bool = False) -> str:
        e = self.env
        c = self.counts()
        lines = [
            f"# make gpu-check ({self.mode})", "",
            f"{e.get('gpu_name', '?')} x {e.get('gpu_count', '?')} (sm_{e.get('capability', '?')}), "
            f"driver {e.get('driver', '?')}; Python {e.get('python', '?')}, torch {e.get('torch', '?')} "
            f"(CUDA {e.get('torch_cuda', '?')}), triton {e.get('triton', '?')}, "
            f"torchtitan {e.get('torchtitan', 'not importable')}.", "",
            f"{c['ok']} ok, {c['failed']} failed, {c['skipped']} skipped in {seconds:.0f} s"
            f"{' (partial: the run had not finished when this was written)' if partial else ''}.", "",
        ]
        if highlights:
            lines += ["## Figures", ""] + [f"- {h}" for h in highlights] + [""]
        lines += ["## Checks", "", "| part | check | status | s | note |", "|---|---|---|---|---|"]
        for r in self.checks:
            note = (r.get("error") or r.get("reason") or "").replace("|", "/").replace("\n", " ")[:160]
            lines.append(f"| {r['part']} | {r['name']} | {r['status']} | {r['seconds']:.1f} | {note} |")
        return "\n".join(lines) + "\n"


def _cuda_settle() -> None:
    """Finish the check's GPU work (so a late error lands in its own check) and free its memory."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:  # a sticky CUDA error shows up in the next check that uses the GPU
        pass
