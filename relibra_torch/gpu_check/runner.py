"""``make gpu-check``: argument parsing, the environment report, the parts in order, the outputs.

Exit status: 0 when every check passed or was skipped (and when there is no torch or no
CUDA device: one line says so); 1 when any check failed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from relibra_torch.gpu_check.report import CHECKOUT  # stdlib only: runs before torch is known

MODES = ("default", "full")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m relibra_torch.gpu_check",
                                description="Check relibra_torch on the CUDA GPUs of this machine (installs nothing).")
    p.add_argument("--out", type=Path, default=Path("out/gpu-check"),
                   help="folder for gpu_check.json and summary.md (default: out/gpu-check)")
    p.add_argument("--mode", choices=MODES, default=None,
                   help="default: ~4 min on one H200; full adds every autotune config, torch.compile and "
                        "CUDA-graph replay (default: $GPU_CHECK, else 'default')")
    p.add_argument("--parts", nargs="+", default=["kernels", "layer", "bench", "expertplex", "ep"],
                   choices=["kernels", "layer", "bench", "expertplex", "ep"], help="parts to run (default: all)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the random inputs (default: fresh each run, recorded in the JSON)")
    args = p.parse_args(argv)
    if args.mode is None:
        mode = os.environ.get("GPU_CHECK", "") or "default"
        if mode not in MODES:
            p.error(f"GPU_CHECK={mode!r} is not a mode; allowed: {', '.join(MODES)} (or unset)")
        args.mode = mode
    return args


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _declared_ranges() -> dict[str, str]:
    """The torch / triton / Python requirements of this checkout's pyproject.toml."""
    import tomllib

    try:
        project = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return {}
    out = {"python": project.get("requires-python", "")}
    for req in project.get("dependencies", []):
        name = req.split(">")[0].split("<")[0].split("=")[0].strip()
        if name in ("torch", "triton"):
            out[name] = req
    return out


def _in_range(version: str | None, requirement: str | None) -> bool | None:
    """Whether ``version`` satisfies ``requirement`` (plain >=/</== clauses), None if unknown."""
    if not version or not requirement:
        return None

    def key(v: str) -> tuple[int, ...]:
        parts = []
        for piece in v.split("+")[0].split("."):
            digits = "".join(ch for ch in piece if ch.isdigit())
            parts.append(int(digits) if digits else 0)
        return tuple(parts)

    spec = requirement.lstrip("abcdefghijklmnopqrstuvwxyz_-")
    v = key(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        for op, test in ((">=", lambda a, b: a >= b), ("<=", lambda a, b: a <= b), ("==", lambda a, b: a == b),
                         (">", lambda a, b: a > b), ("<", lambda a, b: a < b)):
            if clause.startswith(op):
                bound = key(clause[len(op):])
                if not test(v[:len(bound)], bound):
                    return False
                break
    return True


def environment(torch) -> dict[str, Any]:
    """Python, torch, triton, torchtitan, GPUs, driver, and what of them the package relies on."""
    env: dict[str, Any] = {
        "python": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "gpu_count": torch.cuda.device_count(),
        "numpy": _version("numpy"), "torchtitan": _version("torchtitan"),
        "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET", "RELIBRA_OPS_BACKEND",
                                               "RELIBRA_OPS_AUTOTUNE", "TRITON_CACHE_DIR")},
    }
    props = torch.cuda.get_device_properties(0)
    env.update(gpu_name=props.name, capability=f"{props.major}{props.minor}", sms=props.multi_processor_count,
               memory_gib=round(props.total_memory / 2**30, 1),
               gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        env["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        env["driver"] = None
    try:
        import triton
        import triton.language as tl

        env["triton"] = triton.__version__
        env["tl_histogram_has_mask"] = "mask" in inspect.signature(tl.histogram).parameters
    except Exception as e:
        env["triton"] = f"not importable: {type(e).__name__}: {e}"
    try:
        commit = subprocess.run(["git", "-C", str(CHECKOUT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
        env["commit"] = commit.stdout.strip() if commit.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    import torch.distributed as dist

    env["has_torch_grouped_mm"] = hasattr(torch, "_grouped_mm")
    env["has_dist_all_gather_single"] = hasattr(dist, "all_gather_single")
    ranges = _declared_ranges()
    env["declared"] = ranges
    env["within_declared"] = {"python": _in_range(env["python"], ranges.get("python")),
                              "torch": _in_range(env["torch"], ranges.get("torch")),
                              "triton": _in_range(env.get("triton"), ranges.get("triton"))}
    return env


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        import torch
    except ModuleNotFoundError as e:
        print(f"gpu-check: skipped: no torch in {sys.executable} ({e}); nothing to check")
        return 0
    if not torch.cuda.is_available():
        print(f"gpu-check: skipped: torch {torch.__version__} in {sys.executable} sees no CUDA device")
        return 0
    # The compiled kernels, whatever this shell asked for: triton.jit picks the interpreter
    # when the kernel module is imported, and the backend switch would route CUDA tensors
    # to the torch reference.
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["RELIBRA_OPS_BACKEND"] = "auto"

    from relibra_torch.gpu_check import bench, ep, expertplex, kernels, layer
    from relibra_torch.gpu_check.report import Report

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    report = Report(args.mode, args.out)
    report.env = report.check("env", "versions, GPUs, declared ranges", lambda: environment(torch)) or {}
    report.env["seed"] = seed
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    full = args.mode == "full"
    highlights: list[str] = []
    if "kernels" in args.parts:
        kernels.run(report, device, full, seed)
    if "layer" in args.parts:
        layer.run(report, device, seed + 1)
    if "bench" in args.parts:
        highlights += bench.run(report, device, full)
    if "expertplex" in args.parts:
        highlights += expertplex.run(report, device)
    if "ep" in args.parts:
        ep.run(report, seed + 2)
    if "layer" in args.parts and full:
        layer.run_full(report, device, seed + 3)
    for c in report.checks:
        if c["part"] == "layer" and c["status"] == "ok" and "ratio_relibra_over_torchtitan" in (c["detail"] or {}):
            d = c["detail"]
            highlights.append(f"MoE layer fwd+bwd vs torchtitan (Qwen3-30B-A3B shapes, 8K tokens, bf16): "
                              f"{d['fwd_bwd_ms']['relibra']:.2f} ms vs {d['fwd_bwd_ms']['torchtitan']:.2f} ms "
                              f"(ratio {d['ratio_relibra_over_torchtitan']:.2f})")
    json_path, md_path = report.write(args.out, highlights)
    counts = report.counts()
    print(f"gpu-check ({args.mode}): {counts['ok']} ok, {counts['failed']} failed, {counts['skipped']} skipped; "
          f"wrote {json_path} and {md_path}")
    return 1 if report.failed else 0
