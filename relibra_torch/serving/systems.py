"""The five serving systems: their knobs, memory checks, and executors for the engine.

=============== ===================================================================================
system          what the model builds (``G`` GPUs, ``g`` GPUs per engine instance)
=============== ===================================================================================
colocated       ``G // g`` instances, each attention-DP + expert-parallel over ``g`` GPUs, serial
                (prefill-priority) batching.
chunked-prefill the same instances with mixed chunked-prefill iterations.
pd-disagg       ``n_p`` prefill + ``n_d`` decode instances of ``g`` GPUs (``n_p + n_d = G // g``,
                every integer split tried); a finished prefill sends its KV cache to the least
                loaded decode instance over RDMA; both instance kinds hold the whole model.
pd-colocate     ``G // g`` instances whose GPUs are split by a fixed SM share: prefill gets
                ``s_p``, decode ``1 - s_p`` (Green Contexts). A partition of share ``s`` has
                ``s`` of the compute and all of the HBM bandwidth, whether or not the other
                partition has work (idle reserved SMs); each lane is
                FIFO (head-of-line blocking).
expertplex      ``n_ap`` prefill and ``n_ad`` decode attention GPUs, ``n_e`` shared expert GPUs
                (one copy of the experts; any ``n_e`` that holds them, split unevenly when
                it does not divide the expert count). Attention GPUs push dispatch data into and pull
                results from the expert GPUs (attention-initiated: no communication kernel on
                the expert side, no cross-phase blocking). Expert GPUs multiplex both phases at
                tile granularity: per layer, decode takes the SM share at which its tiles
                finish as its expert weights stream in (``decode_sm_share``) and waits at most one tile plus one check for
                prefill tiles to yield; prefill runs on what decode leaves, both slowed by the
                paper's measured APK overheads. ``replicas`` extra expert slots per expert GPU
                (EPLB planned on a recent routing window) spread hot experts. ``groups``
                independent such deployments of ``group_nodes`` whole nodes each (every node
                used; with ``allow_idle`` any that fit), as the baselines run several
                instances: arrivals go to any group's prefill GPUs, hand-offs to any decode
                group (KV over RDMA across nodes).
=============== ===================================================================================

The search may leave GPUs idle (``allow_idle``): then every configuration of ``G`` GPUs is
also one of ``G + 1``, so goodput cannot fall when GPUs are added.

Legend: G GPUs of the cluster.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .constants import ServingConstants
from .cost import ServingCost, link_fractions, pair_s
from .engine import Engine, Executor
from .routing import TileTable, build_tile_table, replicated_placement, static_placement
from .tiles import decode_sm_share

__all__ = ["SYSTEMS", "Cluster", "SystemConfig", "enumerate_configs", "build_engine"]

SYSTEMS = ("expertplex", "pd-colocate", "pd-disagg", "colocated", "chunked-prefill")
COLOCATE_SHARES = (0.3, 0.4, 0.5, 0.6, 0.7)
REPLICA_CHOICES = (0, 2, 4)


@dataclass
class Cluster:
    """The cluster, model cost and routing that every configuration is built on."""

    num_gpus: int
    gpus_per_node: int
    cost: ServingCost
    pi_LE: torch.Tensor  # routing popularity the requests are served with
    recent_LE: torch.Tensor  # a recent routing window (replication is planned on it)
    seed: int = 0
    _tables: dict = field(default_factory=dict)
    memo: dict = field(default_factory=dict)  # pure per-batch costs shared by configurations and runs

    @property
    def consts(self) -> ServingConstants:
        return self.cost.c

    @property
    def num_nodes(self) -> int:
        return math.ceil(self.num_gpus / self.gpus_per_node)

    def table(self, expert_gpus: int, replicas: int = 0) -> TileTable:
        key = (expert_gpus, replicas)
        if key not in self._tables:
            L, E = self.pi_LE.shape
            slots = (static_placement(L, E, expert_gpus) if replicas == 0 and not self.consts.balanced_placement
                     else replicated_placement(self.recent_LE, expert_gpus, replicas))
            self._tables[key] = build_tile_table(self.pi_LE, slots, self.consts.tile_m, self.seed)
        return self._tables[key]


@dataclass(frozen=True)
class SystemConfig:
    """One configuration of one system: ``knobs`` by name, and the GPUs it uses."""

    system: str
    knobs: tuple[tuple[str, float], ...]
    gpus: int

    def get(self, name: str):
        return dict(self.knobs)[name]

    def label(self) -> str:
        return ", ".join(f"{k}={v:g}" for k, v in self.knobs)


def _instance_kv(cl: Cluster, g: int) -> int:
    c = cl.cost
    return c.kv_capacity(g, c.expert_bytes_total() / g + c.attention_side_bytes())


def _instance_sizes(cl: Cluster, need_kv: int) -> list[int]:
    E = cl.cost.model.num_experts
    sizes = [g for g in (1, 2, 4, 8, 16, 32, 64) if g <= cl.num_gpus and E % g == 0]
    return [g for g in sizes if _instance_kv(cl, g) >= need_kv]


def enumerate_configs(system: str, cl: Cluster, need_kv: int, allow_idle: bool = False) -> list[SystemConfig]:
    """Every configuration of ``system`` that fits in memory; ``need_kv`` is the largest
    request's KV footprint (prompt + output tokens) an engine must hold.

    Each placement comes with two prefill batch caps per attention GPU: the engine default
    (``max_prefill_tokens``, or ``chunk_tokens`` for chunked prefill) and a quarter of it
    (smaller batches: shorter waits behind a running batch, less batching efficiency)."""
    out = _placements(system, cl, need_kv, allow_idle)
    c = cl.consts
    base = c.chunk_tokens if system == "chunked-prefill" else c.max_prefill_tokens
    return [SystemConfig(x.system, x.knobs + (("batch_tokens_per_gpu", cap),), x.gpus)
            for x in out for cap in (base, max(1, base // 4))]


def _placements(system: str, cl: Cluster, need_kv: int, allow_idle: bool) -> list[SystemConfig]:
    G, out = cl.num_gpus, []
    counts = (lambda most: range(1, most + 1)) if allow_idle else (lambda most: [most] if most else [])
    if system in ("colocated", "chunked-prefill", "pd-colocate"):
        for g in _instance_sizes(cl, need_kv):
            for n in counts(G // g):
                shares = COLOCATE_SHARES if system == "pd-colocate" else (1.0,)
                for s in shares:
                    knobs = (("gpus_per_instance", g), ("instances", n))
                    out.append(SystemConfig(system, knobs + ((("prefill_share", s),) if system == "pd-colocate"
                                                             else ()), g * n))
    elif system == "pd-disagg":
        for g in _instance_sizes(cl, need_kv):
            for n in counts(G // g):
                for n_p in range(1, n):
                    out.append(SystemConfig(system, (("gpus_per_instance", g), ("prefill_instances", n_p),
                                                     ("decode_instances", n - n_p)), g * n))
    elif system in ("expertplex", "expertplex-repl"):
        c, E = cl.cost, cl.cost.model.num_experts
        reps = REPLICA_CHOICES[1:] if system == "expertplex-repl" else (0,)
        # one deployment over the cluster, or n_g alike of m whole nodes each: every node used,
        # or (allow_idle) any that fit, so every configuration of G GPUs is one of G + 1 too
        full = G // cl.gpus_per_node
        shapes = [(1, 0)] + [(n_g, m) for m in range(1, full + 1) for n_g in range(2, full // m + 1)
                             if allow_idle or (G % cl.gpus_per_node == 0 and n_g * m == full)]
        for n_g, m in shapes:
            Gg = m * cl.gpus_per_node if n_g > 1 else G
            # any count of expert GPUs (an uneven contiguous split when it does not divide E;
            # replicated, the slots that split leaves empty hold copies too)
            for n_e in range(1, min(Gg - 1, E + 1)):
                for r in reps:
                    slots = -(-E // n_e) + r
                    if c.expert_bytes_total() / E * slots > c.usable_bytes():
                        continue
                    for n_ap in range(1, Gg - n_e):
                        most_d = Gg - n_e - n_ap
                        for n_ad in (range(1, most_d + 1) if allow_idle else [most_d]):
                            if c.kv_capacity(n_ad, c.attention_side_bytes()) < need_kv:
                                continue
                            if n_g > 1 and n_e + n_ap + n_ad <= (m - 1) * cl.gpus_per_node:
                                continue  # fits in a node fewer: that group shape's configuration
                            for near in (1, 0):
                                knobs = (("expert_gpus", n_e), ("prefill_attention_gpus", n_ap),
                                         ("decode_attention_gpus", n_ad), ("prefill_near_experts", near)) \
                                    + ((("replicas", r),) if r else ()) \
                                    + ((("groups", n_g), ("group_nodes", m)) if n_g > 1 else ())
                                out.append(SystemConfig(system, knobs, n_g * (n_e + n_ap + n_ad)))
    else:
        raise ValueError(f"--systems: unknown system {system!r}; allowed: {', '.join(SYSTEMS)}, expertplex-repl")
    return out


def _dp_sync_s(cl: Cluster, attention_gpus: int) -> float:
    """Host time per iteration of ``attention_gpus`` data-parallel GPUs stepping together."""
    return cl.consts.dp_sync_us * 1e-6 if attention_gpus > 1 else 0.0


class _Instance:
    """Prices iterations of ``g`` GPUs doing attention and experts, at an SM share.

    A Green-Context partition (``partner`` set: the executor of the other partition) shares
    HBM and the links with its partner: while the partner runs, this partition's memory and
    link times stretch by ``1 + u``, ``u`` the fraction of its last iteration the partner
    kept HBM (or the links) busy (processor sharing by demand).
    """

    def __init__(self, cl: Cluster, g: int, share: float = 1.0):
        self.cost, self.g, self.share = cl.cost, g, share
        self.table = cl.table(g)
        self.frac = link_fractions(g, cl.gpus_per_node)
        self.partner: Executor | None = None
        self.util = (0.0, 0.0)  # (HBM, link) busy fractions of this partition's last iteration
        self.sync_s = _dp_sync_s(cl, g)
        # micro-batches overlap compute with the all-to-all; one GPU has no all-to-all
        self.overlap = cl.consts.micro_batch_overlap > 0 and sum(self.frac) > 0

    def _t(self, tokens, pairs, kv_read, rows, decode: bool = False) -> float:
        p = self.cost.parts(tokens, pairs, kv_read, rows, self.g, self.table, self.g, self.frac, decode)
        mem = link = 1.0
        if self.partner is not None:
            mem = (1.0 / self.share) ** self.cost.c.partition_bandwidth
            if self.partner.busy:
                u_mem, u_link = self.partner.pricer.util
                mem, link = mem * (1.0 + u_mem), 1.0 + u_link
        t = p.total_s(self.share, mem, link)
        busy_mem, busy_link = p.memory_s() * mem, p.comm_bytes_s * link
        if self.overlap and tokens >= 2:  # two overlapping micro-batches, where faster
            h = self.cost.parts(tokens / 2, pairs / 2, kv_read / 2, rows / 2, self.g, self.table, self.g,
                                self.frac, decode)
            t2 = pair_s(h.attn_s(self.share, mem), max(h.comm_bytes_s * link, h.comm_floor_s),
                        h.moe_s(self.share, mem), same_gpus=True)
            if t2 < t:
                t, busy_mem, busy_link = t2, 2 * h.memory_s() * mem, 2 * h.comm_bytes_s * link
        if t > 0:
            self.util = (min(1.0, busy_mem / t), min(1.0, busy_link / t))
            t += self.sync_s
        return t

    def prefill_s(self, tokens, pairs, kv_read, rows):
        return self._t(tokens, pairs, kv_read, rows)

    mixed_s = prefill_s

    def decode_s(self, batch, context):
        return self._t(batch, context, context, batch, decode=True)


def _fractions(src: range, dst: range, gpus_per_node: int) -> tuple[float, float]:
    """(NVLink, RDMA) fractions of traffic from each ``src`` GPU spread evenly over ``dst``."""
    same = sum(sum(1 for d in dst if d // gpus_per_node == s // gpus_per_node) for s in src)
    intra = same / (len(src) * len(dst))
    return intra, 1.0 - intra


class _ExpertPlex:
    """Prices both phases of ExpertPlex; each side reads the other's state (see the module doc).

    Every prefill attention GPU schedules its own batches (attention-initiated communication
    needs no collective, so they do not step together); the prefill batches in flight share
    the expert GPUs' compute equally. The decode attention GPUs step together as one batch.
    """

    def __init__(self, cl: Cluster, n_e: int, n_ap: int, n_ad: int, replicas: int, prefill_near: bool,
                 first_gpu: int = 0):
        self.cost, self.c = cl.cost, cl.consts
        self.n_e, self.n_ap, self.n_ad = n_e, n_ap, n_ad
        self.table = cl.table(n_e, replicas)
        self.table_key, self.memo = (n_e, replicas), cl.memo
        # GPUs are numbered node by node from first_gpu (a group's first): expert GPUs first,
        # then the phase placed near them
        gpn, o = cl.gpus_per_node, first_gpu
        experts = range(o, o + n_e)
        first, second = (n_ap, n_ad) if prefill_near else (n_ad, n_ap)
        a = range(o + n_e, o + n_e + first)
        b = range(o + n_e + first, o + n_e + first + second)
        pre, dec = (a, b) if prefill_near else (b, a)
        # each prefill attention GPU sends over its own links (a near one over NVLink only);
        # the decode GPUs step together, so the most remote one sets their step's traffic time
        self.prefill_fracs = [_fractions(range(g, g + 1), experts, gpn) for g in pre]
        link_s = lambda f: max(f[0] / self.cost.nvlink, f[1] / self.cost.rdma)  # noqa: E731
        self.frac = max((_fractions(range(g, g + 1), experts, gpn) for g in dec), key=link_s)
        self.prefill_nodes = [g // gpn for g in pre]
        self.decode_node = dec[0] // gpn
        # receivers: expert GPUs per node (their NVLink takes same-node senders, their NIC the rest)
        self.expert_nodes: dict[int, int] = {}
        for g in experts:
            self.expert_nodes[g // gpn] = self.expert_nodes.get(g // gpn, 0) + 1
        self.decode_ingress = self.ingress([g // gpn for g in dec])
        self._ingress: dict = {}  # prefill ingress by the sender nodes in flight
        self.prefill_xs: list[Executor] = []
        self.decode_x: Executor | None = None
        self.occupancy = 0.0  # fraction of expert SM time the running decode step takes
        self.decode_sync_s = _dp_sync_s(cl, n_ad)  # the decode attention GPUs step together
        self.overlap = cl.consts.micro_batch_overlap > 0

    def ingress(self, sender_nodes: list[int]) -> tuple[float, float]:
        """(NVLink, RDMA) bytes the busiest expert GPU receives per byte each sender sends,
        for senders on ``sender_nodes`` sending alike and spreading over the expert GPUs."""
        n, best, best_s = len(sender_nodes), (0.0, 0.0), -1.0
        for node in self.expert_nodes:
            near = sum(1 for s in sender_nodes if s == node)
            pair = (near / self.n_e, (n - near) / self.n_e)
            t = max(pair[0] / self.cost.nvlink, pair[1] / self.cost.rdma)
            if t > best_s:
                best, best_s = pair, t
        return best

    def prefill_s(self, tokens, pairs, kv_read, rows, gpu: int = 0):
        """One batch on prefill attention GPU ``gpu`` (its own links to the expert GPUs; the
        expert GPUs' ingress shared with the prefill batches in flight, taken as alike)."""
        senders = [self.prefill_nodes[gpu]] + [self.prefill_nodes[k] for k, x in enumerate(self.prefill_xs)
                                               if x.prefilling and k != gpu]
        key = tuple(senders)  # (a pure function of the sender nodes)
        ingress = self._ingress.get(key)
        if ingress is None:
            ingress = self._ingress[key] = self.ingress(senders)
        p = self.cost.parts(tokens, pairs, kv_read, rows, 1, self.table, self.n_e, self.prefill_fracs[gpu],
                            ingress=ingress)
        occ = self.occupancy if self.decode_x is not None and self.decode_x.decoding else 0.0
        slow = self.c.apk_prefill_slowdown if occ > 0 else 1.0
        sharing = len(senders)  # this batch and those in flight (this GPU's own is not yet running)
        share = max(1.0 - occ, 1e-3) / sharing
        t = p.attn_s() + p.comm_s + slow * p.moe_s(share)
        if self.overlap and tokens >= 2:  # ping-pong: attention of one micro-batch, experts of the other
            h = self.cost.parts(tokens / 2, pairs / 2, kv_read / 2, rows / 2, 1, self.table, self.n_e,
                                self.prefill_fracs[gpu], ingress=ingress)
            t = min(t, pair_s(h.attn_s(), h.comm_s, slow * h.moe_s(share), same_gpus=False))
        return t

    mixed_s = prefill_s

    def decode_s(self, batch, context):
        prefilling = any(x.prefilling for x in self.prefill_xs)
        attn, comm, moe, busy = self._decode_stages(batch, context, prefilling)
        step = attn + comm + moe
        if self.overlap and batch >= 2:  # ping-pong of two half batches, where faster
            a, c, m, b = self._decode_stages(batch / 2, context / 2, prefilling)
            pair = pair_s(a, c, m, same_gpus=False)
            if pair < step:
                step, busy = pair, 2 * b
        step += self.decode_sync_s  # the experts idle during the sync
        self.occupancy = busy / step if step > 0 else 0.0
        return step

    def _decode_stages(self, batch, context, prefilling: bool) -> tuple[float, float, float, float]:
        """(attention, communication, expert, expert SM-seconds held) of one decode step."""
        p = self.cost.parts(batch, context, context, batch, self.n_ad, self.table, self.n_e, self.frac, True,
                            ingress=self.decode_ingress)
        if prefilling:
            # a pure function of the batch size on this expert group (not of the context):
            # computed once per (group, batch) for every configuration and rate
            key = ("decode_moe", self.table_key, batch)
            hit = self.memo.get(key)
            if hit is None:
                hit = self.memo[key] = self._decode_moe_shared(batch, p.moe_memory_s)
            moe, busy = hit
        else:
            moe = p.moe_s()
            busy = moe
        return p.attn_s(), p.comm_s, moe, busy

    def _decode_moe_shared(self, batch, moe_memory_s: float) -> tuple[float, float]:
        """(expert seconds, expert SM-seconds held) of a decode step while prefill runs."""
        L = self.cost.model.num_moe_layers
        # per layer: decode's share from that layer's tile footprint (the runtime's rule)
        tiles_L, active_L = self.table.per_layer(batch)
        compute_L = tiles_L * self.cost.tile_time_s
        memory_L = np.full(L, moe_memory_s / L) * (active_L / max(active_L.mean(), 1e-12))
        share_L = decode_sm_share(tiles_L, self.cost.tile_time_s, memory_L, self.cost.num_sms)
        time_L = self.c.apk_decode_slowdown * np.maximum(compute_L / np.maximum(share_L, 1e-12), memory_L) \
            + self.cost.sm_tile_s + self.c.preempt_check_us * 1e-6  # + the preemption bound
        return float(time_L.sum()), float((share_L * time_L).sum())  # (time, expert SM-seconds decode holds)


class _PrefillPort:
    """The pricer of one ExpertPlex prefill attention GPU: :class:`_ExpertPlex` at its links."""

    def __init__(self, px: _ExpertPlex, gpu: int):
        self.px, self.gpu = px, gpu

    def prefill_s(self, tokens, pairs, kv_read, rows):
        return self.px.prefill_s(tokens, pairs, kv_read, rows, self.gpu)

    mixed_s = prefill_s


def build_engine(cfg: SystemConfig, cl: Cluster, arrival_N, prompt_N, output_N) -> Engine:
    """An :class:`Engine` for ``cfg`` over the requests (fresh state every call)."""
    c, k = cl.consts, dict(cfg.knobs)
    xs: list[Executor] = []
    transfer = None

    def lim(g):  # the engines' batch limits are per attention-DP GPU (one scheduler per DP rank)
        if cfg.system == "chunked-prefill":
            return dict(max_prefill_tokens=c.max_prefill_tokens * g,
                        chunk_tokens=int(k.get("batch_tokens_per_gpu", c.chunk_tokens)) * g)
        return dict(max_prefill_tokens=int(k.get("batch_tokens_per_gpu", c.max_prefill_tokens)) * g,
                    chunk_tokens=c.chunk_tokens * g)

    if cfg.system in ("colocated", "chunked-prefill"):
        g = int(k["gpus_per_instance"])
        mode = "serial" if cfg.system == "colocated" else "mixed"
        for i in range(int(k["instances"])):
            xs.append(Executor(f"i{i}", mode, _Instance(cl, g), kv_capacity=_instance_kv(cl, g),
                               max_running=c.max_running * g, **lim(g)))
    elif cfg.system == "pd-colocate":
        g, s = int(k["gpus_per_instance"]), float(k["prefill_share"])
        for i in range(int(k["instances"])):
            p = Executor(f"p{i}", "prefill", _Instance(cl, g, s), kv_capacity=0, max_running=1, **lim(g))
            d = Executor(f"d{i}", "decode", _Instance(cl, g, 1.0 - s), kv_capacity=_instance_kv(cl, g),
                         max_running=c.max_running * g, **lim(g))
            p.partner = d  # the hand-off goes to the same GPUs' decode partition (no KV transfer)
            p.pricer.partner, d.pricer.partner = d, p
            p.listeners.append(d)  # decode's contention changes when prefill starts or stops
            xs += [p, d]
    elif cfg.system == "pd-disagg":
        g = int(k["gpus_per_instance"])
        for i in range(int(k["prefill_instances"])):
            xs.append(Executor(f"p{i}", "prefill", _Instance(cl, g), kv_capacity=0, max_running=1,
                               node=i * g // cl.gpus_per_node, links=g, **lim(g)))
        n_p = int(k["prefill_instances"])
        for i in range(int(k["decode_instances"])):
            xs.append(Executor(f"d{i}", "decode", _Instance(cl, g), kv_capacity=_instance_kv(cl, g),
                               max_running=c.max_running * g, node=(n_p + i) * g // cl.gpus_per_node, links=g,
                               **lim(g)))
        spans = g > cl.gpus_per_node

        def transfer(prompt, src, dst):  # one request's KV lives on one attention-DP GPU
            cross = spans or src.node != dst.node
            return cl.cost.kv_transfer_s(prompt, cross), "rdma" if cross else "nvlink"
    else:  # expertplex, expertplex-repl: one group, or several alike of whole nodes each
        n_e, n_ap, n_ad = int(k["expert_gpus"]), int(k["prefill_attention_gpus"]), int(k["decode_attention_gpus"])
        groups, span = int(k.get("groups", 1)), int(k.get("group_nodes", 0)) * cl.gpus_per_node
        for j in range(groups):
            px = _ExpertPlex(cl, n_e, n_ap, n_ad, int(k.get("replicas", 0)), bool(k["prefill_near_experts"]),
                             first_gpu=j * span)
            tag = f"g{j}" if groups > 1 else ""
            d = Executor(f"{tag}d", "decode", px, kv_capacity=cl.cost.kv_capacity(n_ad, cl.cost.attention_side_bytes()),
                         max_running=c.max_running * n_ad, node=px.decode_node, links=n_ad, **lim(n_ad))
            for i in range(n_ap):
                p = Executor(f"{tag}p{i}", "prefill", _PrefillPort(px, i), kv_capacity=0, max_running=1,
                             node=px.prefill_nodes[i], **lim(1))
                p.listeners.append(d)  # decode's step price changes when prefill starts or stops
                px.prefill_xs.append(p)
                xs.append(p)
            px.decode_x = d
            xs.append(d)
        def transfer(prompt, src, dst):  # prefill attention GPU -> decode attention GPU
            cross = src.node != dst.node
            return cl.cost.kv_transfer_s(prompt, cross), "rdma" if cross else "nvlink"
    return Engine(arrival_N, prompt_N, output_N, xs, transfer)
