"""The serving cost model: roofline time of one engine iteration, memory, KV transfer.

Every kernel's time is ``max(FLOPs / compute rate, bytes read / HBM bandwidth)`` per GPU:

* compute rates: FP8 GEMMs (projections, experts, LM head) at ``2 x bf16_tflops x
  fp8_efficiency``; the attention core (QK^T and PV, FlashAttention-3 in bf16) at
  ``bf16_tflops x dense_efficiency``;
* bandwidth: ``hbm_gbps x hbm_efficiency``; decode reads every weight once per iteration and
  the KV cache of every running request, so it is bandwidth-bound.

Attention of one layer on ``g_a`` data-parallel attention GPUs, for ``T`` new tokens with
``P`` (query, key) pairs and ``R`` cached tokens read::

    FLOPs = 2 * proj_params * T  (FP8)  +  2 * (qk_dim + v_dim) * P  (bf16)
    bytes = proj_params * wb + (R + T) * kv_per_token_layer * kv_bytes / g_a

with ``P = c * p + c (c + 1) / 2`` for a prefill chunk of ``c`` tokens after ``p`` cached
ones, and ``P = R = context`` for a decode token. Experts of one MoE layer on ``g_e`` EP
GPUs: FLOPs ``= tiles * M_t * 6 D F`` (the slowest GPU's row tiles: tile-granular, not
token-granular), bytes ``= active experts * 3 D F * wb`` plus the routed activations.
Dispatch + combine move ``T * c * D * (dispatch_bytes + combine_bytes)`` per layer over
NVLink (same node) or RDMA (other nodes) at the hardware preset's bandwidths, limited by the
sender's egress and the busiest receiver's ingress (many senders into few expert GPUs: the
receivers' links bind; :meth:`ServingCost.link_s`), and take at
least (decode iterations: SGLang runs DeepEP's low-latency kernels for decode batches, the
normal ones for prefill) DeepEP's measured low-latency time for the EP size (``a2a_latency_us``), scaled by the
bytes per rank against the README's 128-token, 7168-hidden benchmark (its times are
transfer times: time x its bandwidth column = its bytes); ``c = g_e (1 -
(1 - 1/g_e)^K)`` is the expected number of distinct expert GPUs among a token's ``K`` experts
(DeepEP sends a token once per destination GPU). One
iteration is the sum over layers of attention, communication and experts in sequence, plus
the LM head for the rows that sample; or, where faster, two overlapping micro-batches
(:func:`pair_s`, ``serving.micro_batch_overlap``).

Legend: T tokens of an iteration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..planning.pricing import HardwareSpec
from ..sim.presets import ModelSpec
from .constants import A2A_REFERENCE, SM_COUNT, ServingConstants
from .routing import TileTable

__all__ = ["Parts", "ServingCost", "link_fractions", "pair_s"]

MEMO_ENTRIES = 200_000  # per-batch-size parts kept by ServingCost.parts (cleared when full)


@dataclass(frozen=True)
class Parts:
    """One iteration's work by where it runs, summed over layers (seconds at a full GPU).

    ``attn``: ``(compute, memory)`` seconds of each attention-side kernel kind (attention,
    shared experts, dense FFNs, LM head) on the attention GPUs; ``comm_s``: dispatch and
    combine; ``moe_compute_s`` / ``moe_memory_s``: the expert grouped GEMMs on the slowest
    expert GPU; ``moe_tiles``: that GPU's row tiles per layer.

    An SM share ``s`` (Green Contexts, tile multiplexing) divides compute, not HBM bandwidth,
    which every SM reaches: a kernel at share ``s`` takes ``max(compute / s, memory)``.
    """

    attn: tuple[tuple[float, float], ...]
    comm_bytes_s: float
    comm_floor_s: float
    moe_compute_s: float
    moe_memory_s: float
    moe_tiles: float

    @property
    def comm_s(self) -> float:
        return max(self.comm_bytes_s, self.comm_floor_s)

    def attn_s(self, share: float = 1.0, mem: float = 1.0) -> float:
        return sum(max(c / share, m * mem) for c, m in self.attn)

    def moe_s(self, share: float = 1.0, mem: float = 1.0) -> float:
        return max(self.moe_compute_s / share, self.moe_memory_s * mem)

    def total_s(self, share: float = 1.0, mem: float = 1.0, link: float = 1.0) -> float:
        """At SM share ``share``, with memory and link times stretched by ``mem`` / ``link``
        (contention from a concurrent partition)."""
        return (self.attn_s(share, mem) + max(self.comm_bytes_s * link, self.comm_floor_s)
                + self.moe_s(share, mem))

    def memory_s(self) -> float:
        """Seconds the iteration keeps HBM busy (its memory-bound time)."""
        return sum(m for _, m in self.attn) + self.moe_memory_s


def pair_s(attn: float, comm: float, moe: float, same_gpus: bool) -> float:
    """One iteration run as two micro-batches that overlap (SGLang's two-batch overlap,
    ExpertPlex's attention/expert ping-pong), from ONE micro-batch's stage times (each stage
    priced at half the batch: weights are read once per micro-batch).

    Per layer, every resource serves both micro-batches (the attention GPUs ``2 attn``, the
    links ``2 comm``, the expert GPUs ``2 moe``; with ``same_gpus`` attention and experts
    share one GPU, ``2 (attn + moe)``), and one micro-batch's own chain ``attn + comm + moe``
    must finish before its next layer starts: the iteration takes the largest of those
    (max of stages, not their sum). No overlap overhead is added (no published figure)."""
    chain = attn + comm + moe
    if same_gpus:
        return max(2.0 * (attn + moe), 2.0 * comm, chain)
    return max(2.0 * attn, 2.0 * comm, 2.0 * moe, chain)


def link_fractions(num_gpus: int, gpus_per_node: int) -> tuple[float, float]:
    """(NVLink, RDMA) fractions of all-to-all traffic for ``num_gpus`` node-packed GPUs."""
    local = min(num_gpus, gpus_per_node)
    return (local - 1) / num_gpus, (num_gpus - local) / num_gpus


class ServingCost:
    """Prices iterations, memory and KV transfers for one model on one GPU type."""

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, consts: ServingConstants,
                 tile_time_us: float | None = None):
        self.model, self.hw, self.c = model, hardware, consts
        m = model
        self.fp8_rate = 2.0 * hardware.bf16_tflops * 1e12 * consts.fp8_efficiency
        self.bf16_rate = hardware.bf16_tflops * 1e12 * hardware.dense_efficiency
        self.bw = hardware.hbm_gbps * 1e9 * consts.hbm_efficiency
        self.nvlink = hardware.nvlink_gbps * 1e9
        self.rdma = hardware.inter_node_gbps * 1e9
        self.num_sms = SM_COUNT.get(hardware.name, 132)
        D, F = m.hidden_size, m.moe_ffn
        self.expert_params = 3 * D * F
        self.expert_flops_per_row = 6 * D * F
        # one row tile through the whole expert (gate, up, down) on the whole GPU
        self.tile_time_s = (tile_time_us * 1e-6 if tile_time_us is not None
                            else consts.tile_m * self.expert_flops_per_row / self.fp8_rate)
        # one tile job on one SM (M_t x tile_n outputs of gate/up over K = D): the preemption bound
        self.sm_tile_s = 2 * consts.tile_m * consts.tile_n * D / (self.fp8_rate / self.num_sms)
        if tile_time_us is not None:  # a measured tile time scales the per-SM tile alike
            self.sm_tile_s *= self.tile_time_s / (consts.tile_m * self.expert_flops_per_row / self.fp8_rate)
        self.col_blocks = math.ceil(2 * F / consts.tile_n)
        if m.is_mla:
            self.kv_per_token_layer = (m.kv_lora_rank + m.qk_rope_head_dim) * consts.kv_bytes
        else:
            self.kv_per_token_layer = 2 * m.num_kv_heads * m.head_dim * consts.kv_bytes
        self.kv_per_token = self.kv_per_token_layer * m.num_layers
        self.proj = m.attention_projection_params()
        self.attn_pair_flops = 2 * (m.attention_qk_dim() + m.attention_v_dim())
        self.shared_params = 3 * D * m.shared_ffn * m.num_shared_experts
        self.dense_params = 3 * D * m.dense_ffn
        self.lm_params = D * m.vocab_size
        self._memo: dict = {}  # parts' batch-size-only terms, by (table, tokens, rows, group, links)
        self._tables: dict = {}  # id -> table for every table in the memo (keeps the ids unique)

    def a2a_floor_s(self, ep: int, tokens_per_rank: float) -> float:
        """DeepEP low-latency dispatch + combine of one layer at EP size ``ep`` (see constants):
        the README's time for its shape, scaled by this layer's bytes per rank (its times are
        transfer times at the kernels' achieved bandwidth)."""
        pts, k = self.c.a2a_latency_us, self.c.a2a_floor * 1e-6
        ref_t, ref_k, ref_d = A2A_REFERENCE
        k *= tokens_per_rank * self.model.top_k * self.model.hidden_size / (ref_t * ref_k * ref_d)
        if ep <= pts[0][0]:
            return pts[0][1] * k
        for (e0, t0), (e1, t1) in zip(pts, pts[1:]):
            if ep <= e1:
                w = math.log(ep / e0) / math.log(e1 / e0)
                return (t0 + w * (t1 - t0)) * k
        return pts[-1][1] * k

    def link_s(self, egress: tuple[float, float], ingress: tuple[float, float] | None = None) -> float:
        """Seconds per byte a GPU sends: the slower of its own egress and the busiest
        receiver's ingress, each over its NVLink and NIC in parallel (every link full duplex,
        so dispatch and combine are each limited per direction by the same two ends).

        ``egress``: (NVLink, RDMA) fractions of this GPU's bytes; ``ingress``: (NVLink, RDMA)
        bytes the busiest receiver takes per byte this GPU sends (``None``: the symmetric
        all-to-all, equal to ``egress``)."""
        out = max(egress[0] / self.nvlink, egress[1] / self.rdma)
        if ingress is None:
            return out
        return max(out, ingress[0] / self.nvlink, ingress[1] / self.rdma)

    # --- memory ---------------------------------------------------------------------------
    def expert_bytes_total(self) -> float:
        m = self.model
        return m.num_moe_layers * m.num_experts * self.expert_params * self.c.weight_bytes

    def attention_side_bytes(self) -> float:
        """Weights every attention (data-parallel) GPU holds: all but the routed experts."""
        m = self.model
        params = (m.num_layers * self.proj + m.num_dense_layers * self.dense_params
                  + m.num_moe_layers * self.shared_params + 2 * self.lm_params)
        return params * self.c.weight_bytes

    def usable_bytes(self) -> float:
        return self.hw.hbm_gb * 1e9 * self.c.mem_fraction

    def kv_capacity(self, num_gpus: int, weight_bytes_per_gpu: float) -> int:
        """KV-cache tokens ``num_gpus`` GPUs hold after ``weight_bytes_per_gpu`` of weights (<= 0: no fit)."""
        free = self.usable_bytes() - weight_bytes_per_gpu
        return int(num_gpus * free // self.kv_per_token) if free > 0 else 0

    def kv_transfer_s(self, prompt_tokens: int, cross_node: bool) -> float:
        """Moving one request's KV cache from its prefill GPU to its decode GPU."""
        link = self.rdma if cross_node else self.nvlink
        return prompt_tokens * self.kv_per_token / link

    # --- time -----------------------------------------------------------------------------
    def _kernel(self, fp8_flops: float, bf16_flops: float, nbytes: float, count: int) -> tuple[float, float]:
        """``(compute, memory)`` seconds of ``count`` identical kernels."""
        return (count * (fp8_flops / self.fp8_rate + bf16_flops / self.bf16_rate), count * nbytes / self.bw)

    def parts(self, tokens: float, pairs: float, kv_read: float, lm_rows: float, attn_gpus: int,
              table: TileTable, expert_gpus: int, fractions: tuple[float, float], decode: bool = False,
              ingress: tuple[float, float] | None = None) -> Parts:
        """One iteration over all layers.

        Args:
            tokens: new tokens (prefill chunk tokens + one per decoding request).
            pairs: attention (query, key) pairs of the iteration.
            kv_read: cached KV tokens the iteration reads (decode contexts, prefill prefixes).
            lm_rows: rows through the LM head (one per request that samples a token).
            attn_gpus, expert_gpus: GPUs sharing attention (data parallel) and experts (EP).
            table: the expert group's tile table.
            fractions: (NVLink, RDMA) fractions of the dispatched tokens (the sender's egress).
            ingress: (NVLink, RDMA) bytes arriving at the busiest receiving GPU per byte this
                GPU sends (the receivers' ingress; :meth:`link_s`); None: a symmetric
                all-to-all, where every GPU receives what it sends (``fractions``).
            decode: a decode iteration: DeepEP's low-latency kernels, at least their measured
                time (SGLang's default ``--deepep-mode auto`` runs decode batches on them and
                prefill / extend batches on the normal kernels, priced by the link term alone).
        """
        if tokens <= 0:
            return Parts((), 0.0, 0.0, 0.0, 0.0, 0.0)
        # everything but the attention core's pairs and KV reads is a function of the batch
        # size on this group: computed once per key for every configuration and rate
        key = (id(table), tokens, lm_rows, attn_gpus, expert_gpus, fractions, decode, ingress)
        rest = self._memo.get(key)
        if rest is None:
            if len(self._memo) >= MEMO_ENTRIES:  # bound the memory (prefill batch sizes vary widely)
                self._memo.clear()
            self._tables[id(table)] = table  # keeps the table alive, so its id is never reused
            rest = self._memo[key] = self._token_parts(tokens, lm_rows, attn_gpus, table, expert_gpus,
                                                       fractions, decode, ingress)
        others, comm, floor, moe_c, moe_m, tiles = rest
        m = self.model
        attn = self._kernel(2 * self.proj * (tokens / attn_gpus), self.attn_pair_flops * pairs / attn_gpus,
                            self.proj * self.c.weight_bytes
                            + (kv_read + tokens) * self.kv_per_token_layer / attn_gpus, m.num_layers)
        return Parts((attn,) + others, comm, floor, moe_c, moe_m, tiles)

    def _token_parts(self, tokens, lm_rows, attn_gpus, table, expert_gpus, fractions, decode, ingress):
        """:meth:`parts` less the attention core: (other attention-side kernels, comm, floor,
        expert compute, expert memory, tiles)."""
        m, c = self.model, self.c
        t_gpu = tokens / attn_gpus
        wb = c.weight_bytes
        kernels = [self._kernel(2 * self.lm_params * lm_rows / attn_gpus, 0.0, self.lm_params * wb, 1)]
        if self.shared_params:
            kernels.append(self._kernel(2 * self.shared_params * t_gpu, 0.0, self.shared_params * wb,
                                        m.num_moe_layers))
        if self.dense_params:
            kernels.append(self._kernel(2 * self.dense_params * t_gpu, 0.0, self.dense_params * wb,
                                        m.num_dense_layers))
        # DeepEP-style dispatch sends a token once per destination GPU (not once per expert):
        # expected distinct GPUs among top_k picks spread over the expert GPUs
        copies = expert_gpus * (1.0 - (1.0 - 1.0 / expert_gpus) ** m.top_k)
        wire = t_gpu * copies * m.hidden_size * (c.dispatch_bytes + c.combine_bytes)
        intra, inter = fractions
        alone = intra + inter == 0  # one GPU doing everything: no all-to-all
        comm = 0.0 if alone else wire * self.link_s(fractions, ingress)
        floor = 0.0 if alone or not decode else self.a2a_floor_s(expert_gpus, t_gpu)
        tiles = table.tiles(tokens)
        routed_bytes = tokens * m.top_k * m.hidden_size * (c.dispatch_bytes + c.combine_bytes) / expert_gpus
        moe_c = tiles * self.tile_time_s
        moe_m = (table.active(tokens) * self.expert_params * wb + routed_bytes) / self.bw
        L = m.num_moe_layers
        return tuple(kernels), L * comm, L * floor, L * moe_c, L * moe_m, tiles


def prefill_pairs(prompt: int, done: int, chunk: int) -> float:
    """Causal (query, key) pairs of ``chunk`` new tokens after ``done`` cached ones."""
    return chunk * done + chunk * (chunk + 1) / 2
