"""P90 goodput: the highest arrival rate at which >= 90% of requests meet both SLOs.

For a real trace the rate is changed by dividing every inter-arrival time by a scale factor
(``Requests.scaled``); goodput is found by bisection over that factor (attainment falls as
the rate rises): first doubling or halving from 1 until the attainment target is passed and
failed, then ``iters`` halvings of the interval between them in log space. Each system's
configurations are searched the same way and the best one reported.

Legend: N requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .requests import Requests
from .systems import Cluster, SystemConfig, build_engine

__all__ = ["RunMetrics", "Goodput", "run_config", "goodput", "best_config"]


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


def goodput(cfg: SystemConfig, cl: Cluster, reqs: Requests, iters: int = 5, max_doublings: int = 12,
            start: float = 1.0) -> Goodput:
    """Bisection over the arrival-scale factor (see the module doc), from ``start``."""
    target = cl.consts.attainment
    points, runs = [], {}

    def att(scale: float) -> float:
        m = run_config(cfg, cl, reqs.scaled(scale), early_stop=True)
        runs[scale] = m
        points.append((m.rate, m.attainment, not m.aborted))
        return m.attainment

    lo = hi = start
    if att(start) >= target:
        for _ in range(max_doublings):
            hi *= 2
            if att(hi) < target:
                break
            lo = hi
        else:
            return Goodput(cfg, runs[lo].rate, lo, runs[lo], sorted(points))
    else:
        for _ in range(max_doublings):
            lo /= 2
            if att(lo) >= target:
                break
            hi = lo
        else:
            return Goodput(cfg, 0.0, 0.0, None, sorted(points))
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        if att(mid) >= target:
            lo = mid
        else:
            hi = mid
    return Goodput(cfg, runs[lo].rate, lo, runs[lo], sorted(points))


def best_config(configs: list[SystemConfig], cl: Cluster, reqs: Requests, iters: int = 5) -> Goodput | None:
    """The configuration with the highest goodput (branch and bound over the list).

    The first configuration gets a full bisection; every other one is first run once at the
    best goodput so far: a configuration that misses the attainment target there cannot be
    better (attainment falls with rate) and costs one, usually early-stopped, run; one that
    meets it is bisected upwards from there. Ties keep the earlier configuration.
    """
    best: Goodput | None = None
    target = cl.consts.attainment
    for cfg in configs:
        if best is None or best.rate == 0.0:
            g = goodput(cfg, cl, reqs, iters=iters)
            if best is None or g.rate > best.rate:
                best = g
            continue
        probe = best.scale * (1 + 2.0 ** -iters)  # beat the best by more than the bisection's resolution
        m = run_config(cfg, cl, reqs.scaled(probe), early_stop=True)
        if m.attainment >= target:
            g = goodput(cfg, cl, reqs, iters=iters, start=probe)
            if g.rate > best.rate:
                best = g
    return best
