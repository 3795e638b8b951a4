"""Every constant of the serving model, each with its source (fixed before any goodput run).

The hardware itself (peak bf16 TFLOP/s, HBM capacity and bandwidth, NVLink and RDMA
bandwidth) comes from :mod:`relibra_torch.planning.pricing`'s presets. What serving adds is
here: the number formats of the served checkpoints, the efficiencies of inference kernels
(FP8 GEMMs, decode-shaped reads), the SM count that sizes a tile wave, the tile shape, the
paper's kernel microbenchmark (the cost of adaptive persistent kernels), the engines'
scheduler defaults and the paper's SLO. ``docs/serving.md`` lists them all with sources.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..checks import check_int, check_number

__all__ = ["ServingConstants", "DEFAULT_CONSTANTS", "SM_COUNT", "A2A_REFERENCE", "override_constants"]

# Streaming multiprocessors per GPU: H100 SXM5, H800 SXM5 and H200 SXM all have 132 SMs
# (NVIDIA H100 Tensor Core GPU Architecture whitepaper; the H200 and H800 are the same GH100
# die configuration). A tile wave is one tile per SM.
SM_COUNT = {"h100": 132, "h200": 132, "h800": 132}

# DeepEP README's low-latency benchmark shape: (tokens per rank, top-k, hidden) of its table
A2A_REFERENCE = (128, 8, 7168)


@dataclass(frozen=True)
class ServingConstants:
    """Constants of the serving cost model (see the module doc and docs/serving.md).

    Attributes:
        weight_bytes: bytes per served weight. 1: the published MiniMax-M2 and GLM-5.1-FP8
            checkpoints are FP8 with 128 x 128 block scales (their config.json
            ``quantization_config``); the paper serves those.
        kv_bytes: bytes per KV-cache value. 2: SGLang's default ``kv_cache_dtype="auto"`` keeps
            the model's bf16 activations.
        dispatch_bytes, combine_bytes: bytes per hidden value sent to / returned from an expert
            (DeepEP's serving setting: "FP8 dispatching and BF16 combining", DeepEP README).
        fp8_efficiency: fraction of the FP8 tensor-core peak (2 x the bf16 dense peak,
            NVIDIA H100/H200 datasheets) that the GEMMs reach. DeepGEMM reports up to 1,550
            FP8 TFLOP/s on H800 (0.78 of 1,979); MoE grouped shapes are below its best: 0.70.
        hbm_efficiency: fraction of peak HBM bandwidth that decode-shaped (memory-bound)
            kernels reach. DeepGEMM's README lists 1.7-2.6 TB/s for its decode-shaped FP8
            GEMMs on the 3.35 TB/s H800: 0.75.
        tile_m: tile height ``M_t`` (rows) of the expert grouped GEMM; 64 is DeepGEMM's
            ``block_m`` for the decode (masked) layout, also used for prefill here.
        tile_n: tile width (output columns a tile computes); DeepGEMM's ``block_n`` 128.
        apk_decode_slowdown: decode expert time under adaptive persistent kernels relative to
            alone: 1.08 (the paper's kernel microbenchmark: "decode +8%").
        apk_prefill_slowdown: the same for prefill: 1.12 (the paper: "prefill 1.12x slower").
        preempt_check_us: the time of one preemption check at a tile boundary. 0: the paper
            gives no separate figure; its +8% decode cost already contains the checks. The
            per-SM tile time (one tile, the other half of the bound) is computed.
        mem_fraction: fraction of HBM an engine gives to weights + KV cache: 0.85 (SGLang's
            ``mem_fraction_static`` default is 0.79-0.88 depending on TP size and GPU).
        max_prefill_tokens: tokens per prefill batch per attention (data-parallel) GPU: 16,384
            (SGLang ``--max-prefill-tokens`` default, per DP rank's scheduler).
        chunk_tokens: token budget of one mixed (chunked-prefill) iteration per attention
            GPU: 8,192 (vLLM V1's
            default ``max_num_batched_tokens`` for the API server on H100-class GPUs; SGLang's
            ``chunked_prefill_size`` default is 8,192 on 80-141 GB GPUs too).
        max_running: cap on concurrent decode requests per attention (data-parallel) GPU:
            1,024 (SGLang runs one scheduler per DP rank and derives ``max_running_requests``
            from its KV pool; 1,024 bounds it where the pool would allow more, as vLLM V1's
            ``max_num_seqs`` does for the API server on H100-class GPUs).
        a2a_latency_us: one MoE layer's dispatch + combine with DeepEP's low-latency kernels,
            by EP size, at the README's benchmark shape (H800, 128 tokens per rank, hidden
            7168, top-8, FP8 dispatch, BF16 combine: ``A2A_REFERENCE``): dispatch 77 / 118 /
            155 / 173 / 192 / 194 us and combine 114 / 195 / 273 / 314 / 369 / 360 us at EP 8
            / 16 / 32 / 64 / 128 / 256. The README's bandwidth column shows these are
            transfer times, not latencies: 77 us x 98 GB/s and 114 us x 127 GB/s are the
            7.3 MB FP8 and 14.7 MB BF16 the kernels move per rank (one copy per selected
            expert). So a decode layer takes this time scaled by its bytes per rank relative
            to the benchmark's (``tokens per rank x top_k x hidden``), or its bytes over the
            links if longer. Prefill and mixed (extend) iterations run DeepEP's normal kernels
            in SGLang (``--deepep-mode auto``) and are priced by the link term alone.
            Interpolated in log EP size; EP < 8 uses the EP-8 figure.
        a2a_floor: multiplier of that time (1; 0 turns it off, to measure what it does).
        partition_bandwidth: 0 (default): a Green-Context partition reaches all of HBM's
            bandwidth (GC partitions SMs only); 1: its bandwidth follows its SM share (the
            pessimistic bound for small partitions; a sensitivity switch, no source picks it).
        dp_sync_us: host time every iteration of a data-parallel attention group (more than
            one attention GPU stepping together) pays before its GPUs can start: SGLang's
            DP-attention scheduler gathers every rank's batch metadata and blocks on it each
            step, measured at 454.6 us per scheduler step with 4 DP ranks (sglang PR #34338,
            "[perf] Collapse the DP attention scheduler sync to a single D2H copy", its
            microbenchmark before the change; the paper's SGLang baselines predate it): 455.
            The rest of the scheduler's CPU work overlaps the GPU (SGLang's overlap scheduler
            is on by default); a single-GPU scheduler (an ExpertPlex prefill attention GPU)
            has no gather.
        micro_batch_overlap: 1 (default): an iteration with expert communication may run as
            two overlapping micro-batches (``cost.pair_s``), whichever is faster, in every
            system that has it: SGLang's two-batch overlap (``--enable-two-batch-overlap``,
            DP attention + DeepEP: colocated, chunked-prefill, pd-disagg, pd-colocate) and
            ExpertPlex's ping-pong of attention and expert servers; 0: off (iterations in
            sequence). No overhead figure was found, so none is charged.
        balanced_placement: 0 (default): every EP group holds its experts in contiguous
            blocks (expert ``e`` on GPU ``e // (E / G)``, SGLang's layout without
            ``--enable-eplb``); 1: in EPLB's balanced placement planned on the recent routing
            window (``routing.replicated_placement`` with no replica slots: no copies where
            the GPUs divide the experts, the rounding slots filled otherwise), in every system
            alike: a sensitivity switch, to see what balancing alone gives each of them.
        min_trace_s: the shortest span a trace is simulated over at any rate: a trace that,
            sped up to the rate tried, spans less is repeated back to back until it spans
            this long (``Requests.scaled``), so goodput is a steady-state rate, not how fast a
            few seconds' burst is absorbed. 60 s: a request lives ~8 s at the SLO (TTFT 1 s +
            254 mean output tokens x 30 ms on the default trace), and SGLang's
            ``bench_serving`` default of 1,000 prompts at the paper's ~34 req/s lasts ~30 s.
            0 turns it off (the first model's behaviour). At most ``max_trace_requests``
            (50,000) requests are simulated per run: above 50,000 / 60 = 833 req/s the span
            falls short of 60 s (the JSON's curve keeps each run's rate).
        ttft_slo_s, tpot_slo_s: the paper's SLO for MiniMax-M2.7: TTFT 1 s, TPOT 50 ms.
        attainment: fraction of requests that must meet both SLOs: 0.9 (P90 goodput).
    """

    weight_bytes: float = 1.0
    kv_bytes: float = 2.0
    dispatch_bytes: float = 1.0
    combine_bytes: float = 2.0
    fp8_efficiency: float = 0.70
    hbm_efficiency: float = 0.75
    tile_m: int = 64
    tile_n: int = 128
    apk_decode_slowdown: float = 1.08
    apk_prefill_slowdown: float = 1.12
    preempt_check_us: float = 0.0
    mem_fraction: float = 0.85
    max_prefill_tokens: int = 16384
    chunk_tokens: int = 8192
    max_running: int = 1024
    a2a_latency_us: tuple[tuple[int, float], ...] = ((8, 191.0), (16, 313.0), (32, 428.0), (64, 487.0),
                                                     (128, 561.0), (256, 554.0))
    a2a_floor: float = 1.0
    partition_bandwidth: float = 0.0
    dp_sync_us: float = 455.0
    micro_batch_overlap: float = 1.0
    balanced_placement: float = 0.0
    min_trace_s: float = 60.0
    max_trace_requests: int = 50000
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.05
    attainment: float = 0.9

    def __post_init__(self) -> None:
        for f in ("weight_bytes", "kv_bytes", "dispatch_bytes", "combine_bytes", "ttft_slo_s", "tpot_slo_s"):
            check_number(f"serving.{f}", getattr(self, f), 0, strict=True)
        for f in ("fp8_efficiency", "hbm_efficiency", "mem_fraction", "attainment"):
            check_number(f"serving.{f}", getattr(self, f), 0, strict=True, maximum=1)
        for f in ("apk_decode_slowdown", "apk_prefill_slowdown"):
            check_number(f"serving.{f}", getattr(self, f), 1)
        check_number("serving.preempt_check_us", self.preempt_check_us, 0)
        check_number("serving.a2a_floor", self.a2a_floor, 0)
        check_number("serving.dp_sync_us", self.dp_sync_us, 0)
        check_number("serving.partition_bandwidth", self.partition_bandwidth, 0, maximum=1)
        check_number("serving.micro_batch_overlap", self.micro_batch_overlap, 0, maximum=1)
        if self.balanced_placement not in (0.0, 1.0):
            raise ValueError(f"serving.balanced_placement = {self.balanced_placement:g}; allowed: 0 (contiguous "
                             "blocks) or 1 (EPLB's balanced placement)")
        check_number("serving.min_trace_s", self.min_trace_s, 0)
        for f in ("tile_m", "tile_n", "max_prefill_tokens", "chunk_tokens", "max_running", "max_trace_requests"):
            check_int(f"serving.{f}", getattr(self, f))


DEFAULT_CONSTANTS = ServingConstants()


def override_constants(base: ServingConstants, pairs: dict[str, str]) -> ServingConstants:
    """``base`` with ``serving.FIELD=VALUE`` overrides (values parsed as the field's type)."""
    types = {f.name: f.type for f in fields(ServingConstants) if f.name != "a2a_latency_us"}
    changes = {}
    for key, raw in pairs.items():
        if key not in types:
            raise ValueError(f"--set serving.{key}: not a field; allowed: {', '.join(types)}")
        try:
            changes[key] = int(raw) if types[key] == "int" else float(raw)
        except ValueError:
            raise ValueError(f"--set serving.{key}={raw!r}: not a{'n int' if types[key] == 'int' else ' number'}") from None
    return replace(base, **changes)
