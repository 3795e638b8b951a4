"""Step loops of the attention ranks: batched prefill, continuous-batching decode.

Both work with any model that has the packed forward of ``examples/tiny_lm.py``
(``model(tokens_T, sample_T, pos_T, cache=cache) -> logits_TV`` and ``model.new_cache()``),
split by :func:`.attention.split_attention` or not. Tokens are given (teacher-forced): a
request is ``(id, prompt, continuation)`` and the decode rank feeds the continuation one token
per step, so logits can be compared with a one-process forward whatever the batching was.

* :func:`run_prefill`: batches of prompts, each one packed forward with a fresh cache; every
  prompt's KV goes to the :class:`~.kv.KVHandoff`; a batch may wait for its arrival time.
  :func:`run_prefill_online` forms the batches as requests arrive (all arrived requests, up
  to a token budget).
* :func:`run_decode`: each step, requests whose prompt KV has arrived join (the step blocks
  only when nothing is active), every active request is fed its next token, and requests
  whose continuation is used up leave between steps.

Times are ``time.monotonic()`` seconds on the rank (one clock for all local processes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .kv import KVHandoff, drop_sequences
from .transport import Backoff

__all__ = ["Request", "run_prefill", "run_prefill_online", "run_decode"]


@dataclass(frozen=True)
class Request:
    """A request: ``rid`` (its KV slot), ``prompt`` and ``continuation`` token ids, ``arrival``
    (seconds after the run's start)."""

    rid: int
    prompt: tuple[int, ...]
    continuation: tuple[int, ...]
    arrival: float = 0.0


@dataclass
class PhaseLog:
    """What a rank computed: logits per request (prefill: ``[len(prompt), V]``; decode: one
    row per fed token), per-request times, and the requests of every step."""

    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    times: dict[int, list[float]] = field(default_factory=dict)
    steps: list[list[int]] = field(default_factory=list)


def _prefill_batch(model, kv: KVHandoff, batch: list[Request], log: PhaseLog, t0: float, keep_logits: bool) -> None:
    tokens = torch.tensor([t for r in batch for t in r.prompt], dtype=torch.int64)
    sample = torch.tensor([r.rid for r in batch for _ in r.prompt], dtype=torch.int64)
    pos = torch.tensor([i for r in batch for i in range(len(r.prompt))], dtype=torch.int64)
    cache = model.new_cache()
    logits_TV = model(tokens, sample, pos, cache=cache)
    start = 0
    for r in batch:
        kv.put(cache, r.rid, r.rid)
        if keep_logits:
            log.logits[r.rid] = logits_TV[start:start + len(r.prompt)].clone()
        log.times[r.rid] = [time.monotonic() - t0]
        start += len(r.prompt)
    log.steps.append([r.rid for r in batch])


def _sleep_until(t: float) -> None:
    while time.monotonic() < t:
        time.sleep(min(2e-3, max(0.0, t - time.monotonic())))


@torch.no_grad()
def run_prefill(model, kv: KVHandoff, batches: list[list[Request]], *, t0: float | None = None,
                keep_logits: bool = True) -> PhaseLog:
    """Prefill ``batches`` in order (waiting for each batch's latest arrival after ``t0``)."""
    log = PhaseLog()
    t0 = time.monotonic() if t0 is None else t0
    for batch in batches:
        _sleep_until(t0 + max(r.arrival for r in batch))
        _prefill_batch(model, kv, batch, log, t0, keep_logits)
    return log


@torch.no_grad()
def run_prefill_online(model, kv: KVHandoff, requests: list[Request], *, max_tokens: int,
                       t0: float | None = None, keep_logits: bool = False) -> PhaseLog:
    """Prefill ``requests`` (sorted by arrival) as they arrive: each batch takes every arrived
    request, up to ``max_tokens`` prompt tokens (at least one request)."""
    log = PhaseLog()
    t0 = time.monotonic() if t0 is None else t0
    queue = sorted(requests, key=lambda r: r.arrival)
    while queue:
        _sleep_until(t0 + queue[0].arrival)
        now = time.monotonic() - t0
        batch = [queue.pop(0)]
        tokens = len(batch[0].prompt)
        while queue and queue[0].arrival <= now and tokens + len(queue[0].prompt) <= max_tokens:
            tokens += len(queue[0].prompt)
            batch.append(queue.pop(0))
        _prefill_batch(model, kv, batch, log, t0, keep_logits)
    return log


@torch.no_grad()
def run_decode(model, kv: KVHandoff, requests: list[Request], *, t0: float | None = None,
               timeout_s: float = 60.0, backoff: Backoff = Backoff(), keep_logits: bool = True) -> PhaseLog:
    """Decode ``requests`` (in the order their KV is expected) with continuous batching."""
    log = PhaseLog()
    t0 = time.monotonic() if t0 is None else t0
    pending = list(requests)
    active: dict[int, list] = {}  # rid -> [request, next continuation index, next position]
    cache = model.new_cache()
    rows: dict[int, list[torch.Tensor]] = {}
    while pending or active:
        joining = [r for r in pending if int(kv.length_N[r.rid]) > 0]
        if not active and not joining:
            kv.take(cache, pending[0].rid, pending[0].rid, timeout_s=timeout_s, backoff=backoff)
            joining = [pending[0]]
        else:
            for r in joining:
                kv.take(cache, r.rid, r.rid, timeout_s=timeout_s, backoff=backoff)
        for r in joining:
            pending.remove(r)
            active[r.rid] = [r, 0, len(r.prompt)]
        order = sorted(active)
        tokens = torch.tensor([active[i][0].continuation[active[i][1]] for i in order], dtype=torch.int64)
        sample = torch.tensor(order, dtype=torch.int64)
        pos = torch.tensor([active[i][2] for i in order], dtype=torch.int64)
        logits_TV = model(tokens, sample, pos, cache=cache)
        now = time.monotonic() - t0
        leaving = []
        for j, i in enumerate(order):
            if keep_logits:
                rows.setdefault(i, []).append(logits_TV[j].clone())
            log.times.setdefault(i, []).append(now)
            active[i][1] += 1
            active[i][2] += 1
            if active[i][1] == len(active[i][0].continuation):
                leaving.append(i)
        log.steps.append(order)
        for i in leaving:
            del active[i]
        drop_sequences(cache, leaving)
    log.logits = {i: torch.stack(v) for i, v in rows.items()}
    return log
