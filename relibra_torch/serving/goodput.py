"""P90 goodput: the highest arrival rate at which >= 90% of requests meet both SLOs.

For a real trace the rate is changed by dividing every inter-arrival time by a scale factor
(``Requests.scaled``); goodput is found by bisection over that factor (attainment falls as
the rate rises) on the grid ``2 ** (k / 32)``: first doubling or halving from 1 until the
attainment target is passed and failed, then bisection of the integer interval. Each
system's configurations are searched the same way and the best one reported.

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

    def percentiles(self, qs=(50, 90, 99)) -> dict:
        return {f"ttft_p{q}_s": float(np.percentile(self.ttft_N, q)) for q in qs} | \
               {f"tpot_p{q}_s": float(np.percentile(self.tpot_N, q)) for q in qs}


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
    return RunMetrics(reqs.rate, ttft, tpot, float(ok.mean()), eng.events)


@dataclass
class Goodput:
    """A configuration's goodput and the (rate, attainment) points the search visited."""

    config: SystemConfig
    rate: float  # req/s, 0 when even the slowest rate tried fails
    scale: float
    metrics: RunMetrics | None
    points: list[tuple[float, float, bool]] = field(default_factory=list)  # (rate, attainment, exact)
    k: int = 0  # grid index of the scale (2 ** (k / 32))


STEPS_PER_DOUBLING = 32  # the scale grid: 2 ** (k / 32), k an integer (2.2% apart)


def _scale(k: int) -> float:
    return 2.0 ** (k / STEPS_PER_DOUBLING)


def goodput(cfg: SystemConfig, cl: Cluster, reqs: Requests, start_k: int = 0, max_doublings: int = 12) -> Goodput:
    """The highest grid scale ``2 ** (k / 32)`` whose run meets the attainment target.

    From ``k = start_k``: double (``k += 32``) or halve until the target is passed and failed,
    then bisect the integer interval. The scale grid makes the result independent of the
    search path when attainment falls with rate, so configurations and settings compare
    exactly (``runs`` of one configuration are cached by ``k``).
    """
    target = cl.consts.attainment
    points, runs = [], {}

    def ok(k: int) -> bool:
        if k not in runs:
            m = run_config(cfg, cl, at_scale(reqs, _scale(k), cl), early_stop=True)
            runs[k] = m
            points.append((m.rate, m.attainment, not m.aborted))
        return runs[k].attainment >= target

    step = STEPS_PER_DOUBLING
    lo = hi = start_k
    if ok(start_k):
        for _ in range(max_doublings):
            hi += step
            if not ok(hi):
                break
            lo = hi
        else:  # still met after max_doublings: does the whole trace as one burst meet it?
            burst = run_config(cfg, cl, reqs.scaled(math.inf), early_stop=True)
            if burst.attainment >= target:
                return Goodput(cfg, math.inf, math.inf, burst, sorted(points), k=10**9)
            for _ in range(4 * max_doublings):  # met at every grid point so far, not as a burst
                if not ok(hi):
                    break
                lo, hi = hi, hi + step
            else:
                raise RuntimeError(f"{cfg.system} ({cfg.label()}): the SLO is met at every rate tried "
                                   f"but not by the burst; attainment is not monotone in the rate")
    else:
        for _ in range(max_doublings):
            lo -= step
            if ok(lo):
                break
            hi = lo
        else:
            return Goodput(cfg, 0.0, 0.0, None, sorted(points))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    g = Goodput(cfg, runs[lo].rate, _scale(lo), runs[lo], sorted(points))
    g.k = lo
    return g


def best_config(configs: list[SystemConfig], cl: Cluster, reqs: Requests) -> Goodput | None:
    """The configuration with the highest goodput (branch and bound over the list).

    The first configuration gets a full search; every other one is first run once one grid
    step above the best so far: one that misses the target there cannot be better (when
    attainment falls with rate) and costs one, usually early-stopped, run; one that meets it
    is searched upwards from there. Ties keep the earlier configuration.
    """
    best: Goodput | None = None
    target = cl.consts.attainment
    for cfg in configs:
        if best is not None and best.rate == math.inf:
            break  # nothing beats serving the whole trace as one burst
        if best is None or best.rate == 0.0:
            g = goodput(cfg, cl, reqs)
            if best is None or g.rate > best.rate:
                best = g
            continue
        probe = best.k + 1
        m = run_config(cfg, cl, at_scale(reqs, _scale(probe), cl), early_stop=True)
        if m.attainment >= target:
            g = goodput(cfg, cl, reqs, start_k=probe)
            if g.rate > best.rate:
                best = g
    return best
