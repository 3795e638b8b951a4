"""Is relibra's search worth its host time? A per-layer guard that runs before everything.

The plan is made on the host while static's forward pass runs (the old log-probabilities);
what does not fit that window lengthens the step (``sim/simulator.py``, ``_charge_host_work``).
On small micro-batches a layer's whole MoE time can be well under a millisecond while the
full search (fast path, two swap searches, traffic replicas, balancing, step-long sets, each
priced) costs 6-100 ms of one thread. Then no plan, however good, repays its planning.

Per layer, from integer counts only (a few dozen tensor ops for the whole step):

* **gain bound** ``U_l``: what any plan can save on the layer against keeping the previous
  placement without copies, summed over micro-batches. Expert compute cannot fall below
  ``ceil(total / G)`` tokens on the busiest GPU; the all-to-all cannot fall below zero.
  So ``U_l <= sum_m (busiest GPU's tokens - ceil(total / G)) * compute_s_per_token +
  a2a_m``, with ``a2a_m`` the kept placement's all-to-all as :mod:`planning.price` prices it
  (exactly under flat dispatch; under hierarchical dispatch an upper bound: a row is one
  token per node or GPU, so a source's rows there are at most its pairs there and at most
  its tokens, ``ceil(pairs / top_k)``, :mod:`~relibra_torch.planning.gain_bound`). Fills,
  migrations and latency only add to a plan's price.
* **window share** ``W_l``: the layer's share of the overlap window. Split planning gives
  each EP rank ``ceil(L / G)`` layers and the whole step's forward pass, so a layer gets
  ``L / ceil(L / G)`` times its own forward: a third of its compute, half of its all-to-all
  (flat; 0 under hierarchical dispatch, where only an upper bound is at hand) and half of
  its exchange latency, less ``plan_schedule_s * M / 8``: every rank builds the schedules of
  every layer given copies (``moe.schedule_batch.rank_schedules``), so a planned layer
  takes that out of each rank's window. The forward of attention and dense layers is left
  out: the estimate errs towards a smaller window, that is towards keeping the placement.
  The share assumes split planning (the hook's and the simulator's default); where one
  thread plans the whole step it overstates the window about ``G``-fold.
* **floor** ``F``: the layer's part of the one-thread CPU time the full search typically
  spends on a rank's share of ``ceil(L / G)`` layers when the fast path does not settle
  them: a fixed part spread over the share, ``plan_floor_s / ceil(L / G)``, plus a part per
  layer, ``plan_layer_s * sqrt(top_k)`` (the search builds and prices more candidates when
  each token picks more experts); across nodes ``plan_floor_nodes_s`` and
  ``plan_layer_nodes_s * sqrt(top_k * max(E / 64, 1))`` (the hierarchical estimate's
  columns); both times ``max(M, 8) / 8`` (fitted at 8 micro-batches; below 8 beyond 16 GPUs
  the part of the GPUs' growth that is tensor work shrinks with ``M``,
  :func:`~relibra_torch.planning.host_time.few_micro_batches`). The fixed part (a few
  thousand small tensor calls whatever the layer count) is most of a one- or two-layer
  share's search, which is what 8-16 EP ranks plan on models of 12-16 layers. Fitted on
  this project's 2-core machine (``planning.pricing.PLAN_FLOOR_S``); every host time here
  (floors, light plan, schedules) is multiplied by the config's scale for the topology
  (:func:`~relibra_torch.planning.host_time.host_scale`: this host's planning time over that machine's, ``moe.host_speed``).

A layer with ``U_l + W_l < F`` keeps the previous placement with every expert on its owner:
the full search's plan would save at most ``U_l`` and cost at least ``F - W_l`` more than
the window hides; unless the search is **free**: ``F`` plus the schedules fit the share's
part of the whole step's window, ``step_window_s / ceil(L / G)`` (:func:`~relibra_torch.planning.step_window.step_window_s`: a
lower bound of static placement's forward pass from every layer's counts, with a lower bound
of the hierarchical rows where ``W_l`` has none; for the search its looser form, the MoE
layers alone at the mean GPU load: admitted free on the whole forward's bound, searches whose
host time outgrew ``F`` planned worse than the light plan they replaced, ``docs/results.md``,
"The step's window counts the whole forward: for the light plan only"). Across nodes beyond
16 GPUs the search's margin takes ``W_l`` at least the share's part of the whole forward's
bound (:func:`_whole_margin`). Each layer's ``W_l`` counts that layer alone
(times ``L / ceil(L / G)``), so a step whose forward sits in a few layers (a collapsed router)
left the others' searches out although the rank's window held them
(``docs/results.md``, "The guard's window under hierarchical dispatch"). Every EP rank reads
the whole step's loads from replay, so every rank and the whole-step plan get the same
window; it is computed only where a layer is not admitted otherwise, and its pass over the
pairs only where an upper bound from the sources' token counts reaches the free threshold.
A layer neither worth the search nor free gets the light plan instead
(:mod:`~relibra_torch.planning.light`) where ``U_l + W'_l >= F'``, or where the light plan is
free as the search is (``F'`` and its schedules fit the share's part of the step's window: then
its keep rule asks only for a saving). The free rule for the light plan came from 8 x 8 GPUs
at real layer counts: a rank's share is one layer, its ``W_l`` (a third of the layer's
compute, no all-to-all) a third of the true window and the schedules of every layer taken out
of it, so no layer was admitted where the light plan's host time was half the window
(``docs/results.md``, "The light plan free where the step's window holds it"). ``F'`` is the light plan's own host time
(:func:`light_floor_s`: ``light_share`` of the fixed part, and a part per layer that
follows the experts), ``W'_l`` the window less the light plan's cheaper schedules (one
residency per copy, :data:`LIGHT_SCHEDULE_SHARE`), and ``U_l`` there the looser bound with
each hierarchical row bounded by its pairs only (``Tiers.light_gain_L``): the light plan's
host time does not grow with the load as the search's does, and its keep rule (next) checks
its exact saving, so a light admission risks at most its own floor, while the token bound
refused light plans that repaid their host time three-fold (``docs/results.md``, "The gain
bound counts a token once per node"); and it keeps that plan only where its
exact saving (the plain plan's price, not the bound) repays what its schedules add to the
charge once the plan's own host time is spent:
``(max(0, F' - W'_l) - max(0, F' - V_l)) / scale`` with ``V_l`` the window before any
schedules.

A layer below both tiers **rides** the light plan where another layer of the step is planned
(either tier) and its bound covers its own part of the light plan, ``U_l >= light_layer_s +``
its light schedules (:meth:`Tiers.ride_L`): the ranks plan at once and the step waits for the
slowest, so once some rank spends a plan's fixed host time, another rank's light plan adds
only its per-layer part and its schedules (the schedules' own fixed part, 1.4-2.2 ms on the
reviewer's one-node files, is paid once for all layers). Every rank reads the step's loads,
so a rank learns whether another is planned from the other layers' tiers
(:func:`any_planned`, asked only where a layer could ride), and a layer its share would keep
whole (:func:`_below_L`) does not ride: split planning and the whole-step plan agree.

``scale = L / ceil(L / G)``: every EP rank plans its share at the same time, so the step
waits once for the slowest rank's overrun and gains every layer's saving. With every layer
planned a rank overruns the window by ``share`` times a layer's charge while the step saves
``L`` times one layer's saving (layers alike), so a layer's exact saving counts ``scale``
times against its share-layer's charge, as the window does. Both tiers' admissions count
the gain bound once: the bound overstates what a plan saves (on the stand-ins of
``benchmarks/never_behind.py`` by more than ``scale``; under hierarchical dispatch more, as a
row is bounded by counts, not by the tokens' own routing), and the host time of an admitted plan is
spent whether or not it is kept. Counted ``scale`` times, admissions sent layers to searches
and light plans whose host time their plans did not repay (``docs/results.md``, "The light
tier's keep rule counts every layer's saving"). On one node the light tier also admits a
layer on an estimate, counted ``scale`` times, of what spreading its hottest expert by the
light plan's margin rule saves (:func:`~relibra_torch.planning.light.hot_spread_saving_L`):
one expert's compute, less its fills, below the light plan's saving where it admitted (a
collapsed router: 0.50 against 0.65 ms a layer).

The fixed part is spread over the share per layer, while a rank pays it whole once any of its
layers is searched, and both fixed parts where its share mixes tiers: a share that mixes
tiers is under-priced (up to its size). The rule reads only the layer's own counts, the
layer count ``L`` and the topology, so split planning gives every layer the same decision
as the whole-step plan.

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, N nodes, g GPUs per node.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import torch

from .fastpath import keep_plan
from .gain_bound import gain_bound_L, gain_bounds_L, quick_bound_L as _quick_bound_L
from .host_time import (LIGHT_SCHEDULE_SHARE, layer_floor_s, light_floor_s, light_layer_s, light_scale,
                        light_schedule_share, plan_floor_s)
from .light import hot_spread_saving_L, light_plan
from .plan import StepPlan
from .price import exchange_latency_s
from .topology import Topology

__all__ = ["any_planned", "gain_bound_L", "guarded_plan", "worth_planning_L"]


class Tiers(NamedTuple):
    """:func:`_tiers`: per layer ``[L]`` (float64 seconds) the gain bound ``U_l`` and the
    layer's window share before schedules; the schedules a rank builds per planned layer,
    scaled as the window (full search's; the light plan's are :func:`light_schedule_share`
    of them, ``light_schedules``); the floors ``F`` and ``F'``; and ``scale = L / ceil(L / G)``, the layers whose
    savings one share-layer's host time buys, which the light plan's keep rule counts
    (module docstring); ``hot_saving_L``: the hot expert's estimate, ``None`` where it could
    not admit a layer (``scale`` times the bound below the light floor) and was not computed."""

    gain_L: torch.Tensor
    window_L: torch.Tensor
    schedules_s: float
    floor: float
    light_floor: float
    scale: float
    light_schedules: float = LIGHT_SCHEDULE_SHARE
    free_window: float = 0.0
    search_window: float = 0.0
    light_layer: float = 0.0
    hot_saving_L: torch.Tensor | None = None
    light_gain_L: torch.Tensor | None = None
    whole_margin: bool = False

    def light_bound_L(self) -> torch.Tensor:
        """The bound the light tier admits on: ``light_gain_L`` (under hierarchical dispatch
        across nodes each row bounded by its pairs only, :func:`~relibra_torch.planning.gain_bound.gain_bounds_L`;
        module docstring), else ``U_l``."""
        return self.gain_L if self.light_gain_L is None else self.light_gain_L

    def margin_L(self) -> torch.Tensor:
        """``U_l + W_l`` (``W_l``: the window less the full search's schedules); with
        ``whole_margin`` (beyond :data:`WHOLE_MARGIN_GPUS` GPUs across nodes) the window is at
        least the share's part of the whole forward's (``free_window``)."""
        window_L = self.window_L.clamp(min=self.free_window) if self.whole_margin else self.window_L
        return self.gain_L + window_L - self.schedules_s

    def full_L(self) -> torch.Tensor:
        """bool ``[L]``: worth the full search, ``U_l + W_l >= F`` (the bound counted once), or
        free: ``F`` and the schedules fit the share's part of the step's window."""
        return (self.margin_L() >= self.floor) | self.search_free()

    def search_free(self) -> bool:
        """Whether the share's part of the step's looser window (``search_window``: MoE layers
        alone, mean load) holds the full search and its schedules."""
        return self.floor + self.schedules_s <= self.search_window

    def light_window_L(self) -> torch.Tensor:
        """``W'_l``: the window less the light plan's schedules."""
        return self.window_L - self.light_schedules * self.schedules_s

    def light_need(self) -> float:
        """The light plan's host time and its schedules per share-layer."""
        return self.light_floor + self.light_schedules * self.schedules_s

    def light_free(self) -> bool:
        """Whether the share's part of the step's window holds the light plan and its schedules."""
        return self.light_floor > 0 and self.light_need() <= self.free_window

    def light_L(self) -> torch.Tensor:
        """bool ``[L]``: worth the light plan, ``U_l + W'_l >= F'``, or ``scale H_l + W'_l >= F'``
        with ``H_l`` the estimate of spreading the layer's hottest expert (``hot_saving_L``,
        :func:`~relibra_torch.planning.light.hot_spread_saving_L`: every rank's plan saves its
        own layers, and this estimate, unlike the bound, counts one expert's compute less its
        fills); never where the light plan is off."""
        bound_L = self.light_bound_L()
        counted_L = bound_L if self.hot_saving_L is None else torch.maximum(bound_L, self.scale * self.hot_saving_L)
        return ((counted_L + self.light_window_L() >= self.light_floor) & (self.light_floor > 0)) | self.light_free()

    def ride_L(self) -> torch.Tensor:
        """bool ``[L]``: admitted by neither tier, but worth the light plan once another layer
        of the step is planned (:func:`guarded_plan`): then some rank spends a plan's fixed
        host time anyway, and the layer adds only its own part (``light_layer``) and its light
        schedules, which its gain bound ``U_l`` (counted once) covers."""
        marginal = self.light_layer + self.light_schedules * self.schedules_s / self.scale
        return ~self.full_L() & ~self.light_L() & (self.light_bound_L() >= marginal) & (self.light_floor > 0)

    def light_room_L(self) -> torch.Tensor:
        """bool ``[L]``: the light plan may build and price a second set (the share rule's,
        ``step_set.margin_sets``): the window less the light schedules holds the light plan's
        host time and one more layer's part of it (``light_layer``), so the second set adds
        no charge."""
        return (self.light_window_L() >= self.light_floor + self.light_layer) \
            | (self.light_need() + self.light_layer <= self.free_window)

    def light_saving_L(self) -> torch.Tensor:
        """``[L]``: what a made light plan's exact saving (per layer) must exceed to be kept:
        the charge its schedules add once its own host time is spent (the window less that
        time), per share-layer, over ``scale``; none where the step's window holds both."""
        if self.light_free():
            return torch.zeros_like(self.window_L)
        return ((self.light_floor - self.light_window_L()).clamp(min=0)
                - (self.light_floor - self.window_L).clamp(min=0)) / self.scale


def _tiers(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor, config,
           total_layers: int | None, step_window: Callable[..., float] | None = None) -> Tiers:
    """The guard's :class:`Tiers` of each layer (module docstring). On one node, where a
    cheaper upper bound (:func:`_quick_bound_L`) already puts every layer below both tiers and
    lets none ride, that bound's instead: it decides the same, in about half the time."""
    share, scale, floor, light, schedules = _share_terms(loads_MLSE.shape[0], loads_MLSE.shape[1], topology, config,
                                                         total_layers)

    # the light tier's terms read the counts, not the bound: computed once for both bounds
    light_layer = light_layer_s(topology, config, loads_MLSE.shape[0]) if light > 0 else 0.0
    hot: list[torch.Tensor] = []

    def tiers(bound) -> Tiers:
        gain_L, light_gain_L, forward_L = bound(loads_MLSE, topology, placement_LE, config)
        t = Tiers(gain_L, forward_L * scale, schedules, floor, light, scale, light_schedule_share(topology),
                  light_layer=light_layer, light_gain_L=light_gain_L, whole_margin=_whole_margin(topology))
        # the hot expert's estimate is at most the bound's compute part, so it admits a layer
        # only where scale times the bound would: elsewhere it is not computed (same tiers)
        if not hot and light > 0 and bool((scale * light_gain_L + t.light_window_L() >= light).any()):
            hot.append(hot_spread_saving_L(loads_MLSE, topology, placement_LE, config))
        return t._replace(hot_saving_L=hot[0]) if hot else t
    if topology.num_nodes == 1:
        quick = tiers(_quick_bounds_L)
        # nor may it let a layer ride that the exact bound would not (split planning, where a
        # rank's share is that layer, would then plan what the whole-step plan keeps)
        if not bool(quick.full_L().any() or quick.light_L().any() or quick.ride_L().any()):
            return _with_free_window(quick, step_window, share)
    return _with_free_window(tiers(gain_bounds_L), step_window, share)


#: Beyond this many GPUs across nodes the full search's margin counts the whole forward's window.
WHOLE_MARGIN_GPUS = 16


def _whole_margin(topology: Topology) -> bool:
    """Whether the full search's margin takes the share's part of the whole forward's window
    where it exceeds the layer's own (``Tiers.margin_L``): across nodes beyond
    :data:`WHOLE_MARGIN_GPUS` GPUs. There a share is a layer or two, whose own window (its
    MoE forward times ``L / ceil(L / G)``) was 0.19-0.44 of the simulator's on EP 256, and
    the guard refused searches that fit the window with 1.5x to spare (LongCat-Flash-Chat:
    1.27x faster with them). On 16 GPUs the same window made searches replace light plans
    that planned better (``docs/results.md``, "The search's margin on the whole forward
    beyond 16 GPUs")."""
    return topology.num_nodes > 1 and topology.num_gpus > WHOLE_MARGIN_GPUS


def _quick_bounds_L(*args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_quick_bound_L` as ``gain_bounds_L``'s triple (one node: the light tier's is ``U_l``)."""
    gain_L, forward_L = _quick_bound_L(*args)
    return gain_L, gain_L, forward_L


def _share_terms(M: int, L: int, topology: Topology, config, total_layers: int | None
                 ) -> tuple[int, float, float, float, float]:
    """``(share, scale, F, F', schedules)`` of a rank's share of ``L`` layers (of the step's
    ``total_layers``): layers per EP rank, ``L / ceil(L / G)``, the two floors, and the
    schedules a planned layer costs every rank (all layers, not a share), out of the window."""
    total = L if total_layers is None else total_layers
    share = -(-total // max(topology.num_gpus, 1))
    scale = total / share
    schedules = config.plan_schedule_s * light_scale(topology, config) * M / 8 * scale
    return (share, scale, layer_floor_s(topology, config, share, M), light_floor_s(topology, config, share, M),
            schedules)


def _below_L(loads_MLSE: torch.Tensor, topology: Topology, config, total_layers: int | None) -> torch.Tensor:
    """bool ``[L]``: the layers whose tiers' margins are surely below both floors, from each
    layer's pairs alone (:func:`_pairs_below`)."""
    M, L = loads_MLSE.shape[:2]
    return _pairs_below(loads_MLSE.sum((0, 2, 3)).to(torch.float64), M, L, topology, config, total_layers)


def _pairs_below(pairs, M: int, L: int, topology: Topology, config, total_layers: int | None):
    """Whether a layer with ``pairs`` token-expert pairs (summed over micro-batches; a float,
    or float64 ``[L]``) has both tiers' margins surely below their floors: the margins are at
    most ``P (c + (1 + scale / 2) (x + n) + scale c / 3)`` plus the window's latency (``P``
    the pairs, ``c`` a pair's compute, ``x`` and ``n`` a row across nodes and over NVLink: a
    GPU's busiest load and its rows are at most the pairs; on one node the light tier's has
    ``(scale - 1) P c`` more, its hot expert's estimate counted ``scale`` times)."""
    share, scale, floor, light, schedules = _share_terms(M, L, topology, config, total_layers)
    c = config.compute_s_per_token
    margin = _pairs_margin(pairs, M, scale, topology, config)
    # the hot expert's estimate (one node), counted scale times: at most the pairs' compute
    light_margin = margin + (pairs * c * (scale - 1) if topology.num_nodes == 1 else 0.0)
    return (margin - schedules < floor) & ((light <= 0) | (light_margin - light_schedule_share(topology) * schedules
                                                           < light))


def _pairs_margin(pairs, M: int, scale: float, topology: Topology, config):
    """An upper bound of ``U_l + W_l`` from a layer's ``pairs`` (:func:`_pairs_below`;
    ``scale`` of :func:`_share_terms`)."""
    c, rows = config.compute_s_per_token, config.cross_node_s_per_token + config.intra_node_s_per_token
    return pairs * (c * (1 + scale / 3) + rows * (1 + scale / 2)) + scale * M * 0.5 * exchange_latency_s(topology,
                                                                                                       config)


def _free_need(full: float, light: float, light_schedules: float) -> float:
    """The least host time per share-layer that makes a tier free: the full search's
    (``full``, with its schedules) or, where the light plan is on, the light plan's."""
    return min(full, light + light_schedules) if light > 0 else full


def _share_window(step_window: Callable[[float], float], need: float, share: int) -> float:
    """The share's part of the step's window, ``step_window(at_least) / share``, asked for at
    least what ``share`` layers' searches need (``need`` each): below that no layer is free."""
    return step_window(need * share) / share


def _surely_kept(loads_MLSE: torch.Tensor, topology: Topology, config, total_layers: int | None,
                 step_window: Callable[..., float] | None) -> bool:
    """Whether every layer surely keeps its placement: the margins of the layer with the most
    pairs below both floors (:func:`_pairs_below`, one sum), and the step's window makes no
    layer free. Shares of steps too small for any plan (a millisecond, 16 tokens per GPU) then
    skip the bounds."""
    M, L = loads_MLSE.shape[:2]
    pairs = float(loads_MLSE.sum((0, 2, 3)).max())
    if not bool(_pairs_below(pairs, M, L, topology, config, total_layers)):
        return False
    if step_window is None:
        return True
    # the share's part of the step's window, asked as _with_free_window asks it: no tier may be
    # free in it, nor (beyond 16 GPUs, Tiers.margin_L) lift the pairs' bound of the search's
    # margin over its floor
    share, scale, floor, light, schedules = _share_terms(M, L, topology, config, total_layers)
    need = _free_need(floor + schedules, light, light_schedule_share(topology) * schedules)
    window = _share_window(step_window, need, share)
    if need <= window:
        return False
    return not _whole_margin(topology) or _pairs_margin(pairs, M, scale, topology, config) + window - schedules < floor


def any_planned(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor, config,
                total_layers: int | None, step_window: Callable[..., float] | None = None) -> bool:
    """Whether the guard admits some of these layers (of a step of ``total_layers``) to either
    tier, as the ranks that plan them decide: where one is, a rank spends a plan's host time."""
    if not loads_MLSE.shape[1] or _surely_kept(loads_MLSE, topology, config, total_layers, step_window):
        return False
    tiers = _tiers(loads_MLSE, topology, placement_LE, config, total_layers, step_window)
    return bool((tiers.full_L() | tiers.light_L()).any())


def _with_free_window(tiers: Tiers, step_window: Callable[..., float] | None, share: int) -> Tiers:
    """``tiers`` with the share's part of the step's window (``step_window(at_least, whole)``,
    asked only where a layer is not already worth the full search; ``at_least``: the window
    below which no layer is free): the whole forward's bound for the light plan
    (``free_window``), the looser MoE-only one for the search (``search_window``)."""
    if step_window is None or bool(tiers.full_L().all()):
        return tiers
    full = tiers.floor + tiers.schedules_s
    need = _free_need(full, tiers.light_floor, tiers.light_schedules * tiers.schedules_s)
    return tiers._replace(free_window=_share_window(step_window, need, share),
                          search_window=_share_window(lambda at_least: step_window(at_least, False), full, share))


def worth_planning_L(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor, config,
                     total_layers: int | None = None) -> torch.Tensor:
    """bool ``[L]``: whether the full search may repay its host time on each layer (module
    docstring); ``total_layers``: the step's layer count ``L`` when ``loads_MLSE`` holds a
    share of it (split planning), so that the window share is the same in both modes."""
    L = loads_MLSE.shape[1]
    if plan_floor_s(topology, config) <= 0 or L == 0:
        return torch.ones(L, dtype=torch.bool)
    return _tiers(loads_MLSE, topology, placement_LE, config, total_layers).full_L()


def guarded_plan(loads_MLSE: torch.Tensor, topology: Topology, previous_placement_LE: torch.Tensor, config,
                 total_layers: int | None, search: Callable[[list[int], object], StepPlan],
                 step_window: Callable[..., float] | None = None,
                 others_planned: Callable[[], bool] | None = None) -> StepPlan | None:
    """``None`` when every layer is worth the full search (:func:`worth_planning_L`); else
    the step's plan: ``search(layers, config)`` plans the layers worth it (its ``L'``
    layers, in that order) with the guard off; of the others, those worth the light plan
    (``U_l + W'_l >= F'``, :class:`Tiers`) get it (:mod:`~relibra_torch.planning.light`)
    where its exact saving repays its schedules' charge, and the rest keep their placement, every expert on its owner
    (:func:`~relibra_torch.planning.fastpath.keep_plan`)."""
    L = loads_MLSE.shape[1]
    if plan_floor_s(topology, config) <= 0 or L == 0:
        return None
    if _surely_kept(loads_MLSE, topology, config, total_layers, step_window):
        return keep_plan(loads_MLSE, topology, previous_placement_LE, config)
    tiers = _tiers(loads_MLSE, topology, previous_placement_LE, config, total_layers, step_window)
    worth_L = tiers.full_L()
    if bool(worth_L.all()):
        return None
    plan = keep_plan(loads_MLSE, topology, previous_placement_LE, config)
    light_L = ~worth_L & tiers.light_L()
    ride_L = tiers.ride_L()
    if bool(ride_L.any()):  # where another layer of the step is planned (these, or others_planned())
        if not tiers.search_free():  # a layer its share would keep whole does not ride
            ride_L &= ~_below_L(loads_MLSE, topology, config, total_layers)
        if bool(ride_L.any()) and (bool(worth_L.any() or light_L.any()) or (others_planned is not None
                                                                            and others_planned())):
            light_L |= ride_L
    light = light_L.nonzero().flatten()
    if light.numel():   # kept where the exact saving (not the bound) repays its schedules' charge
        part = light_plan(loads_MLSE[:, light], plan.layers(light), config, tiers.light_saving_L()[light],
                          tiers.light_room_L()[light])
        plan = plan.with_layers(light, part)
    layers = worth_L.nonzero().flatten()
    if layers.numel():
        part = search(layers.tolist(), dataclasses.replace(config, plan_floor_s=0.0, plan_floor_nodes_s=0.0))
        plan = plan.with_layers(layers, part)
    return plan
