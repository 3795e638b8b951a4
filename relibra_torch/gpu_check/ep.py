"""Expert parallelism over NCCL on every visible GPU (only when there are more than one).

One process per GPU (spawned), process group ``cpu:gloo,cuda:nccl`` (the balancer gathers
counts on the CPU, the layer exchanges tokens on the GPUs), a ``("node", "gpu")`` mesh
(2 x G/2 for an even G >= 4, else 1 x G), one ``ReplayBalancedMoE`` with replica slots and
skewed replayed routing shared across ranks (hot experts), planned by ``ReplayBalancer``
with the ``relibra`` planner. Every rank compares its output, token and router gradients
with the one-process layer on its own tokens, and its local expert-weight gradients with
the one-process gradients summed over ranks (fp32, relative error <= 1e-4). Ranks write
their results to files; a rank that hangs is killed after the time limit.

Shape legend: T tokens per rank, D model dim, F expert hidden dim, E experts, K top-k,
El experts per GPU.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

from relibra_torch.gpu_check import reference as ref
from relibra_torch.gpu_check.report import Report, Skip

PART = "ep"
TOL = 1e-4
TIME_LIMIT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step(rank: int, world: int, seed: int, device_type: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from relibra_torch.hook import ReplayBalancer, relibra_config_for
    from relibra_torch.moe import ReplayBalancedMoE

    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    nodes = 2 if world >= 4 and world % 2 == 0 else 1
    mesh = init_device_mesh(device_type, (nodes, world // nodes), mesh_dim_names=("node", "gpu"))
    D, F, K, T = (1024, 512, 4, 4096) if device_type == "cuda" else (32, 16, 4, 64)  # CPU: the test's dry run
    E = 4 * world
    common = torch.Generator().manual_seed(seed)  # the same on every rank
    full = {"w1_EFD": torch.randn(E, F, D, generator=common) * D ** -0.5,
            "w2_EDF": torch.randn(E, D, F, generator=common) * F ** -0.5,
            "w3_EFD": torch.randn(E, F, D, generator=common) * D ** -0.5}
    gate_ED = torch.randn(E, D, generator=common) * D ** -0.5
    heat_E = torch.rand(E, generator=common) ** 4 + 0.05  # a few hot experts, on every rank

    def build(mesh_or_none, replica_slots):
        layer = ReplayBalancedMoE(D, F, E, K, route_norm=True, mesh=mesh_or_none, replica_slots=replica_slots,
                                  dtype=torch.float32, device=device).train()
        with torch.no_grad():
            layer.gate.weight.copy_(gate_ED)
        layer.load_logical_expert_weights({k: v.to(device) for k, v in full.items()})
        return layer

    ep_layer, one = build(mesh, 2), build(None, 0)
    mine = torch.Generator().manual_seed(seed * 1009 + rank + 1)
    keys_TE = torch.rand(T, E, generator=mine).log() / heat_E
    ids_TK = keys_TE.topk(K, dim=-1).indices
    x_TD = torch.randn(T, D, generator=mine).to(device)
    dout_TD = torch.randn(T, D, generator=mine).to(device)

    # a toy layer: the planning guard would keep every layer on a GPU; plan anyway so that
    # the replica path (fills, quotas, gradient returns) runs over NCCL
    config = relibra_config_for(ep_layer, plan_floor_s=0.0, plan_floor_nodes_s=0.0)
    balancer = ReplayBalancer(ep_layer, planner="relibra", planner_kwargs={"config": config})
    balancer.plan_step([ids_TK.unsqueeze(1)])  # one micro-batch, one layer: [T, L=1, K]
    balancer.install(0)

    def fwd_bwd(layer):
        layer.zero_grad(set_to_none=True)
        x = x_TD.clone().requires_grad_()
        out = layer(x, routed_experts=ids_TK.to(device))
        out.backward(dout_TD)
        return out.detach(), x.grad

    out, dx = fwd_bwd(ep_layer)
    want_out, want_dx = fwd_bwd(one)
    errs = {"out": ref.rel_err(out, want_out), "dx": ref.rel_err(dx, want_dx),
            "dgate": ref.rel_err(ep_layer.gate.weight.grad, one.gate.weight.grad)}
    native = ep_layer.native_experts().to(device)
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        summed = getattr(one, name).grad.clone()
        dist.all_reduce(summed)
        local = getattr(ep_layer, name).grad
        local = local.to_local() if hasattr(local, "to_local") else local
        errs[f"d{name}"] = ref.rel_err(local, summed.index_select(0, native))
    rows = torch.tensor([ep_layer.last_expert_tokens], dtype=torch.float64, device=device)
    all_rows = [torch.zeros_like(rows) for _ in range(world)]
    dist.all_gather(all_rows, rows)
    per_gpu = torch.cat(all_rows)
    return {"mesh": [nodes, world // nodes], "max_rel_err": errs, "fills": len(ep_layer.last_fills),
            "expert_rows_per_gpu": per_gpu.tolist(), "imbalance_max_over_mean": float(per_gpu.max() / per_gpu.mean()),
            "placement": ep_layer.placement_cpu.tolist()}


def _worker(rank: int, world: int, port: int, out_dir: str, seed: int, device_type: str) -> None:
    import torch.distributed as dist

    os.environ["RELIBRA_OPS_AUTOTUNE"] = "0"  # one tile config: no autotuning in every rank
    result: dict = {"rank": rank}
    try:
        if device_type == "cuda":
            torch.cuda.set_device(rank)
        torch.set_num_threads(1)
        dist.init_process_group("cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        result.update(ok=True, **_step(rank, world, seed, device_type))
    except Exception as e:
        result.update(ok=False, error=f"{type(e).__name__}: {e}"[:3000], traceback=traceback.format_exc()[-4000:])
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, default=str))
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, seed: int, device_type: str = "cuda") -> dict:
    """Run the EP check on ``world`` ranks; ``device_type="cpu"`` runs it on gloo with tiny
    shapes (how the CPU test suite checks this check). Raises AssertionError on failure."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="relibra-gpu-check-ep-") as tmp:
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, tmp, seed, device_type),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + TIME_LIMIT_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        results = {}
        for r in range(world):
            f = Path(tmp, f"rank{r}.json")
            results[r] = json.loads(f.read_text()) if f.exists() else {"ok": False, "error": "no result"}
    if hung:
        raise AssertionError(f"ranks {hung} still running after {TIME_LIMIT_S:.0f} s (killed); "
                             f"others: {[results[r].get('error') for r in results if r not in hung]}")
    failed = {r: v.get("error") for r, v in results.items() if not v.get("ok")}
    if failed:
        raise AssertionError(f"ranks failed: {failed}; rank 0 traceback: {results[0].get('traceback', '')[-1500:]}")
    bad = {r: {k: e for k, e in v["max_rel_err"].items() if not e <= TOL} for r, v in results.items()}
    bad = {r: v for r, v in bad.items() if v}
    if bad:
        raise AssertionError(f"EP result differs from the one-process layer (relative error > {TOL:g}): {bad}")
    return {"ranks": world, **{k: results[0][k] for k in ("mesh", "fills", "expert_rows_per_gpu",
                                                          "imbalance_max_over_mean", "placement")},
            "max_rel_err": {k: max(v["max_rel_err"][k] for v in results.values()) for k in results[0]["max_rel_err"]}}


def run(report: Report, seed: int) -> None:
    def check():
        world = torch.cuda.device_count()
        if world < 2:
            raise Skip(f"{world} visible GPU: expert parallelism needs at least 2")
        return run_ranks(world, seed)

    report.check(PART, "ReplayBalancedMoE planned by ReplayBalancer (relibra) over NCCL on every GPU vs one process",
                 check)
