"""ExpertPlex runtime on CPU processes: the split tiny LM against the one-process model,
no cross-phase blocking by event count, failures, malformed buffers, the transport.

Multi-process tests: one mesh of 2 prefill + 2 decode attention ranks and 2 expert ranks
(RankPool, gloo ranks that never use gloo in the data path), also used for the blocking
count; raw spawned processes for a rank that dies. Measured: ~90 s wall on
2 cores under a load average of ~16 (about 30 s of CPU), almost all of it process start-up;
the serving itself takes about a second.

Legend: T tokens, V vocabulary, D dim, E experts.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
import torch.multiprocessing as mp

import _expertplex_fns as fns
from relibra_torch.serving.runtime import symm
from relibra_torch.serving.runtime.attention import ExpertClient, ExpertRefused, split_attention
from relibra_torch.serving.runtime.driver import Request
from relibra_torch.serving.runtime.expert import ExpertServer, ExpertWeights
from relibra_torch.serving.runtime.kv import KVHandoff
from relibra_torch.serving.runtime.mesh import DECODE, PREFILL, ServingMesh
from relibra_torch.serving.runtime.transport import (ERRCODE, ERROR, LAYER, READY, ROWS, ShmTransport,
                                                     TransportTimeout)
from relibra_torch.testing import RankPool

CFG = fns.CFG
HEADS, HEAD_DIM = CFG.n_heads, CFG.dim // CFG.n_heads


def _mesh(p, d, x, dcap=32, pcap=160):
    return ServingMesh(prefill_ranks=p, decode_ranks=d, expert_ranks=x, num_experts=CFG.num_experts,
                       num_layers=CFG.n_layers, dim=CFG.dim, hidden_dim=CFG.hidden_dim,
                       decode_capacity=dcap, prefill_capacity=pcap)


def _requests(n, seed, max_prompt=9, max_cont=8):
    rng = random.Random(seed)
    out = []
    for rid in range(n):
        p = rng.randint(2, max_prompt)
        c = rng.randint(1, max_cont)
        out.append(Request(rid, tuple(rng.randrange(CFG.vocab_size) for _ in range(p)),
                           tuple(rng.randrange(CFG.vocab_size) for _ in range(c))))
    return out


def _reference(requests):
    model = fns.make_model()
    out = {}
    with torch.no_grad():
        for r in requests:
            seq = list(r.prompt) + list(r.continuation)
            logits = model(torch.tensor(seq), torch.zeros(len(seq), dtype=torch.int64), torch.arange(len(seq)))
            out[r.rid] = (logits[:len(r.prompt)], logits[len(r.prompt):])
    return out


@pytest.fixture(scope="module")
def pool6():
    # one pool of 2 prefill + 2 decode + 2 expert ranks for both RankPool tests: process
    # start-up is most of their time on a loaded machine
    with RankPool(_mesh(2, 2, 2).world_size, timeout_s=300) as pool:
        yield pool


def test_split_model_on_six_processes_matches_the_one_process_model(pool6):
    # 2 prefill + 2 decode attention ranks, 2 expert ranks; requests join and leave the decode
    # batches between steps (different lengths, prompts arriving batch by batch)
    mesh = _mesh(2, 2, 2)
    reqs = _requests(12, seed=1)
    transport = ShmTransport(mesh)
    kv = KVHandoff(len(reqs), CFG.n_layers, CFG.max_len, HEADS, HEAD_DIM)
    plan = {"prefill": [[reqs[0:2], reqs[4:7], reqs[10:11]], [reqs[2:4], reqs[7:10], reqs[11:12]]],
            "decode": [reqs[0::2], reqs[1::2]]}
    results = pool6.run(fns.serve_role, mesh, transport, kv, plan, {"tile_m": 4})
    ref = _reference(reqs)
    seen_prefill, seen_decode, memberships = set(), set(), []
    for role, out in results:
        if role == "expert":
            assert out["errors"] == [] and out["tiles"][0] > 0 and out["tiles"][1] > 0, out
            continue
        for rid, logits in out["logits"].items():
            want = ref[rid][0] if role == "prefill" else ref[rid][1]
            torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)
            (seen_prefill if role == "prefill" else seen_decode).add(rid)
        if role == "decode":
            memberships.append(out["steps"])
    assert seen_prefill == seen_decode == set(range(len(reqs)))
    for steps in memberships:  # the batch changed between steps: joins and leaves
        assert len({tuple(s) for s in steps}) > 2 and max(map(len, steps)) > 1


def test_a_decode_request_waits_for_at_most_one_prefill_tile(pool6):
    # the expert ranks are busy on a long prefill (tile_m 2, 2 ms per tile) when the decode
    # rank starts; every decode request is done after at most the prefill tile that was in
    # flight when it raised READY: an event count, not a wall time
    mesh = _mesh(2, 2, 2, dcap=16, pcap=640)
    long_prompts = [Request(i, tuple((7 * i + j) % CFG.vocab_size for j in range(20)), (1,)) for i in range(16)]
    dec = [Request(20 + i, r.prompt, r.continuation) for i, r in enumerate(_requests(3, seed=5, max_prompt=3, max_cont=4))]
    kv = KVHandoff(23, CFG.n_layers, CFG.max_len, HEADS, HEAD_DIM)
    m = fns.make_model()
    for r in dec:  # their prompts were prefilled earlier (by the one-process model)
        cache = m.new_cache()
        with torch.no_grad():
            m(torch.tensor(r.prompt), torch.full((len(r.prompt),), r.rid), torch.arange(len(r.prompt)), cache=cache)
        kv.put(cache, r.rid, r.rid)
    transport = ShmTransport(mesh)
    plan = {"prefill": [[long_prompts], []], "decode": [dec, []]}
    opts = {"tile_m": 2, "min_tile_s": 2e-3, "wait_for_prefill_tiles": 3, "go": torch.zeros(1, dtype=torch.int64)
            .share_memory_()}
    results = pool6.run(fns.serve_role, mesh, transport, kv, plan, opts)
    decode = results[mesh.rank_of("decode", 0)][1]
    totals = [results[mesh.rank_of("expert", x)][1]["tiles"][PREFILL] for x in range(2)]
    events = decode["events"]
    # every layer of every step reached one or both expert ranks
    assert CFG.n_layers * len(decode["steps"]) <= len(events) <= 2 * CFG.n_layers * len(decode["steps"])
    assert {r for r, *_ in events} == {0, 1}
    for r, layer, at_ready, at_done in events:
        assert at_done[PREFILL] - at_ready[PREFILL] <= 1, (r, layer, at_ready, at_done)
    # ... while the prefill was still running: it had tiles left when the last decode was done
    for x in range(2):
        last = max(at_done[PREFILL] for r, _, _, at_done in events if r == x)
        assert last < totals[x], (x, last, totals)
    ref = _reference(dec)
    for rid, logits in decode["logits"].items():
        torch.testing.assert_close(logits, ref[rid][1], rtol=0, atol=1e-5)


def test_a_prefill_rank_that_dies_mid_step_does_not_wedge_the_expert_rank():
    mesh = _mesh(1, 1, 1)
    dec = _requests(2, seed=7)
    pre = [Request(5, (1, 2, 3, 4), (1,))]
    kv = KVHandoff(6, CFG.n_layers, CFG.max_len, HEADS, HEAD_DIM)
    for r in dec:
        m = fns.make_model()
        cache = m.new_cache()
        with torch.no_grad():
            m(torch.tensor(r.prompt), torch.full((len(r.prompt),), r.rid), torch.arange(len(r.prompt)), cache=cache)
        kv.put(cache, r.rid, r.rid)
    transport = ShmTransport(mesh)
    plan = {"prefill": [[pre]], "decode": [dec]}
    opts = {"die_mid_step": 0, "source_timeout_s": 1.5, "max_seconds": 90.0, "decode_after_close": True}
    # the expert rank and the prefill rank are spawned processes (a rank that dies cannot run
    # in a RankPool); the decode rank runs here, in the test process
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    expert_rank, prefill_rank = mesh.rank_of("expert", 0), mesh.rank_of("prefill", 0)
    procs = {rank: ctx.Process(target=fns.spawned_role, args=(mesh, transport, kv, plan, opts, rank, results),
                               daemon=True) for rank in (prefill_rank, expert_rank)}
    for p in procs.values():
        p.start()
    try:
        role, decoded = fns.serve_role(mesh, transport, kv, plan, opts, rank=mesh.rank_of("decode", 0))
        rank, status, payload = results.get(timeout=120)
    finally:
        for p in procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert procs[prefill_rank].exitcode == 3 and role == "decode"
    assert (rank, status) == (expert_rank, "ok"), payload
    expert = payload[1]
    assert len(expert["errors"]) == 1, expert
    assert "source (prefill, 0) stopped mid-step" in expert["errors"][0] and "others go on" in expert["errors"][0]
    ref = _reference(dec)
    for rid, logits in decoded["logits"].items():
        torch.testing.assert_close(logits, ref[rid][1], rtol=0, atol=1e-5)


# ---------------------------------------------------------------- one process


def _server(mesh, transport, **kw):
    return ExpertServer(mesh, transport.expert(0), ExpertWeights.from_model(fns.make_model(), mesh, 0), **kw)


def test_malformed_buffers_are_refused_with_a_reason():
    mesh = _mesh(1, 1, 1)
    transport = ShmTransport(mesh)
    server = _server(mesh, transport)
    b = transport.expert(0)
    m = mesh.mailbox(PREFILL, 0)
    cases = [  # (layer, rows, counts) -> error code
        ((5, 3, [3] + [0] * 7), 1), ((0, 161, [161] + [0] * 7), 2), ((0, 3, [4, -1] + [0] * 6), 3),
        ((1, 3, [1, 1] + [0] * 6), 4)]
    for seq, ((layer, rows, counts), code) in enumerate(cases, start=1):
        b.set_flag(m, LAYER, layer)
        b.set_flag(m, ROWS, rows)
        b.counts_ME[m] = torch.tensor(counts)
        b.set_flag(m, READY, seq)
        assert server.check() == 0
        assert (b.flag(m, ERROR), b.flag(m, ERRCODE)) == (seq, code)
    b.set_flag(m, READY, 9)  # skipped sequence numbers
    server.check()
    assert b.flag(m, ERRCODE) == 6
    # the client turns a refusal into an error naming it, and checks its own sizes
    client = ExpertClient(mesh, transport, PREFILL, 0, timeout_s=5)
    client.seq[0] = 9
    client.send(0, 7, torch.zeros(2, CFG.dim), torch.tensor([2] + [0] * 7))
    server.check()
    with pytest.raises(ExpertRefused, match="refused prefill rank 0's request 10: layer out of range"):
        client.receive(0, 2)
    with pytest.raises(ValueError, match="allowed: the mailbox capacity prefill_capacity = 160"):
        client.send(0, 0, torch.zeros(161, CFG.dim), torch.tensor([161] + [0] * 7))
    remote = split_attention(fns.make_model(), client).blocks[0].moe
    with pytest.raises(ValueError, match="routed_experts has ids in \\[0, 8\\]; allowed: \\[0, num_experts=8\\)"):
        remote(torch.zeros(1, CFG.dim), torch.tensor([[8, 0]]))
    with pytest.raises(ValueError, match="routed_experts has -1 pads"):
        remote(torch.zeros(1, CFG.dim), torch.tensor([[-1, 0]]))


def test_a_silent_expert_rank_times_out_with_a_clear_error():
    mesh = _mesh(0, 1, 1)
    client = ExpertClient(mesh, ShmTransport(mesh), DECODE, 0, timeout_s=0.2)
    client.send(0, 0, torch.zeros(1, CFG.dim), torch.tensor([1] + [0] * 7))
    with pytest.raises(TransportTimeout, match="decode rank 0: waiting for expert rank 0's DONE of request 1 "
                                               "\\(layer 0\\).*is expert rank 0 alive"):
        client.receive(0, 1)


@pytest.mark.parametrize("executor", ["tiles", "triton"])
def test_one_grouped_gemm_takes_both_phases_decode_first(executor):
    # a decode request (layer 1) and a prefill request (layer 0) wait together: one check
    # takes both; the tile executor runs every decode tile before any prefill tile, the
    # triton executor runs both tables in one persistent launch per GEMM (interpreter)
    mesh = _mesh(1, 1, 1)
    transport = ShmTransport(mesh)
    server = _server(mesh, transport, tile_m=4, executor=executor)
    g = torch.Generator().manual_seed(0)
    sends = {DECODE: (1, [1, 0, 2, 0, 0, 3, 0, 1]), PREFILL: (0, [9, 0, 4, 13, 0, 0, 7, 2])}
    clients, xs = {}, {}
    for phase, (layer, counts) in sends.items():
        clients[phase] = ExpertClient(mesh, transport, phase, 0, timeout_s=5)
        xs[phase] = torch.randn(sum(counts), CFG.dim, generator=g)
        clients[phase].send(0, layer, xs[phase], torch.tensor(counts))
    assert server.check() == 2
    n_dec = len(server.tables[DECODE])
    assert n_dec == 4 and len(server.tables[PREFILL]) == 3 + 1 + 4 + 2 + 1
    if executor == "tiles":
        for _ in range(n_dec):
            server.run_tile()
        assert transport.expert(0).stats_W[:2].tolist() == [4, 0]  # decode done, no prefill tile yet
    while server.run_tile():
        pass
    assert transport.expert(0).stats_W[:2].tolist() == [4, 11]
    w = server.w
    for phase, (layer, counts) in sends.items():
        y = clients[phase].receive(0, xs[phase].shape[0])
        start = 0
        for e, n in enumerate(counts):
            gi = layer * mesh.experts_per_rank + e
            x = xs[phase][start:start + n].double()
            want = (torch.nn.functional.silu(x @ w.w1_GFD[gi].double().T) * (x @ w.w3_GFD[gi].double().T)
                    ) @ w.w2_GDF[gi].double().T
            torch.testing.assert_close(y[start:start + n].double(), want, rtol=0, atol=1e-6)
            start += n


@pytest.mark.parametrize("executor", ["tiles", "triton"])
def test_split_model_in_one_process_matches(executor):
    # the expert loop in a thread, one decode and one prefill forward through it
    mesh = _mesh(1, 1, 1)
    transport = ShmTransport(mesh)
    server = _server(mesh, transport, tile_m=4, executor=executor)
    thread = threading.Thread(target=server.serve, kwargs={"max_seconds": 60}, daemon=True)
    thread.start()
    dec = ExpertClient(mesh, transport, DECODE, 0, timeout_s=30)
    pre = ExpertClient(mesh, transport, PREFILL, 0, timeout_s=30)
    ref = fns.make_model()
    try:
        for client, n in ((dec, 3), (pre, 11)):
            model = split_attention(fns.make_model(), client)
            tokens = torch.arange(n) % CFG.vocab_size
            with torch.no_grad():
                got = model(tokens, torch.zeros(n, dtype=torch.int64), torch.arange(n))
                want = ref(tokens, torch.zeros(n, dtype=torch.int64), torch.arange(n))
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    finally:
        dec.finish()
        pre.finish()
        thread.join(timeout=60)
    assert not thread.is_alive() and server.errors == []


def test_symmetric_memory_backend_imports_and_refuses_cleanly_without_cuda():
    ok, why = symm.available()
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the symmetric-memory transport needs a multi-GPU run, not this CPU test")
    assert not ok and "no CUDA device" in why
    with pytest.raises(RuntimeError, match="SymmMemTransport: no CUDA device.*use ShmTransport on CPU"):
        symm.SymmMemTransport(_mesh(1, 1, 1))
    parts, total = symm.layout(_mesh(1, 1, 1), torch.bfloat16)
    offsets = [off for *_, off in parts]
    assert offsets == sorted(offsets) and all(off % 256 == 0 for off in offsets) and total % 256 == 0


def test_mesh_roles_and_mailboxes():
    mesh = _mesh(2, 3, 2)
    assert [mesh.role(r) for r in range(7)] == [("prefill", 0), ("prefill", 1), ("decode", 0), ("decode", 1),
                                                ("decode", 2), ("expert", 0), ("expert", 1)]
    assert [mesh.row_base(m) for m in range(5)] == [0, 32, 64, 96, 256] and mesh.rows == 416
    assert mesh.mailbox(PREFILL, 1) == 4 and mesh.phase_of(4) == (PREFILL, 1)
    assert mesh.expert_rank_of(3) == 0 and mesh.expert_rank_of(4) == 1
    with pytest.raises(ValueError, match="num_experts = 8 is not divisible by expert_ranks = 3"):
        _mesh(1, 1, 3)
