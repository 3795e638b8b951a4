"""Compare serving systems on one cluster and trace: each system's best configuration.

:func:`compare` is what ``relibra serve-sim`` runs: build the cluster (model cost, routing,
a recent routing window for replication), search every system's configurations for the
highest P90 goodput, and return one JSON-ready document with the best configuration per
system, its goodput per GPU and per node, TTFT/TPOT percentiles at that rate, the SLO
attainment curve the search visited, and the ratios the paper reports (for a MiniMax-M2-shaped
model only: they belong to the paper's MiniMax-M2.7 setting).
"""

from __future__ import annotations

import math
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace

import torch

from ..planning.pricing import HardwareSpec
from ..sim.presets import MODELS, ModelSpec
from .constants import ServingConstants
from .cost import ServingCost
from .goodput import MAX_DOUBLINGS, at_scale, best_config, run_config
from .requests import Requests
from .systems import Cluster, enumerate_configs

__all__ = ["CompareSetup", "compare", "recent_window", "PAPER_RATIOS", "PAPER_SETTING", "SEARCH_ORDER"]

# ExpertPlex (arXiv 2607.18002), MiniMax-M2.7, ShareGPT lengths, SLO 1 s / 50 ms, 8 x H800 nodes
PAPER_RATIOS = {"expertplex/pd-disagg": 2.01, "expertplex/pd-colocate": 1.41}
PAPER_SETTING = "MiniMax-M2.7 on 8 x H800 nodes, ShareGPT lengths"
PAPER_MODEL = "minimax-m2"  # the preset of the paper's model: its ratios are shown next to this model's only
CURVE_BEYOND = (1.1, 1.25, 1.5, 2.0)  # rates past the goodput (x goodput) drawn in the plot
# with several worker processes, systems start in this order (the default's CPU time, most
# first, so the two workers end close together); the results keep the requested order
SEARCH_ORDER = ("expertplex", "expertplex-repl", "pd-colocate", "chunked-prefill", "colocated", "pd-disagg")


@dataclass
class CompareSetup:
    """Everything one comparison needs (the CLI fills it from its options)."""

    model: ModelSpec
    hardware: HardwareSpec
    consts: ServingConstants
    nodes: int
    gpus_per_node: int
    requests: Requests
    pi_LE: torch.Tensor
    systems: tuple[str, ...]
    routing_source: str
    tile_time_us: float | None = None
    tile_time_source: str = "roofline (M_t x 6 D F FLOPs at the FP8 rate)"
    allow_idle: bool = False
    seed: int = 0
    model_notes: tuple[str, ...] = ()  # what a --model-config leaves out (hf_config's notes)


def recent_window(pi_LE: torch.Tensor, tokens: int, seed: int) -> torch.Tensor:
    """A recent routing window: per-expert counts of ``tokens`` tokens drawn from ``pi_LE``,
    as frequencies (what a server has observed lately; replication is planned on it)."""
    g = torch.Generator().manual_seed(seed + 7919)
    counts = torch.binomial(torch.full_like(pi_LE, float(tokens)), pi_LE.clamp(0, 1), generator=g)
    return counts / tokens


def _cluster(setup: CompareSetup) -> tuple[ServingCost, Cluster]:
    """The cost model and cluster of a setup (deterministic: every worker builds the same)."""
    cost = ServingCost(setup.model, setup.hardware, setup.consts, setup.tile_time_us)
    G = setup.nodes * setup.gpus_per_node
    return cost, Cluster(G, setup.gpus_per_node, cost, setup.pi_LE,
                         recent_window(setup.pi_LE, 16384, setup.seed), setup.seed)


def _search(system: str, cl: Cluster, setup: CompareSetup) -> dict:
    """One system's best configuration and its document."""
    reqs = setup.requests
    need = int((reqs.prompt_N + reqs.output_N).max())
    configs = enumerate_configs(system, cl, need, allow_idle=setup.allow_idle)
    best = best_config(configs, cl, reqs)
    return _system_doc(system, best, configs, cl, setup)


_WORKER: dict = {}  # a worker process's cluster, built once for all the systems it searches


def _worker_init(setup: CompareSetup) -> None:
    torch.set_num_threads(1)  # one core per worker (the work is a single-threaded event loop)
    _WORKER["setup"] = setup
    _WORKER["cluster"] = _cluster(setup)[1]


def _worker_search(system: str) -> tuple[str, dict]:
    return system, _search(system, _WORKER["cluster"], _WORKER["setup"])


def compare(setup: CompareSetup, progress=None, workers: int = 1) -> dict:
    """Run the comparison; ``progress(system, done, total)`` is called as systems finish.

    ``workers > 1`` searches that many systems at once in separate processes (spawned, each
    with one thread); the systems are independent and every worker builds the same cluster,
    so the document is the same as with one (only ``seconds`` differs)."""
    t0 = time.perf_counter()
    cost, cl = _cluster(setup)
    reqs = setup.requests
    systems = setup.systems
    results = {}
    workers = min(workers, len(systems))
    if workers <= 1:
        for i, system in enumerate(systems):
            results[system] = _search(system, cl, setup)
            if progress:
                progress(system, i + 1, len(systems))
    else:
        order = sorted(systems, key=lambda s: SEARCH_ORDER.index(s) if s in SEARCH_ORDER else len(SEARCH_ORDER))
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds torch's thread pools
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init, initargs=(setup,)) as pool:
            futures = [pool.submit(_worker_search, s) for s in order]
            for i, f in enumerate(as_completed(futures)):
                system, results[system] = f.result()
                if progress:
                    progress(system, i + 1, len(systems))
        results = {s: results[s] for s in systems}
    doc = {
        "setup": {
            "model": asdict(setup.model), "hardware": asdict(setup.hardware), "serving": asdict(setup.consts),
            "nodes": setup.nodes, "gpus_per_node": setup.gpus_per_node, "trace": reqs.source,
            "requests": len(reqs), "trace_rate": reqs.rate, "routing": setup.routing_source,
            "tile_time_us": cost.tile_time_s * 1e6, "tile_time_source": setup.tile_time_source,
            "sm_tile_us": cost.sm_tile_s * 1e6, "allow_idle": setup.allow_idle, "seed": setup.seed,
            "notes": [*setup.model_notes, *trace_notes(len(reqs), setup.consts),
                      *context_notes(reqs, setup.model), *span_notes(reqs, results, setup.consts)],
        },
        "systems": results,
        "ratios": _ratios(results),
        # the paper's figures belong to its MiniMax-M2.7 setting: none next to another model
        "paper_ratios": PAPER_RATIOS if replace(setup.model, name=PAPER_MODEL) == MODELS[PAPER_MODEL] else {},
        "paper_setting": PAPER_SETTING,
        "seconds": time.perf_counter() - t0,
    }
    return doc


def span_notes(reqs: Requests, results: dict, consts) -> list[str]:
    """Where a figure is not what it seems: a goodput at which a run's request cap spans less
    than ``serving.min_trace_s`` (no longer a steady state), and a Mooncake trace whose
    recorded rate suggests seconds where milliseconds are read."""
    notes = []
    for system, r in results.items():
        g = r.get("goodput")
        if g and consts.min_trace_s > 0 and g * consts.min_trace_s > consts.max_trace_requests:
            notes.append(f"{system}: at its goodput ({g:,.0f} req/s) a run's {consts.max_trace_requests:,} requests "
                         f"(serving.max_trace_requests) span {consts.max_trace_requests / g:.0f} s, less than "
                         f"serving.min_trace_s = {consts.min_trace_s:g} s: raise the cap for a steady state")
    notes.extend(rate_notes(reqs))
    return notes


def rate_notes(reqs: Requests) -> list[str]:
    """A Mooncake trace whose recorded rate suggests seconds where milliseconds are read (known
    before the search: the search is long at such rates, so the CLI says it first)."""
    if reqs.source.startswith("mooncake:") and len(reqs) > 1 and reqs.rate > 1000:
        return [f"the trace arrives at {reqs.rate:,.0f} req/s as recorded: Mooncake timestamps are read as "
                f"milliseconds; a file in seconds would look like this"]
    return []


def context_notes(reqs: Requests, model) -> list[str]:
    """Requests longer than the model's context window (prompt + output past
    ``max_position_embeddings``, where known): a server would refuse them; here they run as
    given, so say how many."""
    if not model.max_context:
        return []
    over_N = (reqs.prompt_N + reqs.output_N) > model.max_context
    if not over_N.any():
        return []
    longest = int((reqs.prompt_N + reqs.output_N).max())
    return [f"{int(over_N.sum())} of {len(reqs)} requests need more than {model.name}'s context window "
            f"({model.max_context:,} tokens, max_position_embeddings; longest {longest:,}): a server would "
            f"refuse them; they are simulated as given"]


def trace_notes(num_requests: int, consts) -> list[str]:
    """What a reader must know about the trace: fewer requests than ``1 / (1 - attainment)``
    (10 for P90) leaves no percentile below the worst request, and every run repeats them
    back to back, so the goodput is that of these few requests' lengths."""
    least = math.ceil(1 / (1 - consts.attainment) - 1e-9)
    if num_requests >= least:
        return []
    return [f"the trace holds {num_requests} request(s), fewer than the {least} a P{consts.attainment * 100:g} "
            f"needs to leave out its worst: every run repeats them back to back (serving.min_trace_s), so the "
            f"goodput is that of these lengths alone; use a longer trace"]


def _system_doc(system: str, best, configs, cl: Cluster, setup: CompareSetup) -> dict:
    G, gpn = cl.num_gpus, setup.gpus_per_node
    if best is None:
        c = cl.cost
        return {"fits": False, "configs_tried": 0, "goodput": 0.0, "goodput_per_gpu": 0.0,
                "goodput_per_node": 0.0,
                "note": (f"no configuration fits: the weights take {c.expert_bytes_total() / 1e9:,.0f} GB of experts "
                         f"plus {c.attention_side_bytes() / 1e9:,.0f} GB on every attention GPU, the longest request's "
                         f"KV cache comes on top, and the {G} GPUs hold {c.usable_bytes() / 1e9:,.0f} GB each "
                         f"(serving.mem_fraction of {c.hw.hbm_gb:g} GB); or too few GPUs for its servers; add --nodes")}
    if best.rate == float("inf"):  # the whole trace as one burst meets the SLO
        return {"fits": True, "configs_tried": len(configs), "config": dict(best.config.knobs),
                "config_label": best.config.label(), "gpus_used": best.config.gpus, "goodput": None,
                "goodput_per_gpu": None, "goodput_per_node": None, "unbounded": True,
                "note": "the whole trace as one burst meets the SLO: use a longer or heavier trace",
                "curve": [list(p) for p in best.points]}
    doc = {"fits": True, "configs_tried": len(configs), "config": dict(best.config.knobs),
           "config_label": best.config.label(), "gpus_used": best.config.gpus,
           "goodput": best.rate, "goodput_per_gpu": best.rate / G, "goodput_per_node": best.rate / (G / gpn),
           "scale": best.scale, "curve": [list(p) for p in best.points]}
    if best.rate == 0:  # say why the row is empty, with the attainment of a complete run at the slowest rate
        exact = [p for p in best.points if p[2]]
        slowest = min(best.points, key=lambda p: p[0]) if best.points else None
        if slowest is not None and not slowest[2]:  # the search stopped it at its first misses: run it through
            m = run_config(best.config, cl, at_scale(setup.requests, 2.0 ** -MAX_DOUBLINGS, cl))
            slowest = (m.rate, m.attainment, True)
            exact.append(slowest)
        doc["note"] = ("no rate tried met the SLO" + ("" if slowest is None else
                       f": even at {slowest[0]:.3g} req/s, the slowest tried, {slowest[1] * 100:.0f}% of requests "
                       f"met it (P{setup.consts.attainment * 100:g} needs {setup.consts.attainment * 100:g}%)"))
        doc["curve"] = [list(p) for p in sorted(exact)]
    if best.metrics is not None:
        # exact percentiles at the goodput rate (the search's run there may have stopped early)
        m = best.metrics if not best.metrics.aborted else run_config(best.config, cl, at_scale(setup.requests, best.scale, cl))
        doc.update(m.percentiles())
        doc["attainment"] = m.attainment
        # the curve: the search's complete runs plus complete runs past the goodput (the
        # search stops those early, so their attainment would only be a bound)
        exact = [p for p in best.points if p[2]]
        for f in CURVE_BEYOND:
            r = run_config(best.config, cl, at_scale(setup.requests, best.scale * f, cl))
            exact.append((r.rate, r.attainment, True))
        doc["curve"] = [list(p) for p in sorted(exact)]
    return doc


def _ratios(results: dict) -> dict:
    """Goodput ratios of ExpertPlex to each other system run (None when either is unbounded or
    has no configuration that fits)."""
    def ratio(a: str, b: str):
        x, y = results[a].get("goodput"), results[b].get("goodput")
        if x is None or y is None or not (results[a].get("fits", True) and results[b].get("fits", True)):
            return None
        return x / y if y > 0 else ("inf" if x > 0 else None)

    out = {}
    if "expertplex" in results:
        for other in ("pd-disagg", "pd-colocate", "colocated", "chunked-prefill"):
            if other in results:
                out[f"expertplex/{other}"] = ratio("expertplex", other)
        if "expertplex-repl" in results:
            out["expertplex-repl/expertplex"] = ratio("expertplex-repl", "expertplex")
    return out
