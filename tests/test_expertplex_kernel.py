"""ExpertPlex's persistent two-phase grouped GEMM (relibra_torch.ops.persistent_gemm).

* numerics in the Triton interpreter with both tile tables filled before launch, against
  the fp64 oracle of relibra_torch.ops (plain and SwiGLU-gated, fp32/fp16/bf16, empty
  phases, decode shares 0..P); small shapes, tiles of 16 (each case well under a second);
* the tables against the tile-footprint rule of relibra_torch.serving.tiles;
* the claim rule and its worst-case preemption delay in the pure-Python event model
  (relibra_torch.serving.runtime.claims) run on the same tables;
* the decode-share rule.

Shape legend: R rows, K reduction dim, N output columns, E experts, n tiles.
"""

from __future__ import annotations

import math
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from relibra_torch.ops import oracle  # noqa: E402
from relibra_torch.ops import persistent_gemm as pg  # noqa: E402
from relibra_torch.serving.runtime.claims import DECODE, PREFILL, simulate_claims  # noqa: E402
from relibra_torch.serving.runtime.share import decode_programs  # noqa: E402
from relibra_torch.serving.tiles import tile_footprint  # noqa: E402

HYP = dict(deadline=None, derandomize=True, print_blob=True)
TM = TN = TK = 16


def _case(dec, pre, K, N, dtype, seed, extra_rows=3):
    g = torch.Generator().manual_seed(seed)
    dec, pre = torch.tensor(dec), torch.tensor(pre)
    R = int(dec.sum() + pre.sum()) + extra_rows
    E = dec.numel()
    x = torch.randn(R, K, generator=g).to(dtype)
    w1 = torch.randn(E, K, N, generator=g).to(dtype)
    w3 = torch.randn(E, K, N, generator=g).to(dtype)
    td = pg.tile_table(dec, tile_m=TM, n_cols=N, tile_n=TN)
    tp = pg.tile_table(pre, tile_m=TM, n_cols=N, tile_n=TN, row_base=int(dec.sum()))
    offs = torch.cat([dec, pre]).cumsum(0).to(torch.int32)
    s2w = torch.cat([torch.arange(E), torch.arange(E)])
    return x, w1, w3, td, tp, offs, s2w


@pytest.mark.parametrize("dtype,gated,programs,share", [
    (torch.float32, False, 3, 1), (torch.float32, True, 2, 2), (torch.bfloat16, False, 3, 0),
    (torch.bfloat16, True, 1, 1), (torch.float16, False, 4, 2),
])
def test_both_tables_match_the_fp64_oracle(dtype, gated, programs, share):
    x, w1, w3, td, tp, offs, s2w = _case([3, 0, 17, 1], [20, 5, 0, 13], 24, 20, dtype, seed=programs + share)
    y = pg.two_phase_grouped_mm(x, w1, td, tp, tile_m=TM, tile_n=TN, tile_k=TK, programs=programs,
                                decode_programs=share, w3_GKN=w3 if gated else None)
    ex1, b1 = oracle.grouped_mm(x, w1, offs, s2w)
    if not gated:
        oracle.check_within(y, ex1, b1, dtype, "two-phase grouped GEMM")
        return
    ex3, b3 = oracle.grouped_mm(x, w3, offs, s2w)
    exact = F.silu(ex1) * ex3
    # silu' is within [-0.1, 1.1]: first-order propagation of each GEMM's bound, plus the
    # rounding of the product itself
    bound = 1.1 * b1 * ex3.abs() + F.silu(ex1).abs() * b3 + exact.abs()
    oracle.check_within(y, exact, bound, dtype, "two-phase gated grouped GEMM")


def test_an_empty_phase_and_rows_outside_every_tile():
    x, w1, _, td, tp, offs, s2w = _case([0, 0], [21, 2], 16, 20, torch.float32, seed=1)
    assert td.shape == (0, 4)
    y = pg.two_phase_grouped_mm(x, w1, td, tp, tile_m=TM, tile_n=TN, tile_k=TK, programs=2, decode_programs=1)
    ex, b = oracle.grouped_mm(x, w1, offs, s2w)
    oracle.check_within(y, ex, b, torch.float32, "prefill only")
    assert torch.equal(y[-3:], torch.zeros(3, 20))  # rows no tile covers stay as given (zeros)
    ctrl = pg.control_words(0, tp.shape[0])
    x2, w2, _, td2, tp2, offs2, s2w2 = _case([5, 9], [0, 0], 16, 20, torch.float32, seed=2)
    y2 = pg.two_phase_grouped_mm(x2, w2, td2, tp2, tile_m=TM, tile_n=TN, tile_k=TK, programs=1,
                                 decode_programs=0, control=pg.control_words(td2.shape[0], 0))
    ex2, b2 = oracle.grouped_mm(x2, w2, offs2, s2w2)
    oracle.check_within(y2, ex2, b2, torch.float32, "decode only, taken by a prefill-first program")
    assert ctrl.tolist()[2:5] == [0, tp.shape[0], 1]


def test_the_control_block_counts_every_tile_once():
    x, w1, _, td, tp, _, _ = _case([7, 30], [33, 1], 16, 20, torch.float32, seed=3)
    ctrl = pg.control_words(td.shape[0], tp.shape[0])
    pg.two_phase_grouped_mm(x, w1, td, tp, tile_m=TM, tile_n=TN, tile_k=TK, programs=3, decode_programs=1,
                            control=ctrl)
    claimed_d, tickets_p, pub_d, pub_p, closed, done_d, done_p, idle = ctrl.tolist()
    assert (claimed_d, done_d, done_p, idle) == (td.shape[0], td.shape[0], tp.shape[0], 0)
    # every prefill tile had a ticket; at most one ticket per program was left unserved
    assert tp.shape[0] <= tickets_p <= tp.shape[0] + 3


def test_an_unpublished_table_is_never_claimed_and_idle_programs_leave():
    x, w1, _, td, tp, offs, s2w = _case([4, 4], [20, 3], 16, 16, torch.float32, seed=4)
    ctrl = pg.control_words(0, tp.shape[0], closed=False)  # decode entries written, not published
    y = pg.two_phase_grouped_mm(x, w1, td, tp, tile_m=TM, tile_n=TN, tile_k=TK, programs=2, decode_programs=1,
                                control=ctrl, max_idle_polls=3)
    assert torch.equal(y[:8], torch.zeros(8, 16))  # decode rows untouched
    # no decode tile claimed; both programs timed out
    assert ctrl.tolist()[0] == 0 and ctrl.tolist()[5:8] == [0, tp.shape[0], 2]
    # publishing the decode table (and closing) lets the next launch take exactly those
    # tiles (its programs' prefill tickets are past the prefill count: nothing is redone)
    pg.publish(ctrl, pg.DECODE, td.shape[0], close=True)
    assert ctrl.tolist()[2:5] == [td.shape[0], tp.shape[0], 1]
    pg.two_phase_grouped_mm(x, w1, td, tp, tile_m=TM, tile_n=TN, tile_k=TK, programs=2, decode_programs=1,
                            control=ctrl, y_RN=y)
    ex, b = oracle.grouped_mm(x, w1, offs, s2w)
    oracle.check_within(y, ex, b, torch.float32, "decode published after a first launch")
    pg.wait_done(ctrl, pg.DECODE, td.shape[0], max_polls=1)  # returns: every decode tile is done
    assert ctrl.tolist()[5:7] == [td.shape[0], tp.shape[0]]


def test_malformed_tables_are_rejected():
    x, w1, _, td, tp, _, _ = _case([4, 4], [20, 3], 16, 16, torch.float32, seed=5)
    bad = tp.clone()
    bad[0, 0] = 7
    with pytest.raises(ValueError, match="prefill_table row 0 .* weight in \\[0, 2\\)"):
        pg.two_phase_grouped_mm(x, w1, td, bad, tile_m=TM, tile_n=TN, programs=1, decode_programs=0)
    bad = td.clone()
    bad[1, 2] = x.shape[0] + 1
    with pytest.raises(ValueError, match="decode_table row 1"):
        pg.two_phase_grouped_mm(x, w1, bad, tp, tile_m=TM, tile_n=TN, programs=1, decode_programs=0)
    with pytest.raises(ValueError, match="decode_programs = 3"):
        pg.two_phase_grouped_mm(x, w1, td, tp, tile_m=TM, tile_n=TN, programs=2, decode_programs=3)
    with pytest.raises(ValueError, match="allowed: \\[n, 4\\]"):
        pg.two_phase_grouped_mm(x, w1, td[:, :3].contiguous(), tp, tile_m=TM, tile_n=TN, programs=1,
                                decode_programs=0)
    with pytest.raises(ValueError, match="rows_E has a negative"):
        pg.tile_table(torch.tensor([3, -1]), tile_m=16, n_cols=4, tile_n=4)


@settings(max_examples=25, **HYP)
@given(rows=st.lists(st.integers(0, 70), min_size=1, max_size=9), tm=st.integers(1, 33),
       n=st.integers(1, 50), tn=st.integers(1, 20), base=st.integers(0, 5))
def test_tables_follow_the_tile_footprint(rows, tm, n, tn, base):
    rows_E = torch.tensor(rows)
    tab = pg.tile_table(rows_E, tile_m=tm, n_cols=n, tile_n=tn, row_base=base)
    assert tab.shape[0] == int(tile_footprint(rows_E, tm)) * math.ceil(n / tn)
    # every (row, column block) covered exactly once, inside its expert's rows
    cover = torch.zeros(base + sum(rows), math.ceil(n / tn), dtype=torch.int64)
    ends = torch.tensor(rows).cumsum(0) + base
    for g, r0, r1, nb in tab.tolist():
        assert ends[g] - rows[g] <= r0 < r1 <= ends[g] and r1 - r0 <= tm
        cover[r0:r1, nb] += 1
    assert bool((cover[base:] == 1).all()) and bool((cover[:base] == 0).all())


# ------------------------------------------------------------------- event model


@st.composite
def claim_cases(draw):
    P = draw(st.integers(1, 8))
    share = draw(st.integers(1, P))
    dec = draw(st.lists(st.floats(0.1, 3.0), min_size=1, max_size=30))
    pre = draw(st.lists(st.floats(0.1, 25.0), min_size=0, max_size=120))
    check = draw(st.floats(0.01, 1.0))
    at = draw(st.floats(0.0, 60.0))
    return P, share, dec, pre, check, at


@settings(max_examples=150, **HYP)
@given(case=claim_cases())
def test_event_model_bounds_the_preemption_delay_by_one_tile_plus_one_check(case):
    P, share, dec, pre, check, at = case
    trace = simulate_claims(dec, pre, programs=P, decode_programs=share, check=check, decode_published_at=at)
    # every tile exactly once, never before its table is published
    for ph, costs in ((DECODE, dec), (PREFILL, pre)):
        assert sorted(c.tile for c in trace.phase(ph)) == list(range(len(costs)))
        assert all(c.start >= trace.published[ph] for c in trace.phase(ph))
    longest = max(pre + dec)
    # the worst case: every decode-first program began its longest tile just before `at`
    assert trace.first_start(DECODE) <= at + longest + check + 1e-9
    # and the decode share then runs the decode table back to back
    rounds = math.ceil(len(dec) / share)
    assert trace.end(DECODE) <= at + longest + check + rounds * (max(dec) + check) + 1e-9
    # a program inside the share never starts a prefill tile while a published decode tile waits
    for c in trace.phase(PREFILL):
        if c.program < share and c.start >= at:
            later = [d for d in trace.phase(DECODE) if d.start > c.start]
            assert not later, (c, later[:1])


def test_event_model_reaches_the_bound_and_shares_split_the_work():
    # P = 2, share 1: program 0 starts a 10-unit prefill tile at t = 0.5, decode is published
    # at 0.6: its first decode tile starts at 0.5 + 10 + 0.5 (one tile plus one check).
    trace = simulate_claims([1.0], [10.0] * 4, programs=2, decode_programs=1, check=0.5, decode_published_at=0.6)
    assert trace.first_start(DECODE) == pytest.approx(11.0)
    first = trace.phase(DECODE)[0]
    assert first.program in (0, 1)
    # no share: decode waits for the whole prefill table (the head-of-line blocking it removes)
    none = simulate_claims([1.0], [10.0] * 4, programs=2, decode_programs=0, check=0.5, decode_published_at=0.6)
    assert none.first_start(DECODE) == pytest.approx(2 * (10.0 + 0.5) + 0.5)
    # decode tiles from a prefill table of the same tables: costs by rows / tile_m
    tp = pg.tile_table(torch.tensor([64, 3]), tile_m=16, n_cols=32, tile_n=16)
    cost = [(r1 - r0) / 16 for _, r0, r1, _ in tp.tolist()]
    tr = simulate_claims([0.25] * 4, cost, programs=3, decode_programs=1, check=0.05, decode_published_at=0.3)
    assert tr.first_start(DECODE) <= 0.3 + max(cost) + 0.05


def test_decode_share_rule():
    assert decode_programs(132, 0, 500) == 0
    assert decode_programs(132, 8, 0) == 132
    assert decode_programs(132, 8, 512) == 3  # ceil(132 * 8 / 520)
    assert decode_programs(132, 1, 10_000) == 1 and decode_programs(132, 1, 10_000, minimum=4) == 4
    assert decode_programs(4, 100, 1) == 4
    with pytest.raises(ValueError, match="programs = 0"):
        decode_programs(0, 1, 1)


@settings(max_examples=60, **HYP)
@given(P=st.integers(1, 200), d=st.integers(0, 1000), p=st.integers(0, 1000), m=st.integers(0, 8))
def test_decode_share_is_monotone_and_bounded(P, d, p, m):
    s = decode_programs(P, d, p, m)
    assert 0 <= s <= P and (s == 0) == (d == 0)
    assert decode_programs(P, d + 1, p, m) >= s
    if d:
        assert decode_programs(P, d, p + 1, m) <= s
