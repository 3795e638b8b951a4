"""MoE layer benchmark: ReplayBalancedMoE against torchtitan's MoE, forward + backward, one CPU process.

Both layers get the same weights (the very same parameter tensors, so that two
Qwen3-30B-A3B-sized layers fit in this machine's memory), the same tokens and the same
routing: torchtitan's router chooses the top-k experts, and ``ReplayBalancedMoE`` replays
those ids (its gates are recomputed from its own live router scores, as in training with
routing replay). Before timing, the outputs and every gradient (tokens, router gate,
w1/w2/w3) are compared (max relative error = max |ours - torchtitan| / max |torchtitan|,
per tensor).

Timing: ``--warmup`` untimed runs of each system, then ``--repeats`` timed runs of
forward + backward, alternating which system goes first; the median (and min) per system,
and the ratio relibra / torchtitan (target <= 1.1). ``torch.set_num_threads`` is fixed
(``--threads``) and the 1-minute load average is recorded before and after each row,
because CPU timings on a shared machine are noisy.

Configurations (expert shapes; Qwen3 router: softmax scores, renormalised top-k, zero
expert bias):

* ``qwen3-30b-a3b``: D 2048, F 768, E 128, top-8 (the model's expert shapes), 1024 tokens;
* ``small``: D 512, F 256, E 32, top-4, 2048 tokens.

dtypes: ``bfloat16`` (parameters, tokens and expert GEMMs in bf16; torchtitan's stock
``GroupedExperts``) and ``float32``. torchtitan's ``GroupedExperts`` always casts the expert
GEMMs to bf16, so the fp32 rows give torchtitan :class:`Fp32GroupedExperts` (the same
forward without the casts) to compare like with like.

    python benchmarks/moe_layer.py [--configs small qwen3-30b-a3b] [--dtypes float32 bfloat16] \\
        [--tokens N] [--repeats 7] [--warmup 2] [--threads 1] [--profile] [--json out/moe_layer.json]
    python benchmarks/moe_layer.py --smoke      # tiny shapes, one repeat (the test suite's run)

bf16 needs a CPU with fast bf16 kernels: when torch's CPU capability
(``torch.backends.cpu.get_cpu_capability()``) is not AVX-512 or AMX, bf16 GEMMs are
emulated and the bf16 rows take up to ~80x longer than docs/benchmarks.md says, so they are
skipped with a note (``--force-bf16`` runs them anyway; ``--smoke`` always runs them, its
shapes are tiny).

Exit status 1 when the two layers disagree beyond the dtype's tolerance (timings are still
printed and written).

Shape legend: B batch, L sequence, T = B*L tokens, D model dim, F expert hidden dim,
E experts, K top-k.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

# The script runs from anywhere: make the repository importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter  # noqa: E402
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: E402

from relibra_torch.moe import EXPERT_PARAMS, ReplayBalancedMoE  # noqa: E402

CONFIGS = {
    # name: expert shapes (Qwen3-30B-A3B: config.json on Hugging Face) and tokens per run
    "qwen3-30b-a3b": {"D": 2048, "F": 768, "E": 128, "K": 8, "T": 1024},
    "small": {"D": 512, "F": 256, "E": 32, "K": 4, "T": 2048},
}
SMOKE_CONFIG = {"tiny": {"D": 64, "F": 32, "E": 8, "K": 2, "T": 128}}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Max relative error (vs the tensor's max magnitude) allowed between the two layers.
# fp32: the same GEMM kernels on the same rows, only the combine's summation order differs.
# bf16: torchtitan's router scores are bf16 on CPU (its fp32 autocast is a no-op there, so
# the gates differ by bf16 rounding) and it combines the K expert rows in bf16, while
# relibra's gates and combine are fp32; the router-gate gradient inherits the bf16 softmax.
TOLERANCE = {"float32": 1e-5, "bfloat16": 5e-2}
TARGET_RATIO = 1.1
SYSTEMS = ("torchtitan", "relibra")


class Fp32GroupedExperts(GroupedExperts):
    """torchtitan's ``GroupedExperts`` computing in the parameters' dtype (no bf16 casts)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h_RF = F.silu(torch._grouped_mm(x_RD, self.w1_EFD.transpose(-2, -1), offs=offsets_E))
        h_RF = h_RF * torch._grouped_mm(x_RD, self.w3_EFD.transpose(-2, -1), offs=offsets_E)
        return torch._grouped_mm(h_RF, self.w2_EDF.transpose(-2, -1), offs=offsets_E)


def build_titan(shape: dict, dtype: torch.dtype, params: dict[str, torch.nn.Parameter]) -> MoE:
    """torchtitan ``MoE`` as its qwen3 flavours build it (softmax, route_norm, expert bias),
    with the local (EP = 1) token dispatcher, holding the given parameter tensors
    (``params``: ``gate``, ``w1_EFD``, ``w2_EDF``, ``w3_EFD``)."""
    D, Fh, E, K = shape["D"], shape["F"], shape["E"], shape["K"]
    experts = Fp32GroupedExperts if dtype == torch.float32 else GroupedExperts
    cfg = MoE.Config(
        num_experts=E, load_balance_coeff=1e-3,
        router=TokenChoiceTopKRouter.Config(num_experts=E, gate=Linear.Config(in_features=D, out_features=E),
                                            top_k=K, score_func="softmax", route_norm=True),
        routed_experts=RoutedExperts.Config(
            inner_experts=experts.Config(dim=D, hidden_dim=Fh, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K)))
    with torch.device("meta"):  # no memory for parameters that are replaced just below
        titan = cfg.build()
    titan.router.gate.weight = params["gate"]
    for name in EXPERT_PARAMS:
        setattr(titan.routed_experts.inner_experts, name, params[name])
    titan.expert_bias_E = torch.zeros(E, dtype=torch.float32)
    titan.tokens_per_expert_E = torch.zeros(E, dtype=torch.float32)
    left = [n for n, t in [*titan.named_parameters(), *titan.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"torchtitan MoE has tensors this benchmark does not set: {left}")
    return titan.train()


def build_pair(shape: dict, dtype: torch.dtype, seed: int = 0) -> tuple[MoE, ReplayBalancedMoE]:
    """(torchtitan MoE, ReplayBalancedMoE) sharing the same parameter tensors."""
    torch.manual_seed(seed)
    ours = ReplayBalancedMoE(shape["D"], shape["F"], shape["E"], shape["K"], score_func="softmax",
                             route_norm=True, expert_bias=True, dtype=dtype).train()
    return build_titan(shape, dtype, _params(ours)), ours


def _params(ours: ReplayBalancedMoE) -> dict[str, torch.nn.Parameter]:
    return {"gate": ours.gate.weight, **{n: getattr(ours, n) for n in EXPERT_PARAMS}}


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).abs().max() / e.abs().max().clamp(min=1e-30))


class Pair:
    """Both systems on one (shape, dtype): inputs, routing and the timed closures."""

    def __init__(self, shape: dict, dtype: torch.dtype, seed: int = 0):
        self.titan, self.ours = build_pair(shape, dtype, seed)
        gen = torch.Generator().manual_seed(seed + 1)
        T, D = shape["T"], shape["D"]
        self.x_BLD = torch.randn(1, T, D, generator=gen).to(dtype).requires_grad_(True)
        self.grad_BLD = torch.randn(1, T, D, generator=gen).to(dtype)
        with torch.no_grad():
            _, ids_BLK, _ = self.titan.router(self.x_BLD, self.titan.expert_bias_E)
        self.ids_BLK = ids_BLK.clone()
        self.params = _params(self.ours)

    def forward(self, system: str) -> torch.Tensor:
        if system == "torchtitan":
            return self.titan(self.x_BLD)
        return self.ours(self.x_BLD, routed_experts=self.ids_BLK)

    def clear_grads(self) -> None:
        self.x_BLD.grad = None
        for p in self.params.values():
            p.grad = None

    def run(self, system: str) -> tuple[float, float, float]:
        """One forward + backward: (forward wall s, forward + backward wall s, process CPU s)."""
        self.clear_grads()
        c0 = time.process_time()
        t0 = time.perf_counter()
        y = self.forward(system)
        t1 = time.perf_counter()
        y.backward(self.grad_BLD)
        t2 = time.perf_counter()
        c2 = time.process_time()
        return t1 - t0, t2 - t0, c2 - c0

    def agreement(self) -> dict[str, float]:
        """Max relative error of relibra vs torchtitan: output and every gradient."""
        self.clear_grads()
        y_t = self.titan(self.x_BLD)
        y_t.backward(self.grad_BLD)
        ref = {"out": y_t.detach(), "dx": self.x_BLD.grad}
        ref.update({f"d{n}": p.grad for n, p in self.params.items()})
        self.clear_grads()  # the reference gradients stay alive in ref only
        y_o = self.forward("relibra")
        if not torch.equal(self.ours.last_expert_ids_TK, self.ids_BLK.reshape(-1, self.ids_BLK.shape[-1])):
            raise RuntimeError("relibra did not route with the replayed ids")
        y_o.backward(self.grad_BLD)
        got = {"out": y_o.detach(), "dx": self.x_BLD.grad}
        got.update({f"d{n}": p.grad for n, p in self.params.items()})
        errs = {k: _rel_err(got[k], ref[k]) for k in ref}
        self.clear_grads()
        return errs


def _load() -> float:
    return os.getloadavg()[0]


def _stats(samples: list[tuple[float, float, float]]) -> dict:
    fwd = [s[0] for s in samples]
    tot = [s[1] for s in samples]
    cpu = [s[2] for s in samples]
    bwd = [s[1] - s[0] for s in samples]
    return {"fwd_bwd_s": statistics.median(tot), "fwd_bwd_s_min": min(tot), "fwd_s": statistics.median(fwd),
            "bwd_s": statistics.median(bwd), "cpu_s": statistics.median(cpu), "samples_fwd_bwd_s": tot,
            "samples_cpu_s": cpu}


def _profile(pair: Pair, system: str, rows: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    pair.run(system)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pair.run(system)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3, "share": e.self_cpu_time_total / total,
             "calls": e.count} for e in events[:rows]]


def bench_one(name: str, shape: dict, dtype_name: str, repeats: int, warmup: int, profile: bool) -> dict:
    dtype = DTYPES[dtype_name]
    load_before = _load()
    pair = Pair(shape, dtype)
    errs = pair.agreement()
    tol = TOLERANCE[dtype_name]
    samples = {s: [] for s in SYSTEMS}
    for _ in range(warmup):
        for s in SYSTEMS:
            pair.run(s)
    for i in range(repeats):
        order = SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]
        for s in order:
            samples[s].append(pair.run(s))
    stats = {s: _stats(v) for s, v in samples.items()}
    t, o = stats["torchtitan"], stats["relibra"]
    row = {
        "config": name, **shape, "dtype": dtype_name, "systems": stats,
        "ratio": o["fwd_bwd_s"] / t["fwd_bwd_s"], "ratio_min": o["fwd_bwd_s_min"] / t["fwd_bwd_s_min"],
        "ratio_cpu": o["cpu_s"] / t["cpu_s"], "ratio_fwd": o["fwd_s"] / t["fwd_s"],
        "ratio_bwd": o["bwd_s"] / t["bwd_s"],
        "max_rel_err": errs, "tolerance": tol, "agree": max(errs.values()) <= tol,
        "load_before": load_before, "load_after": _load(),
    }
    row["within_target"] = row["ratio"] <= TARGET_RATIO
    if profile:
        row["profile"] = {s: _profile(pair, s, 15) for s in SYSTEMS}
    pair.clear_grads()
    return row


def _print_row(r: dict) -> None:
    t, o = r["systems"]["torchtitan"], r["systems"]["relibra"]
    err = max(r["max_rel_err"].values())
    flag = "" if r["agree"] else "  DISAGREE"
    flag += "" if r["within_target"] else f"  > {TARGET_RATIO}x"
    print(f"{r['config']:14} {r['dtype']:8} {r['T']:5} {t['fwd_bwd_s'] * 1e3:10.1f} {o['fwd_bwd_s'] * 1e3:10.1f} "
          f"{r['ratio']:6.2f} {r['ratio_min']:6.2f} {r['ratio_cpu']:6.2f} {r['ratio_fwd']:6.2f} "
          f"{r['ratio_bwd']:6.2f} {err:9.1e} "
          f"{r['load_before']:5.1f} {r['load_after']:5.1f}{flag}", flush=True)


def slow_bf16_reason(capability: str | None = None) -> str | None:
    """Why bf16 rows would be slow on this CPU (None when its kernels are AVX-512 or AMX)."""
    cap = capability if capability is not None else torch.backends.cpu.get_cpu_capability()
    if str(cap).upper().startswith(("AVX512", "AMX")):
        return None
    return (f"torch's CPU kernels here are {cap}, not AVX-512/AMX: bf16 GEMMs are emulated and take "
            f"up to ~80x longer than the documented figures")


def _print_profile(r: dict) -> None:
    for s, ops in r["profile"].items():
        print(f"\n{r['config']} {r['dtype']} {s}: top ops by self CPU time (one forward + backward)")
        for e in ops:
            print(f"  {e['op'][:48]:48} {e['self_ms']:9.1f} ms {e['share'] * 100:5.1f}% {e['calls']:6d} calls")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["small", "qwen3-30b-a3b"], choices=list(CONFIGS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    parser.add_argument("--tokens", type=int, default=None, help="tokens per run (default: per config)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--profile", action="store_true", help="torch.profiler top ops of both systems per row")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one repeat, no warm-up")
    parser.add_argument("--force-bf16", action="store_true",
                        help="run the bf16 rows even on a CPU without AVX-512/AMX (slow there)")
    parser.add_argument("--json", type=Path, default=Path("out/moe_layer.json"))
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0 or args.threads < 1:
        parser.error(f"need --repeats >= 1 (got {args.repeats}), --warmup >= 0 (got {args.warmup}), "
                     f"--threads >= 1 (got {args.threads})")
    if args.tokens is not None and args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")

    import torchtitan
    from torchtitan.distributed.utils import set_spmd_backend

    # The plain-tensor backend: no SPMD type checks on a one-process CPU run (as the
    # integration's CPU fixtures do).
    set_spmd_backend("partial_dtensor")
    # torchtitan's router asks for fp32 autocast, which CPU autocast does not support: it
    # warns and runs the gate in the tokens' dtype (see TOLERANCE).
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    torch.set_num_threads(args.threads)
    if args.smoke:
        configs, repeats, warmup = dict(SMOKE_CONFIG), 1, 0
    else:
        configs, repeats, warmup = {c: dict(CONFIGS[c]) for c in args.configs}, args.repeats, args.warmup
    dtypes, skipped = list(args.dtypes), []
    slow = None if args.smoke or args.force_bf16 else slow_bf16_reason()
    if slow and "bfloat16" in dtypes:
        dtypes.remove("bfloat16")
        skipped.append({"dtype": "bfloat16", "reason": slow})
        print(f"note: bf16 rows skipped: {slow} (--force-bf16 runs them)")
    if args.tokens is not None:
        for shape in configs.values():
            shape["T"] = args.tokens

    print(f"torch {torch.__version__}, torchtitan {getattr(torchtitan, '__version__', '?')}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, threads {torch.get_num_threads()}; "
          f"median of {repeats} after {warmup} warm-up; ratio = relibra / torchtitan (target <= {TARGET_RATIO})")
    print(f"{'config':14} {'dtype':8} {'T':>5} {'titan ms':>10} {'relibra ms':>10} {'ratio':>6} {'r(min)':>6} "
          f"{'r cpu':>6} "
          f"{'r fwd':>6} {'r bwd':>6} {'max relerr':>9} {'load':>5} {'load':>5}")
    rows = []
    for name, shape in configs.items():
        for dtype_name in dtypes:
            rows.append(bench_one(name, shape, dtype_name, repeats, warmup, args.profile))
            _print_row(rows[-1])
    if args.profile:
        for r in rows:
            _print_profile(r)
    result = {
        "torch": torch.__version__, "torchtitan": getattr(torchtitan, "__version__", None),
        "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(), "repeats": repeats, "warmup": warmup, "smoke": args.smoke,
        "systems": list(SYSTEMS), "target_ratio": TARGET_RATIO, "tolerance": TOLERANCE, "results": rows,
        "skipped": skipped,
        "summary": {"ratio_max": max((r["ratio"] for r in rows), default=None), "all_agree": all(r["agree"] for r in rows),
                    "all_within_target": all(r["within_target"] for r in rows)},
    }
    print("\nsummary:", json.dumps(result["summary"]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["summary"]["all_agree"] else 1)
