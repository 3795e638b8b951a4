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

    def percentiles(self, qs=(50, 90, 99)) -> dict:
        return {f"ttft_p{q}_s": float(np.percentile(self.ttft_N, q)) for q in qs} | \
               {f"tpot_p{q}_s": float(np.percentile(self.tpot_N, q)) for q in qs}


def run_config(cfg: SystemConfig, cl: Cluster, reqs: Requests) -> RunMetrics:
    """Simulate ``reqs`` on ``cfg`` and score them against the cluster's SLO."""
    eng = build_engine(cfg, cl, reqs.arrival_N, reqs.prompt_N, reqs.output_N)
    eng.run()
    if np.any(eng.finished_count != 1) or np.any(eng.generated != reqs.output_N):
        raise RuntimeError(f"{cfg.system} ({cfg.label()}): a request did not finish exactly once with all "
                           f"its tokens (engine bug)")
    ttft = eng.first - reqs.arrival_N
    out = reqs.output_N
    tpot = np.where(out > 1, (eng.finish - eng.first) / np.maximum(out - 1, 1), 0.0)
    c = cl.consts
    ok = (ttft <= c.ttft_slo_s + 1e-12) & (tpot <= c.tpot_slo_s + 1e-12)
    return RunMetrics(reqs.rate, ttft, tpot, float(ok.mean()), eng.events)


@dataclass
class Goodput:
    """A configuration's goodput and the (rate, attainment) points the search visited."""

    config: SystemConfig
    rate: float  # req/s, 0 when even the slowest rate tried fails
    scale: float
    metrics: RunMetrics | None
    points: list[tuple[float, float]] = field(default_factory=list)


def goodput(cfg: SystemConfig, cl: Cluster, reqs: Requests, iters: int = 6, max_doublings: int = 8) -> Goodput:
    """Bisection over the arrival-scale factor (see the module doc)."""
    target = cl.consts.attainment
    points, runs = [], {}

    def att(scale: float) -> float:
        m = run_config(cfg, cl, reqs.scaled(scale))
        runs[scale] = m
        points.append((m.rate, m.attainment))
        return m.attainment

    lo = hi = 1.0
    if att(1.0) >= target:
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


def best_config(configs: list[SystemConfig], cl: Cluster, reqs: Requests, screen: int = 3,
                iters: int = 6) -> tuple[Goodput | None, list[Goodput]]:
    """The configuration with the highest goodput.

    All configurations are screened with a coarse bisection (2 halvings), the ``screen``
    best are refined with ``iters`` halvings. Ties go to fewer GPUs, then to the listed order.
    """
    if not configs:
        return None, []
    coarse = [goodput(cfg, cl, reqs, iters=2) for cfg in configs]
    order = sorted(range(len(coarse)), key=lambda i: (-coarse[i].rate, configs[i].gpus, i))
    fine = [goodput(configs[i], cl, reqs, iters=iters) for i in order[:screen]]
    best = max(fine, key=lambda g: (g.rate, -g.config.gpus))
    return best, coarse
