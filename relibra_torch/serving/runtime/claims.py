"""A pure-Python event model of the two-phase claim rule of the persistent grouped GEMM.

It runs the rule of :mod:`relibra_torch.ops.persistent_gemm` on the same tile tables, with a
time per tile and a time per check (``check``), and records every claim: which program took
which tile of which phase, when it started and ended. A program repeatedly checks (the check
takes ``check`` time and sees what is published at its end) and claims a tile of its first
phase (decode for programs ``pid < decode_programs``, else prefill), else one of its other
phase, and computes it; it leaves once both claims fail and the run is closed. Decode is
claimed as the kernel's compare-and-swap does: the next published decode tile, by whichever
program checks first. Prefill is claimed by ticket: a program takes the next prefill tile
number unless it holds one, and computes that tile once it is published. Ties are broken by
program id, the order the counters serialise claims in.

Consequence shown by the tests: with ``decode_programs >= 1``, a decode table published at
``t`` starts by ``t + (longest tile in flight) + check``: the worst-case preemption delay
is one tile plus one check.

Legend: P programs, n tiles of a table.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

from ...checks import check_int, check_number

__all__ = ["Claim", "ClaimTrace", "simulate_claims"]

DECODE, PREFILL = 0, 1


@dataclass(frozen=True)
class Claim:
    """One tile computed: ``program`` took tile ``tile`` of ``phase`` at ``start`` (the end of
    its check) and finished it at ``end``."""

    program: int
    phase: int
    tile: int
    start: float
    end: float


@dataclass
class ClaimTrace:
    """Every claim in time order, plus the phases' publication times."""

    claims: list[Claim] = field(default_factory=list)
    published: tuple[float, float] = (0.0, 0.0)
    checks: int = 0

    def phase(self, phase: int) -> list[Claim]:
        return [c for c in self.claims if c.phase == phase]

    def first_start(self, phase: int) -> float | None:
        return min((c.start for c in self.phase(phase)), default=None)

    def end(self, phase: int) -> float | None:
        return max((c.end for c in self.phase(phase)), default=None)


def simulate_claims(decode_cost: Sequence[float], prefill_cost: Sequence[float], *, programs: int,
                    decode_programs: int, check: float, decode_published_at: float = 0.0,
                    prefill_published_at: float = 0.0) -> ClaimTrace:
    """Run the claim rule on two tables given each tile's compute time.

    Args:
        decode_cost, prefill_cost: time of each tile of the phase's table, in table order
            (``[n]``; e.g. ``rows / tile_m`` of each :func:`tile_table` row, or all 1).
        programs: persistent programs ``P``.
        decode_programs: programs that take decode first (``pid < decode_programs``).
        check: time of one check (reading the counters and one claim), > 0.
        decode_published_at, prefill_published_at: when each table is published (its count
            raised); the run is closed after the later of the two.
    """
    programs = check_int("programs", programs)
    check_int("decode_programs", decode_programs, 0, programs)
    check_number("check", check, 0.0, strict=True)
    costs = (list(map(float, decode_cost)), list(map(float, prefill_cost)))
    for name, cs in zip(("decode_cost", "prefill_cost"), costs):
        if any(c < 0 for c in cs):
            raise ValueError(f"{name} has a negative tile time; allowed: times >= 0")
    published = (check_number("decode_published_at", decode_published_at, 0.0),
                 check_number("prefill_published_at", prefill_published_at, 0.0))
    closed_at = max(published)
    claimed_dec = 0
    tickets_pre = 0  # next prefill ticket
    held = [-1] * programs  # each program's prefill ticket (-1: none)
    trace = ClaimTrace(published=published)
    # (time the next check ends, program): a program's claim takes effect at its check's end.
    events = [(check, p) for p in range(programs)]
    heapq.heapify(events)
    while events:
        t, p = heapq.heappop(events)
        trace.checks += 1
        # `closed` is read at the start of the check (as in the kernel, before the claims).
        closed = t - check >= closed_at
        first = DECODE if p < decode_programs else PREFILL
        got = None
        for ph in (first, 1 - first):
            if ph == DECODE:
                if t >= published[DECODE] and claimed_dec < len(costs[DECODE]):
                    got = (DECODE, claimed_dec)
                    claimed_dec += 1
                    break
                continue
            if held[p] < 0:
                held[p] = tickets_pre
                tickets_pre += 1
            if t >= published[PREFILL] and held[p] < len(costs[PREFILL]):
                got = (PREFILL, held[p])
                held[p] = -1
                break
        if got is None:
            if not closed:
                heapq.heappush(events, (t + check, p))
            continue
        ph, i = got
        end = t + costs[ph][i]
        trace.claims.append(Claim(p, ph, i, t, end))
        heapq.heappush(events, (end + check, p))
    trace.claims.sort(key=lambda c: (c.start, c.program))
    return trace
