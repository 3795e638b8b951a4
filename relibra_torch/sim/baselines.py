"""Settings of the baseline systems (``[eplb]`` and ``[online]`` sections, ``--set eplb.X=..``).

Every default is a public figure or a public default, named next to it; docs/simulator.md
lists them. The baselines are held at their best: a setting is never chosen to make
relibra look better.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..checks import check_int, check_number
from ..planning.pricing import (LIGHT_SHARE, PLAN_FLOOR_NODES_S, PLAN_FLOOR_S, PLAN_LAYER_NODES_S, PLAN_LAYER_S,
                                PLAN_SCHEDULE_S)

__all__ = ["BaselineOptions", "SECTIONS", "baseline_options"]


@dataclass(frozen=True)
class BaselineOptions:
    """Settings of the EPLB and online systems.

    Attributes:
        eplb_interval: ``eplb`` (and ``eplb-instance``) rebalance every this many steps, from
            the mean load of the last ``eplb_window`` steps, and keep their replica table in
            between (vLLM ``--eplb-config.step_interval``, SGLang
            ``--eplb-rebalance-num-iterations``). The oracle variants plan every step.
        eplb_window: steps of history EPLB averages.
        eplb_num_groups: expert groups of the model for EPLB's hierarchical policy (used
            when the node count divides it; 1 = the global policy, for models without groups).
        online_plan_latency_us: run-time planning per layer and micro-batch on the critical
            path of ``online-node`` and ``online-global``. Default 67 us: the smallest
            ``update_placement`` time UltraEP publishes (EP 64, 256 experts: 67-78 us,
            README table); MoonEP publishes its planner only inside stacked bars.
        online_min_replica_tokens: fewest tokens an ``online-global`` replica takes
            (UltraEP's ``ULTRA_EP_QUOTA_MIN_TOKENS_PER_REPLICA`` default, 1024). MoonEP has
            no such floor and ``online-node`` uses none.
        planning_overlap_s: host work a step may spend planning ahead (planner, token splits)
            without delaying it; the excess is charged. ``None``: the cost model's forward
            pass over the step's tokens under the system's plan (RL pipelines compute old
            log-probs with the same replay before the update; planning runs meanwhile).
        planning_split: a planner that plans layers independently (``Planner.splits_layers``)
            plans on every EP rank at once, each rank its share of the layers, and the ranks
            all-gather the parts (the training hook's default, ``split_planning=True``): the
            slowest rank's share plus the gathers is the host work. ``False``: one thread
            plans the whole step (the hook's ``split_planning=False``).
        relibra_*: relibra's mechanisms (``ReLibraConfig`` fields), for ablations;
            ``plan_floor_s``, ``plan_floor_nodes_s`` (seconds, 0: off), ``plan_layer_s`` and
            ``plan_layer_nodes_s`` are the guard that keeps a layer's placement where the full
            search cannot repay its host time (``planning.worth``; defaults
            ``planning.pricing.PLAN_FLOOR_S`` etc.); ``light_share`` (0: off) sends the layers
            it keeps that can repay a step-long set's host time to ``planning.light``;
            ``plan_schedule_s``: every rank's schedule time per layer with copies;
            ``host_scale``, ``host_scale_nodes``: this host's planning time over the machine
            those were fitted on, one node and across nodes (``None``: measured here,
            :func:`with_host_scale`). A fixed
            ``planning.overlap_s`` turns the guard off: its window estimate is the default
            window's.
    """

    eplb_interval: int = 1
    eplb_window: int = 8
    eplb_num_groups: int = 1
    online_plan_latency_us: float = 67.0
    online_min_replica_tokens: int = 1024
    planning_overlap_s: float | None = None
    planning_split: bool = True
    relibra_cross_node_replicas: bool = True
    relibra_reorder: bool = True
    relibra_traffic_search: bool = True
    relibra_balance: bool = True
    relibra_two_hop: bool = True
    relibra_choose: bool = False
    relibra_spread_fills: bool = True
    relibra_relay: bool = True
    relibra_max_swap_rounds: int = 64
    relibra_swap_candidates: int = 8
    relibra_plan_floor_s: float = PLAN_FLOOR_S
    relibra_plan_floor_nodes_s: float = PLAN_FLOOR_NODES_S
    relibra_plan_layer_s: float = PLAN_LAYER_S
    relibra_plan_layer_nodes_s: float = PLAN_LAYER_NODES_S
    relibra_light_share: float = LIGHT_SHARE
    relibra_plan_schedule_s: float = PLAN_SCHEDULE_S
    relibra_host_scale: float | None = None
    relibra_host_scale_nodes: float | None = None

    def __post_init__(self) -> None:
        check_int("eplb.interval", self.eplb_interval, 1)
        check_int("eplb.window", self.eplb_window, 1)
        check_int("eplb.num_groups", self.eplb_num_groups, 1)
        check_number("online.plan_latency_us", self.online_plan_latency_us, 0.0)
        check_int("online.min_replica_tokens", self.online_min_replica_tokens, 0)
        if self.planning_overlap_s is not None:
            check_number("planning.overlap_s", self.planning_overlap_s, 0.0)
        if not isinstance(self.planning_split, bool):
            raise TypeError(f"planning.split is {self.planning_split!r}; allowed: true or false")
        for name in ("cross_node_replicas", "reorder", "traffic_search", "balance", "two_hop", "choose",
                     "spread_fills", "relay"):
            if not isinstance(getattr(self, f"relibra_{name}"), bool):
                raise TypeError(f"relibra.{name} is {getattr(self, f'relibra_{name}')!r}; allowed: true or false")
        check_int("relibra.max_swap_rounds", self.relibra_max_swap_rounds, 0)
        check_int("relibra.swap_candidates", self.relibra_swap_candidates, 1)
        check_number("relibra.plan_floor_s", self.relibra_plan_floor_s, 0.0)
        check_number("relibra.plan_floor_nodes_s", self.relibra_plan_floor_nodes_s, 0.0)
        check_number("relibra.plan_layer_s", self.relibra_plan_layer_s, 0.0)
        check_number("relibra.plan_layer_nodes_s", self.relibra_plan_layer_nodes_s, 0.0)
        check_number("relibra.light_share", self.relibra_light_share, 0.0, maximum=1.0)
        check_number("relibra.plan_schedule_s", self.relibra_plan_schedule_s, 0.0)
        for name in ("host_scale", "host_scale_nodes"):
            if getattr(self, f"relibra_{name}") is not None:
                check_number(f"relibra.{name}", getattr(self, f"relibra_{name}"), 0.0, strict=True)

    def guard_on(self) -> bool:
        """Whether relibra's guard (``planning.worth``) runs with these options."""
        return self.planning_overlap_s is None and max(self.relibra_plan_floor_s, self.relibra_plan_floor_nodes_s) > 0

    def relibra_fields(self) -> dict:
        """The ``ReLibraConfig`` fields set by the ``[relibra]`` section."""
        return {f.name[len("relibra_"):]: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name.startswith("relibra_")}

    def planner_kwargs(self, name: str) -> dict:
        """Keyword arguments of :func:`relibra_torch.planning.make_planner` for system ``name``
        (``eplb-node-demand``: ``num_groups``; its prices come from the cost model)."""
        if name == "eplb-node-demand":
            return {"num_groups": self.eplb_num_groups}
        if name == "online-global-planned":  # run ahead from replay: no run-time latency
            return {"min_replica_tokens": self.online_min_replica_tokens}
        if name.startswith("eplb"):
            kwargs = {"window": self.eplb_window, "num_groups": self.eplb_num_groups}
            if "oracle" not in name:
                kwargs["interval"] = self.eplb_interval
            return kwargs
        if name.startswith("online-"):
            kwargs = {"plan_latency_s": self.online_plan_latency_us * 1e-6}
            if name == "online-global":
                kwargs["min_replica_tokens"] = self.online_min_replica_tokens
            return kwargs
        return {}


SECTIONS = {
    "eplb": {"interval": int, "window": int, "num_groups": int},
    "online": {"plan_latency_us": float, "min_replica_tokens": int},
    "planning": {"overlap_s": float, "split": bool},
    "relibra": {"cross_node_replicas": bool, "reorder": bool, "traffic_search": bool, "balance": bool,
                "two_hop": bool, "choose": bool, "spread_fills": bool, "relay": bool, "max_swap_rounds": int, "swap_candidates": int,
                "plan_floor_s": float, "plan_floor_nodes_s": float, "plan_layer_s": float,
                "plan_layer_nodes_s": float, "light_share": float,
                "plan_schedule_s": float, "host_scale": float, "host_scale_nodes": float},
}
"""Sections and fields accepted in ``--config`` files and ``--set SECTION.FIELD=VALUE``."""


def _convert(section: str, name: str, kind: type, value: object) -> object:
    if kind is bool and isinstance(value, str):  # bool("false") would be True
        if value.strip().lower() in ("true", "1", "yes", "on"):
            return True
        if value.strip().lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{section}.{name} = {value!r}; allowed: true or false")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)                     # TOML/JSON write 10 for 10.0
    if not isinstance(value, str):
        return value
    try:
        return kind(value)
    except ValueError:
        what = "an int" if kind is int else "a number"
        raise ValueError(f"{section}.{name} = {value!r}; allowed: {what}") from None


def baseline_options(sections: dict[str, dict]) -> BaselineOptions:
    """:class:`BaselineOptions` from ``{"eplb": {FIELD: VALUE}, "online": {...}}``.

    Values may be strings (from ``--set``); unknown sections or fields raise ``ValueError``
    listing the allowed ones.
    """
    values = {}
    for section, fields in sections.items():
        if section not in SECTIONS:
            raise ValueError(f"unknown section {section!r}; allowed: {', '.join(SECTIONS)}")
        if not isinstance(fields, dict):
            raise ValueError(f"section {section!r} must be a table of FIELD = VALUE, got {fields!r}")
        for name, value in fields.items():
            if name not in SECTIONS[section]:
                raise ValueError(f"{section}.{name} is not a setting; allowed: "
                                 f"{', '.join(f'{section}.{f}' for f in SECTIONS[section])}")
            values[f"{section}_{name}"] = _convert(section, name, SECTIONS[section][name], value)
    known = {f.name for f in dataclasses.fields(BaselineOptions)}
    assert set(values) <= known
    return BaselineOptions(**values)


def with_host_scale(options: BaselineOptions, systems=("relibra",)) -> BaselineOptions:
    """``options`` with ``relibra.host_scale`` and ``host_scale_nodes`` set where unset and
    relibra is among ``systems``: measured on this host (``moe.host_speed``) where relibra's
    guard runs, else 1 (they scale nothing then). The simulator resolves them before any
    plan, so its JSON records the scales a run used."""
    unset = [n for n in ("host_scale", "host_scale_nodes") if getattr(options, f"relibra_{n}") is None]
    if not unset or "relibra" not in systems:
        return options
    from ..moe.host_speed import measure_host_scale
    measured = dict(zip(("host_scale", "host_scale_nodes"), measure_host_scale() if options.guard_on() else (1.0, 1.0)))
    return dataclasses.replace(options, **{f"relibra_{n}": measured[n] for n in unset})

