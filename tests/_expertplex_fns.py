"""Rank functions of the ExpertPlex runtime tests (module level: they run in spawned ranks)."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import tiny_lm  # noqa: E402

from relibra_torch.serving.runtime.attention import ExpertClient, split_attention  # noqa: E402
from relibra_torch.serving.runtime.driver import run_decode, run_prefill  # noqa: E402
from relibra_torch.serving.runtime.expert import ExpertServer, ExpertWeights  # noqa: E402
from relibra_torch.serving.runtime.mesh import DECODE, PREFILL  # noqa: E402
from relibra_torch.serving.runtime.transport import CLOSED, STAT_TILES, Backoff, wait_until  # noqa: E402

CFG = tiny_lm.TinyLMConfig()


def make_model(seed: int = 0) -> tiny_lm.TinyMoELM:
    torch.manual_seed(seed)
    return tiny_lm.TinyMoELM(CFG).eval()


def serve_role(mesh, transport, kv, plan, opts, rank=None):
    """One rank of the mesh: expert server, prefill or decode attention, by its rank."""
    rank = dist.get_rank() if rank is None else rank
    role, index = mesh.role(rank)
    torch.set_num_threads(1)
    backoff = Backoff(initial_s=50e-6, max_s=2e-3)
    if role == "expert":
        server = ExpertServer(mesh, transport.expert(index), ExpertWeights.from_model(make_model(), mesh, index),
                              tile_m=opts.get("tile_m", 4), source_timeout_s=opts.get("source_timeout_s", 60.0),
                              min_tile_s=opts.get("min_tile_s", 0.0), backoff=backoff)
        return role, server.serve(max_seconds=opts.get("max_seconds", 120.0))
    phase = PREFILL if role == "prefill" else DECODE
    client = ExpertClient(mesh, transport, phase, index, timeout_s=opts.get("timeout_s", 60.0), backoff=backoff)
    model = split_attention(make_model(), client)
    try:
        go = opts.get("go")  # shared int64 [1]: the decode rank is up (blocking test)
        if role == "prefill":
            if opts.get("die_mid_step") == index:
                _die_mid_step(model, client, plan["prefill"][index])
            while go is not None and index == 0 and not int(go[0]):
                time.sleep(1e-3)
            log = run_prefill(model, kv, plan["prefill"][index])
        else:
            if go is not None and index == 0:
                go[0] = 1
                # start decoding only once the expert ranks are busy on the prefill
                for r in range(mesh.expert_ranks):
                    stats = transport.expert(r).stats_W
                    while int(stats[STAT_TILES + PREFILL]) < opts["wait_for_prefill_tiles"]:
                        time.sleep(1e-3)
            if opts.get("decode_after_close"):
                # decode only after the expert rank closed the dead prefill rank's mailbox:
                # the other phase goes on after the failure
                flags = transport.expert(0).flags_MW
                wait_until(lambda: bool(int(flags[mesh.mailbox(PREFILL, 0), CLOSED])), 60.0,
                           lambda: "the expert rank closing the dead prefill rank's mailbox", backoff)
            log = run_decode(model, kv, plan["decode"][index], backoff=backoff)
    finally:
        if not (role == "prefill" and opts.get("die_mid_step") == index):
            client.finish()
    return role, {"logits": log.logits, "steps": log.steps, "events": client.events}


def _die_mid_step(model, client, batches):
    """Send layer 0 of a prefill step, read its answer, then exit without a word."""
    moe = model.blocks[0].moe
    r = batches[0][0]
    tokens = torch.tensor(r.prompt)
    pos = torch.arange(len(r.prompt))
    x = model.tok_emb(tokens) + model.pos_emb(pos)
    h = model.blocks[0].norm2(x)
    moe(h)  # layer 0 goes through the expert ranks; layer 1 never comes
    os._exit(3)


def spawned_role(mesh, transport, kv, plan, opts, rank, results):
    """The raw-process variant (a rank that dies cannot run in a RankPool): result to a queue."""
    try:
        results.put((rank, "ok", serve_role(mesh, transport, kv, plan, opts, rank=rank)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", f"{type(e).__name__}: {e}"))
