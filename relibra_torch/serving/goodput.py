"""P90 goodput: the highest arrival rate at which >= 90% of requests meet both SLOs.

For a real trace the rate is changed by dividing every inter-arrival time by a scale factor
(``Requests.scaled``) on the grid ``2 ** (k / 32)``. A configuration's goodput is defined
on that grid by a scan that depends on its attainment at grid points alone
(:func:`goodput`: doublings from 1, then every 4th point, then every point, each upwards
until the target is missed), so it does not depend on which rates were tried before, even
where attainment is not monotone in the rate. Each system's best configuration is the
maximum of that over its configurations, found by a race whose ruling-out is exact for
that definition (branch and bound where the race does not decide), so the result does not
depend on the order of the list (:func:`best_config`).

Legend: N requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .requests import Requests
from .systems import Cluster, SystemConfig, build_engine

__all__ = ["RunMetrics", "Goodput", "at_scale", "run_config", "goodput", "best_config"]


@dataclass(frozen=True)
class RunMetrics:
    """One simulated run: per-request TTFT/TPOT (seconds) and the fraction meeting both SLOs."""

    rate: float
    ttft_N: np.ndarray
    tpot_N: np.ndarray
    attainment: float
    events: int
    aborted: bool = False
    decodes_N: np.ndarray | None = None  # bool: requests of more than one output token (TPOT defined)

    def percentiles(self, qs=(50, 90, 99)) -> dict:
        """TTFT and TPOT percentiles; TPOT over the requests that have one (None when none has)."""
        tpot = self.tpot_N if self.decodes_N is None else self.tpot_N[self.decodes_N]
        return {f"ttft_p{q}_s": float(np.percentile(self.ttft_N, q)) for q in qs} | \
               {f"tpot_p{q}_s": float(np.percentile(tpot, q)) if tpot.size else None for q in qs}


def at_scale(reqs: Requests, factor: float, cl: Cluster) -> Requests:
    """``reqs`` sped up by ``factor``, repeated back to back up to ``serving.min_trace_s``."""
    return reqs.scaled(factor, cl.consts.min_trace_s, cl.consts.max_trace_requests)


def run_config(cfg: SystemConfig, cl: Cluster, reqs: Requests, early_stop: bool = False) -> RunMetrics:
    """Simulate ``reqs`` on ``cfg`` and score them against the cluster's SLO.

    With ``early_stop`` the run ends as soon as too many requests missed the SLO for the
    attainment target to be met; the returned attainment is then an upper bound below the
    target (``aborted`` runs are never used for percentiles or plots).
    """
    c = cl.consts
    eng = build_engine(cfg, cl, reqs.arrival_N, reqs.prompt_N, reqs.output_N)
    n = len(reqs)
    if early_stop:
        eng.stop_after_misses(c.ttft_slo_s, c.tpot_slo_s, int(math.floor((1 - c.attainment) * n + 1e-9)))
    eng.run()
    if eng.aborted:
        # stopped early: attainment is at most this (below the target)
        return RunMetrics(reqs.rate, np.empty(0), np.empty(0), 1.0 - (eng.misses / n), eng.events, True)
    if np.any(eng.finished_count != 1) or np.any(eng.generated != reqs.output_N):
        raise RuntimeError(f"{cfg.system} ({cfg.label()}): a request did not finish exactly once with all "
                           f"its tokens (engine bug)")
    ttft = eng.first - reqs.arrival_N
    out = reqs.output_N
    tpot = np.where(out > 1, (eng.finish - eng.first) / np.maximum(out - 1, 1), 0.0)
    ok = (ttft <= c.ttft_slo_s + 1e-12) & (tpot <= c.tpot_slo_s + 1e-12)
    return RunMetrics(reqs.rate, ttft, tpot, float(ok.mean()), eng.events, decodes_N=out > 1)


@dataclass
class Goodput:
    """A configuration's goodput and the (rate, attainment) points its scan visited."""

    config: SystemConfig
    rate: float  # req/s, 0 when even the slowest rate tried fails
    scale: float
    metrics: RunMetrics | None
    points: list[tuple[float, float, bool]] = field(default_factory=list)  # (rate, attainment, exact)
    k: int = 0  # grid index of the scale (2 ** (k / 32)); K_UNBOUNDED / K_NONE at the ends


STEPS_PER_DOUBLING = 32  # the scale grid: 2 ** (k / 32), k an integer (2.2% apart)
# the scan's steps in grid indices, coarse to fine; each divides the one before
LEVELS = (STEPS_PER_DOUBLING, 4, 1)
MAX_DOUBLINGS = 12
K_UNBOUNDED = 10**9  # the whole trace as one burst meets the target
K_NONE = -10**9  # even 2 ** -MAX_DOUBLINGS misses it


def _scale(k: int) -> float:
    return 2.0 ** (k / STEPS_PER_DOUBLING)


class _Runs:
    """One configuration's early-stopped runs, cached by grid index: the pruning probes and
    the scan share them (a run is deterministic, so a cached verdict is the verdict)."""

    def __init__(self, cfg: SystemConfig, cl: Cluster, reqs: Requests):
        self.cfg, self.cl, self.reqs, self.runs = cfg, cl, reqs, {}

    def ok(self, k: int) -> bool:
        if k not in self.runs:
            self.runs[k] = run_config(self.cfg, self.cl, at_scale(self.reqs, _scale(k), self.cl), early_stop=True)
        return self.runs[k].attainment >= self.cl.consts.attainment


def goodput(cfg: SystemConfig, cl: Cluster, reqs: Requests, max_doublings: int = MAX_DOUBLINGS,
            _runs: _Runs | None = None) -> Goodput:
    """The configuration's goodput: the end of a hierarchical increasing scan of the grid.

    Level 32 (doublings): if ``k = 0`` meets the target, ``k = 32, 64, ...`` until one
    misses; otherwise ``k = -32, -64, ...`` down to the first that meets it (none down to
    ``-32 max_doublings``: goodput 0). Then from the last point met, every 4th grid point
    upwards until one misses (or the known miss), then every point: the goodput is the last
    point met. Equivalently: the highest k >= -32 max_doublings whose chain met the target,
    the chain of k being the doublings from 0 (below 0: k's own doubling) up to k, every
    4th point from k's doubling up to k and every point from k's 4th point up to k. It is a
    function of the configuration's attainment at grid points alone (not of any rate tried
    before), and equals the first miss of a plain increasing scan, less one, wherever
    attainment falls with rate. Past ``max_doublings`` doublings met, a burst of the whole
    trace that meets the target makes it unbounded.
    """
    r = _runs or _Runs(cfg, cl, reqs)
    path: list[int] = []

    def ok(k: int) -> bool:
        path.append(k)
        return r.ok(k)

    step = LEVELS[0]
    if ok(0):
        lo = 0
        for _ in range(max_doublings):
            if not ok(lo + step):
                break
            lo += step
        else:  # met at every doubling tried: does the whole trace as one burst meet it?
            burst = run_config(cfg, cl, reqs.scaled(math.inf), early_stop=True)
            if burst.attainment >= cl.consts.attainment:
                return Goodput(cfg, math.inf, math.inf, burst, _points(r, path), K_UNBOUNDED)
            for _ in range(4 * max_doublings):  # met at every grid point so far, not as a burst
                if not ok(lo + step):
                    break
                lo += step
            else:
                raise RuntimeError(f"{cfg.system} ({cfg.label()}): the SLO is met at every rate tried "
                                   f"but not by the burst; attainment is not monotone in the rate")
    else:
        for lo in range(-step, -step * max_doublings - 1, -step):
            if ok(lo):
                break
        else:
            return Goodput(cfg, 0.0, 0.0, None, _points(r, path), K_NONE)
    hi = lo + step  # missed (or the first doubling met below a miss)
    for s in LEVELS[1:]:
        k = lo + s
        while k < hi and ok(k):
            lo, k = k, k + s
        hi = min(hi, k)
    return Goodput(cfg, r.runs[lo].rate, _scale(lo), r.runs[lo], _points(r, path), lo)


def _points(r: _Runs, path: list[int]) -> list[tuple[float, float, bool]]:
    """The scan's points (not the pruning probes'), so they too depend on the configuration only."""
    return sorted((r.runs[k].rate, r.runs[k].attainment, not r.runs[k].aborted) for k in set(path))


def tie_key(cfg: SystemConfig) -> tuple:
    """Among equal goodputs the fewest GPUs win, then the largest knob values in knob order
    (so the engine default prefill batch cap before its quarter): a property of the
    configuration, not of its place in the list."""
    return cfg.gpus, tuple((name, -value) for name, value in cfg.knobs)


def _beats(a: Goodput, b: Goodput) -> bool:
    return a.k > b.k or (a.k == b.k and tie_key(a.config) < tie_key(b.config))


def _may_reach(r: _Runs, t: int) -> bool:
    """False only when the configuration's goodput is provably below grid index ``t``
    (``|t| <= 32 max_doublings``); the probes are cached for the scan.

    Why. Let the scan end at g >= t, lo_i be the last point met at level i (step s_i; lo_0
    the last doubling, lo_m = g), and i the coarsest level with lo_i >= t. Every multiple of
    s_i in (lo_{i-1}, lo_i] was met (for i = 0 every doubling in [0, lo_0], as t >= 1), and
    lo_{i-1} < t. Hence (a) u_i = s_i ceil(t / s_i) was met (it lies in that range), and (b)
    e_j = s_j floor(t / s_j) was met for every j <= i: e_j is a point of that range or of
    an earlier level's (lo_j >= e_j, else lo_i < lo_j + s_j <= e_j <= t). So goodput >= t
    needs, for some i, u_i met and e_j met for all j <= i; this refutes every i. For a
    configuration far below t one early-stopped run does it (e_0, the doubling at or below
    t, missed); for one close below, e_0 met, e_1 (at most 3 steps below t) and u_0 missed.

    Below the trace's own rate (t <= 0; every configuration missed k = 0 in a trace recorded
    faster than any serves it) the scan goes down the doublings to the first met, lo_0, then
    up the finer levels below lo_0 + 32. A goodput >= t then has either a doubling in
    [u_0, 0] met (lo_0 >= u_0 >= t), or lo_0 = e_0 and, within that doubling, the same chain
    as above (e_j met for j <= i and u_i met for some i): both are refuted."""
    n = len(LEVELS)
    e = [s * (t // s) for s in LEVELS]
    u = [s * -(-t // s) for s in LEVELS]
    # the first e_j that misses rules out every i >= j; each i < j then needs u_i to miss
    # (u_m = e_m = t). e_0 first: where the best is far above most configurations, one
    # missed run rules a configuration out.
    j = next((j for j in range(n) if not r.ok(e[j])), n)
    return any(r.ok(u[i]) for i in range(j)) or (t <= 0 and any(r.ok(d) for d in range(u[0], 1, LEVELS[0])))


def best_config(configs: list[SystemConfig], cl: Cluster, reqs: Requests) -> Goodput | None:
    """The configuration with the highest goodput (ties: :func:`tie_key`), for any order of
    ``configs``: ``max`` of :func:`goodput` over the list.

    A race level by level (:func:`_race`) rules out every configuration but a few
    survivors, each ruled-out one by a run it missed at a grid point <= R (so its goodput
    is below R), where R is the highest point some configuration reached. The survivors met
    R and missed R + 1; in tie order, the first whose scan confirms goodput R is the best.
    Where none does (a survivor's lower doublings miss: attainment not monotone), or where
    the race does not apply, branch and bound over all (:func:`_branch_and_bound`). Every
    run is cached per configuration, so no grid point of one is simulated twice.
    """
    runs = [_Runs(cfg, cl, reqs) for cfg in configs]
    race = _race(runs)
    if race is not None:
        survivors, R = race
        for i in sorted(survivors, key=lambda i: tie_key(configs[i])):
            g = goodput(configs[i], cl, reqs, _runs=runs[i])
            if g.k == R:
                return g
    return _branch_and_bound(runs)


def _race(runs: list[_Runs]) -> tuple[list[int], int] | None:
    """The survivors (indices) and R, the point they reached; None where the first
    configuration misses k = 0 or one meets every doubling (left to branch and bound).

    Level 0: each configuration is run at R, the highest doubling met so far (one
    early-stopped run for most); one that meets it is run at the doublings above while it
    meets them, raising R. Then each finer level does the same among the survivors of the
    level before, from its R by the level's step, below the point they all missed.

    Why a configuration ruled out has goodput below the point p <= R it missed: if it
    reached p, its scan would have, level by level, the race's values (it met each and
    missed the point one step above), so p, a point of its scan at p's level, was met.
    """
    step, top = LEVELS[0], LEVELS[0] * MAX_DOUBLINGS
    R, alive = 0, []
    for n, i in enumerate(_spread(len(runs))):
        r = runs[i]
        if not r.ok(R):
            if n == 0:
                return None
            continue
        while R + step <= top and r.ok(R + step):
            R += step
            alive = []  # each missed a doubling at most the new R
        if R + step > top:
            return None
        alive.append(i)
    hi = R + step  # every survivor missed it
    for s in LEVELS[1:]:
        base, now = R, []
        for i in alive:
            r = runs[i]
            if R != base and not r.ok(R):
                continue
            while R + s < hi and r.ok(R + s):
                R += s
                now = []
            now.append(i)
        alive, hi = now, R + s
    return alive, R


def _spread(n: int) -> list[int]:
    """0..n-1 in bit-reversed order: the race meets configurations from all over the
    enumeration early (neighbours in it differ in one knob and have similar goodputs), so R
    rises sooner and fewer configurations meet an R that is later passed (full runs)."""
    bits = max(1, (n - 1).bit_length())
    return [j for j in (int(f"{i:0{bits}b}"[::-1], 2) for i in range(1 << bits)) if j < n]


def _branch_and_bound(runs: list[_Runs]) -> Goodput | None:
    """The best :func:`goodput` over ``runs``' configurations, in their order.

    The first configuration is scanned in full. Every other one needs grid index t = the
    best's (when it wins the tie) or one above, and is first probed (:func:`_may_reach`):
    one that the probes rule out has a lower goodput and is skipped; any other is scanned
    (reusing the probes). Outside the range the probes cover (past the doublings either way,
    or an unbounded best) every configuration that could win is scanned.
    """
    best: Goodput | None = None
    top = LEVELS[0] * MAX_DOUBLINGS
    for r in runs:
        if best is not None:
            wins_tie = tie_key(r.cfg) < tie_key(best.config)
            if best.k == K_UNBOUNDED and not wins_tie:
                continue  # at most a tie that it loses
            t = best.k + (0 if wins_tie else 1)
            if -top <= t <= top and not _may_reach(r, t):
                continue
        g = goodput(r.cfg, r.cl, r.reqs, _runs=r)
        if best is None or _beats(g, best):
            best = g
    return best
