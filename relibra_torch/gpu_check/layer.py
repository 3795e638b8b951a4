"""``ReplayBalancedMoE`` on one GPU: forward + backward against references.

* the layer on CUDA (Triton kernels) against the same layer on the CPU (torch reference
  ops) in fp32, and in bf16 against that fp32 result;
* a planned forward (a placement applied, a native plan installed) equal to the local path;
* torchtitan 0.3.0's ``MoE`` holding the same parameters, when torchtitan imports: outputs
  and every gradient, and the forward + backward time of both (``benchmarks/moe_layer.py``
  builds it, loaded from the checkout);
* ``full`` mode: ``torch.compile`` of the layer against eager, and CUDA-graph capture and
  replay of a planned forward (``check_plan=False``) against eager.

Shape legend: T tokens, D model dim, F expert hidden dim, E experts, K top-k.
"""

from __future__ import annotations


import torch

from relibra_torch.gpu_check import reference as ref
from relibra_torch.gpu_check.kernels import first_configs
from relibra_torch.gpu_check.report import Report, Skip, load_benchmark

PART = "layer"
SHAPE = {"D": 512, "F": 384, "E": 16, "K": 4, "T": 4096}
# max |a - b| / max |b| allowed: fp32 on both sides differs only in summation order;
# bf16 parameters and activations against the fp32 layer carry bf16 rounding throughout.
TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def _layer(dtype: torch.dtype, device, seed: int, **kw):
    from relibra_torch.moe import ReplayBalancedMoE

    torch.manual_seed(seed)
    s = SHAPE
    return ReplayBalancedMoE(s["D"], s["F"], s["E"], s["K"], route_norm=True, expert_bias=True,
                             num_shared_experts=1, dtype=dtype, device=device, **kw).train()


def _inputs(device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_TD fp32, skewed distinct replayed ids_TK, dout_TD fp32), drawn on ``device``."""
    s = SHAPE
    heat_E = torch.rand(s["E"], generator=gen, device=device) ** 4 + 0.05
    keys_TE = torch.rand(s["T"], s["E"], generator=gen, device=device).log() / heat_E  # skewed, distinct per token
    ids_TK = keys_TE.topk(s["K"], dim=-1).indices
    return (torch.randn(s["T"], s["D"], generator=gen, device=device), ids_TK,
            torch.randn(s["T"], s["D"], generator=gen, device=device))


def _fwd_bwd(layer, x_TD, ids_TK, dout_TD) -> dict[str, torch.Tensor]:
    """Output and every gradient (tokens and parameters) of one forward + backward."""
    layer.zero_grad(set_to_none=True)
    x = x_TD.detach().clone().requires_grad_()
    out = layer(x, routed_experts=ids_TK)
    out.backward(dout_TD)
    grads = {f"d{n}": p.grad for n, p in layer.named_parameters()}
    return {"out": out.detach(), "dx": x.grad, **grads}


def _compare(got: dict, want: dict, tol: float, what: str) -> dict[str, float]:
    errs = {k: ref.rel_err(got[k], want[k]) for k in want}
    bad = {k: v for k, v in errs.items() if not v <= tol}
    if bad:
        raise AssertionError(f"{what}: relative error above {tol:g}: {bad}")
    return errs


def _cuda_vs_cpu(device, gen) -> dict:
    cpu = _layer(torch.float32, "cpu", 0)
    x, ids, dout = (t.cpu() for t in _inputs(device, gen))
    want = _fwd_bwd(cpu, x, ids, dout)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        gpu = _layer(dtype, device, 0)
        gpu.load_state_dict(cpu.state_dict())  # buffers keep their own dtype (fp32 counters)
        got = _fwd_bwd(gpu, x.to(device, dtype), ids.to(device), dout.to(device, dtype))
        out[str(dtype)[6:]] = _compare(got, {k: v.to(device) for k, v in want.items()}, TOL[dtype],
                                       f"{dtype} on CUDA vs fp32 on CPU")
    return out


def _planned_vs_local(device, gen) -> dict:
    from relibra_torch.moe.schedule import native_layer_plan

    layer = _layer(torch.float32, device, 1, replica_slots=2)
    x, ids, dout = _inputs(device, gen)
    local = _fwd_bwd(layer, x, ids, dout)
    placement = torch.randperm(SHAPE["E"], generator=torch.Generator().manual_seed(5))
    layer.apply_placement(placement)
    counts_1E = torch.bincount(ids.reshape(-1), minlength=SHAPE["E"]).cpu().view(1, -1)
    layer.set_plan(native_layer_plan(layer.topology, layer.placement_cpu, counts_1E))
    planned = _fwd_bwd(layer, x, ids, dout)
    layer.set_plan(None)
    # expert gradients follow the physical order of the new placement: compare the outputs,
    # the token and router gradients (placement-independent)
    keys = ["out", "dx", "dgate.weight"]
    return _compare({k: planned[k] for k in keys}, {k: local[k] for k in keys}, TOL[torch.float32],
                    "planned forward vs local path")


def _load_bench_moe_layer():
    try:
        return load_benchmark("moe_layer")  # imports torchtitan's MoE modules
    except ImportError as e:
        raise Skip(f"torchtitan's MoE does not import here ({type(e).__name__}: {e}); "
                   f"the comparison with it is skipped")


def _vs_torchtitan(device, gen) -> dict:
    bench = _load_bench_moe_layer()
    try:
        from torchtitan.distributed.utils import set_spmd_backend

        set_spmd_backend("partial_dtensor")  # as benchmarks/moe_layer.py runs it
    except Exception:
        pass
    shape = dict(bench.CONFIGS["qwen3-30b-a3b"], T=8192)
    out = {"shape": shape}
    from relibra_torch.moe import ReplayBalancedMoE

    torch.manual_seed(0)
    ours = ReplayBalancedMoE(shape["D"], shape["F"], shape["E"], shape["K"], score_func="softmax", route_norm=True,
                             expert_bias=True, dtype=torch.bfloat16, device=device).train()
    titan = bench.build_titan(shape, torch.bfloat16, bench._params(ours)).to(device)  # the same parameters
    x = torch.randn(1, shape["T"], shape["D"], generator=gen, device=device).to(torch.bfloat16).requires_grad_()
    dout = torch.randn(1, shape["T"], shape["D"], generator=gen, device=device).to(torch.bfloat16)
    with torch.no_grad():
        _, ids_BLK, _ = titan.router(x, titan.expert_bias_E)
    params = {"gate": ours.gate.weight, **{n: getattr(ours, n) for n in ("w1_EFD", "w2_EDF", "w3_EFD")}}

    def run(system: str) -> dict:
        x.grad = None
        for p in params.values():
            p.grad = None
        y = titan(x) if system == "torchtitan" else ours(x, routed_experts=ids_BLK)
        y.backward(dout)
        return {"out": y.detach(), "dx": x.grad.clone(), **{f"d{k}": p.grad.clone() for k, p in params.items()}}

    want, got = run("torchtitan"), run("relibra")
    out["max_rel_err"] = _compare(got, want, bench.TOLERANCE["bfloat16"], "relibra vs torchtitan (bf16)")
    times = {system: _time_ms(lambda system=system: run(system), device) for system in ("torchtitan", "relibra")}
    out["fwd_bwd_ms"] = times
    out["ratio_relibra_over_torchtitan"] = times["relibra"] / times["torchtitan"]
    return out


def _time_ms(fn, device, warmup: int = 2, reps: int = 5) -> float:
    """Mean milliseconds of ``fn`` (CUDA events on a GPU, the wall clock elsewhere)."""
    import time

    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _compiled(device, gen) -> dict:
    layer = _layer(torch.float32, device, 2)
    x, ids, dout = _inputs(device, gen)
    eager = _fwd_bwd(layer, x, ids, dout)
    torch._dynamo.reset()
    compiled = torch.compile(layer)
    got = _fwd_bwd(compiled, x, ids, dout)
    got = {k.replace("_orig_mod.", ""): v for k, v in got.items()}
    return _compare(got, eager, TOL[torch.float32], "torch.compile vs eager")


def _cuda_graph(device, gen) -> dict:
    from relibra_torch.moe.schedule import native_layer_plan

    layer = _layer(torch.bfloat16, device, 3, replica_slots=2, check_plan=False)
    layer.apply_placement(torch.randperm(SHAPE["E"], generator=torch.Generator().manual_seed(6)))
    x, ids, _ = _inputs(device, gen)
    x = x.to(torch.bfloat16)
    counts_1E = torch.bincount(ids.reshape(-1), minlength=SHAPE["E"]).cpu().view(1, -1)
    layer.set_plan(native_layer_plan(layer.topology, layer.placement_cpu, counts_1E))
    static_x, static_ids = x.clone(), ids.clone()
    out = {}
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (autotuning, compilation) outside the capture
            for _ in range(3):
                layer(static_x, routed_experts=static_ids)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(static_x, routed_experts=static_ids)
        for i in range(2):
            perm = torch.randperm(SHAPE["T"], generator=gen, device=device)  # same counts: the plan holds
            static_ids.copy_(ids[perm])
            static_x.copy_(torch.randn(x.shape, generator=gen, device=device).to(torch.bfloat16))
            graph.replay()
            want = layer(static_x.clone(), routed_experts=static_ids.clone())
            if not torch.equal(static_out, want):
                raise AssertionError(f"replay {i}: differs from eager (relative error {ref.rel_err(static_out, want):.3g})")
            out[f"replay {i}"] = "bitwise equal to eager"
    layer.set_plan(None)
    return out


def _pinned_and_poisoned(fn, device, gen):
    def run():
        with first_configs():  # one tile config, NaN-filled allocations: unwritten memory shows
            return fn(device, gen)
    return run


def run(report: Report, device: torch.device, seed: int) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    report.check(PART, "fp32 and bf16 on CUDA vs fp32 on CPU (torch reference ops), fwd+bwd, poisoned allocations",
                 _pinned_and_poisoned(_cuda_vs_cpu, device, gen))
    report.check(PART, "planned forward (new placement, native plan) vs local path, fwd+bwd, poisoned allocations",
                 _pinned_and_poisoned(_planned_vs_local, device, gen))
    report.check(PART, "vs torchtitan MoE (Qwen3-30B-A3B shapes, 8K tokens, bf16): agreement and time",
                 lambda: _vs_torchtitan(device, gen))


def run_full(report: Report, device: torch.device, seed: int) -> None:
    """``full`` mode only; run last, because a failed CUDA-graph capture can leave the device
    in a state that spoils later checks."""
    gen = torch.Generator(device=device).manual_seed(seed)
    report.check(PART, "torch.compile of the layer vs eager (fp32, fwd+bwd)", lambda: _compiled(device, gen))
    report.check(PART, "CUDA-graph capture + replay of a planned forward (check_plan=False) vs eager",
                 lambda: _cuda_graph(device, gen))
