"""Summarise a routing replay file (relibra.routing/1) or a loads file (relibra.loads/1).

Prints the sizes (samples, tokens, layers, experts, top-k) and, per MoE layer, the max and
mean expert load and their ratio, the Load-Imbalance Score (LIS = max_j n_j / (n * k / m),
:func:`relibra_torch.planning.lis`), with its mean and max over the layers, next to the
uniform-routing baseline: the expected
max/mean if every token picked top-k distinct experts uniformly at random at the same token
count (:func:`relibra_torch.replay.baseline.uniform_max_over_mean`, an exact seeded
simulation; the output says how many trials).

For a loads file, LIS is computed per (step, micro-batch) on loads summed over source
ranks, then averaged (and the worst shown) over the non-empty micro-batches; so is the
baseline, simulated for all distinct token counts in one sweep, with fewer trials per
count when there are many counts, so that a large file stays fast.

The file kind is detected from its metadata ``format``. A bad file prints one line and
exits with status 2.
"""

from __future__ import annotations

import argparse

import torch

from ..planning.lis import lis
from .baseline import mean_over_token_counts, uniform_max_over_mean
from .fileio import one_line, read_header
from .loads import LOADS_FORMAT, LoadsFile, load_loads
from .routing import ROUTING_FORMAT, RoutingReplay, load_routing

HELP = "summarise a routing replay or loads file (sizes, per-layer LIS = max/mean expert load vs uniform routing)"

# Trials of the baseline simulation for a routing file (one token count): ~0.05 s at 128
# experts, top-8, whatever the token count (measured at 1e5 and 1e6 tokens). A loads file
# uses as many per distinct micro-batch token count, fewer when there are many counts
# (baseline.mean_over_token_counts keeps the total work near 0.8 s).
BASELINE_TRIALS = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a .safetensors file in relibra.routing/1 or relibra.loads/1 format")


def _print_routing(path: str, replay: RoutingReplay) -> None:
    lengths = replay.sample_lengths
    counts_LE = replay.expert_counts()
    T, L, K, E = replay.num_tokens, replay.num_layers, replay.top_k, replay.num_experts
    mean = T * K / E
    base = uniform_max_over_mean(T, E, K, trials=BASELINE_TRIALS)
    print(f"routing replay {path}")
    print(f"  format       {ROUTING_FORMAT}")
    if replay.model is not None:
        print(f"  model        {replay.model}")
    if replay.coverage == "completion-only":
        print("  coverage     completion-only: some samples hold only their generated tokens (prompt rows missing)")
    extra = []
    if replay.sample_step is not None:
        extra.append(f"steps {torch.unique(replay.sample_step).numel()}")
    if replay.sample_task is not None:
        extra.append(f"tasks {torch.unique(replay.sample_task).numel()}")
    print(f"  samples      {replay.num_samples}" + (f" ({', '.join(extra)})" if extra else ""))
    print(
        f"  tokens       {T} (per sample min {int(lengths.min())}, mean {lengths.double().mean().item():.1f}, "
        f"max {int(lengths.max())})"
    )
    print(f"  layers       {L}")
    print(f"  experts      {E}")
    print(f"  top-k        {K}")
    print(
        f"  uniform      expected max/mean at {T} tokens = {base:.4f} "
        f"(exact simulation, {BASELINE_TRIALS} trials)"
    )
    print("per layer, loads over the whole file (LIS = max expert load / (tokens * top-k / experts)):")
    print(f"{'layer':>5} {'max load':>10} {'mean load':>12} {'LIS':>9} {'uniform':>9}")
    max_L = counts_LE.max(dim=1).values
    ratio_L = lis(counts_LE, T, K)
    for layer in range(L):
        print(f"{layer:>5} {int(max_L[layer]):>10} {mean:>12.1f} {ratio_L[layer].item():>9.3f} {base:>9.3f}")
    worst = int(ratio_L.argmax())
    print(
        f"all layers: LIS mean {ratio_L.mean().item():.3f}, max {ratio_L[worst].item():.3f} "
        f"(layer {worst}); uniform {base:.3f}"
    )


def _print_loads(path: str, loads: LoadsFile) -> None:
    X, M, L, S, E = loads.shape
    K = loads.top_k
    tokens_XM = loads.tokens().sum(dim=-1)
    expert_XMLE = loads.loads_XMLSE.sum(dim=3, dtype=torch.int64)
    nonempty_XM = tokens_XM > 0
    n_nonempty = int(nonempty_XM.sum())
    print(f"loads file {path}")
    print(f"  format         {LOADS_FORMAT}")
    if loads.model is not None:
        print(f"  model          {loads.model}")
    print(f"  steps          {X}")
    print(f"  micro-batches  {M} per step ({X * M - n_nonempty} empty)")
    print(f"  layers         {L}")
    print(f"  source ranks   {S}")
    print(f"  experts        {E}")
    print(f"  top-k          {K}")
    t = tokens_XM[nonempty_XM]
    if n_nonempty == 0:
        print("  tokens         0")
        print("no tokens: no per-layer loads to report")
        return
    print(
        f"  tokens         {int(tokens_XM.sum())} (per micro-batch min {int(t.min())}, "
        f"mean {t.double().mean().item():.1f}, max {int(t.max())})"
    )
    # Baseline per distinct token count, then averaged over the same micro-batches.
    base_mean, trials = mean_over_token_counts(t.tolist(), E, K, max_trials=BASELINE_TRIALS)
    ratio_XML = lis(expert_XMLE, tokens_XM.unsqueeze(-1), K)
    ratio_NL = ratio_XML[nonempty_XM]  # [non-empty micro-batches, L]
    print(
        f"  uniform        expected max/mean, mean over micro-batches = {base_mean:.4f} "
        f"(exact simulation, {trials} trial{'s' if trials > 1 else ''} per distinct token count)"
    )
    print("per layer, loads per (step, micro-batch) summed over source ranks "
          "(LIS = max expert load / (tokens * top-k / experts)):")
    print(f"{'layer':>5} {'mean LIS':>14} {'max LIS':>15} {'uniform':>9}")
    for layer in range(L):
        col = ratio_NL[:, layer]
        print(f"{layer:>5} {col.mean().item():>14.3f} {col.max().item():>15.3f} {base_mean:>9.3f}")
    worst = int(ratio_NL.mean(dim=0).argmax())
    print(
        f"all layers: LIS mean {ratio_NL.mean().item():.3f}, max {ratio_NL.max().item():.3f}, worst layer "
        f"{worst} (mean {ratio_NL[:, worst].mean().item():.3f}); uniform {base_mean:.3f}"
    )


def run(args: argparse.Namespace) -> int:
    """Print the summary of ``args.file``; errors propagate as ValueError/FileNotFoundError."""
    path = args.file
    try:
        header = read_header(path)
        fmt = header.metadata.get("format")
        if fmt == ROUTING_FORMAT:
            _print_routing(path, load_routing(path))
        elif fmt == LOADS_FORMAT:
            _print_loads(path, load_loads(path))
        else:
            shown = "missing" if fmt is None else one_line(fmt)
            raise ValueError(
                f"file {path!r}: metadata format is {shown}; allowed: {ROUTING_FORMAT!r} or {LOADS_FORMAT!r}"
            )
    except (ValueError, TypeError) as exc:
        # cli.main prints the message on one line; make sure it is one line.
        raise type(exc)(" ".join(str(exc).split())) from None
    return 0
