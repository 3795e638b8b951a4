"""The discrete-event serving engine: iteration-level batching, coarse-grained in time.

Events are arrivals, iteration ends and KV hand-offs, never single tokens of single
requests. An *executor* is one scheduler with its own GPUs (an engine instance, or one
phase's servers) in one of four modes:

* ``serial``: prefill-priority continuous batching (SGLang's default): a prefill batch of
  waiting requests (up to ``max_prefill_tokens``) runs as its own iteration and pauses
  decode; otherwise one decode step for every running request;
* ``mixed``: chunked prefill (vLLM V1's default): every iteration carries one decode token
  per running request plus prompt chunks up to a token budget;
* ``prefill`` / ``decode``: one phase only; finished prefills hand their requests to a
  decode executor after a KV-transfer delay. When that is another server (PD
  disaggregation, ExpertPlex's decode attention GPUs), the client's first token comes from
  the decode server once the request joins its batch, as in SGLang's PD mode (the router
  streams the decode server's output), so TTFT includes the KV transfer and the wait for a
  decode slot; a hand-off to the same GPUs' decode partition (``partner``) emits it at once.

Decode steps between two events are merged into one *macro-step* of ``n`` steps (``n`` at
most the fewest tokens any running request still owes, and ``MAX_MACRO``): nothing changes
in the batch meanwhile, so the steps' times are equal up to the slowly growing context,
priced at the macro-step's midpoint. An event that changes the batch or the step price
(an arrival at a serial/mixed executor, a request joining, a coupled executor starting or
stopping) cuts the macro-step at the end of the step in progress, as a real engine
admits new work at its next iteration.

Admission reserves each request's full KV footprint (prompt + output tokens) up front and
caps the running batch at ``max_running``; requests that do not fit wait.

Legend: N requests, B running requests of an executor.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

import numpy as np

__all__ = ["Executor", "Engine", "MAX_MACRO", "SLO_TOL"]

MAX_MACRO = 32  # decode steps merged at most (bounds the context-midpoint approximation)
SLO_TOL = 1e-12  # a TTFT / TPOT within this of its SLO meets it (the same test everywhere)
# Only a cut decode macro-step is ever scheduled in the past (up to 1e-9 steps: ``cut``'s ceil
# tolerance); ``push`` refuses more than SWEEP_SLACK s before the latest event, so a request
# without a first token at (latest - SWEEP_SLACK) surely misses its TTFT (``_run``'s sweep).
SWEEP_SLACK = 1e-6
_ARRIVE, _DONE, _JOIN = 0, 1, 2


class _Aborted(Exception):
    """Raised inside the event loop when the SLO miss budget is exceeded."""


class Executor:
    """One scheduler over its GPUs; ``pricer`` prices its iterations (see the module doc).

    ``pricer`` has ``prefill_s(tokens, pairs, kv_read, rows)``, ``decode_s(batch, context)``
    and ``mixed_s(tokens, pairs, kv_read, rows)`` (seconds). ``listeners`` are executors whose
    step price depends on whether this one is busy; they are cut when that changes.
    """

    def __init__(self, name: str, mode: str, pricer, *, kv_capacity: int, max_running: int,
                 max_prefill_tokens: int, chunk_tokens: int, node: int = 0, links: int = 1):
        if mode not in ("serial", "mixed", "prefill", "decode"):
            raise ValueError(f"executor mode {mode!r}; allowed: serial, mixed, prefill, decode")
        self.name, self.mode, self.pricer, self.node = name, mode, pricer, node
        self.links = links  # GPUs whose links carry its KV transfers (one transfer per GPU link at a time)
        self.kv_capacity, self.max_running = kv_capacity, max_running
        self.max_prefill_tokens, self.chunk_tokens = max_prefill_tokens, chunk_tokens
        self.queue: deque[int] = deque()  # waiting for prefill
        self.pending: deque[int] = deque()  # prefilled, waiting for a decode slot
        self.pending_kv = 0  # KV footprint of ``pending`` (hand-off balancing reads it per hand-off)
        self.batch = np.zeros(0, dtype=np.int64)  # running (decoding) requests
        # kept with the batch, so an iteration does not gather them again: the tokens each
        # running request still owes, and the batch's context (prompt + generated tokens)
        self.remaining = np.zeros(0, dtype=np.int64)
        self.context = 0
        self.queued_tokens = 0
        self.reserved = 0
        self.listeners: list[Executor] = []
        self.partner: Executor | None = None  # a prefill executor's own decode executor, if any
        self.work = None  # ("decode", t0, dt, n) | ("prefill", reqs) | ("mixed", chunks)
        self.version = 0
        self.engine: Engine | None = None
        self.busy_time = 0.0

    @property
    def busy(self) -> bool:
        return self.work is not None

    @property
    def decoding(self) -> bool:
        return self.work is not None and self.work[0] == "decode"

    @property
    def prefilling(self) -> bool:
        return self.work is not None and self.work[0] != "decode"

    # --- events ---------------------------------------------------------------------------
    def enqueue(self, t: float, r: int) -> None:
        self.queue.append(r)
        self.queued_tokens += int(self.engine.prompt[r])
        self._wake(t)

    def join(self, t: float, r: int) -> None:
        self.pending.append(r)
        self.pending_kv += self._footprint(r)
        self._wake(t)

    def _wake(self, t: float) -> None:
        if self.work is None:
            self._start(t)
        else:
            self.cut(t)

    def cut(self, t: float) -> None:
        """End a running decode macro-step at the end of the step in progress at ``t``."""
        if not self.decoding:
            return
        _, t0, dt, n = self.work
        # the step in progress at t completes (at a step boundary, none is in progress)
        k = min(n, max(1, int(math.ceil((t - t0) / dt - 1e-9))))
        if k < n:
            self.busy_time -= (n - k) * dt
            self.work = ("decode", t0, dt, k)
            self.version += 1
            self.engine.push(t0 + k * dt, _DONE, self, self.version)

    def done(self, t: float) -> None:
        e = self.engine
        kind = self.work[0]
        if kind == "decode":
            self._advance(t, self.work[3])
        elif kind == "prefill":
            for r in self.work[1]:
                self._prefilled(t, r)
        else:  # mixed: one decode step for the batch, then the chunks
            self._advance(t, 1)
            for r, c in self.work[1]:
                e.prefilled[r] += c
                if e.prefilled[r] == e.prompt[r]:
                    self._prefilled(t, r)
        self.work = None
        self._start(t)

    # --- bookkeeping ----------------------------------------------------------------------
    def _footprint(self, r: int) -> int:
        return int(self.engine.prompt[r] + self.engine.output[r])

    def _fits(self, r: int, extra: int = 0) -> bool:
        return (self.reserved + self._footprint(r) <= self.kv_capacity
                and len(self.batch) + extra < self.max_running)

    def _prefilled(self, t: float, r: int) -> None:
        e = self.engine
        e.generated[r] = 1
        # a separate decode server streams the first token once the request has joined its
        # batch (after the KV transfer); a same-GPU hand-off or a one-token request at once
        if self.mode != "prefill" or self.partner is not None or e.output[r] == 1:
            e.first[r] = t
        if e.output[r] == 1:
            e.finish_request(t, r)
            if self.mode != "prefill":
                self.reserved -= self._footprint(r)
        elif self.mode == "prefill":
            e.hand_off(t, self, r)
        else:
            self._join_batch(np.asarray([r], dtype=np.int64))

    def _join_batch(self, ids: np.ndarray) -> None:
        e = self.engine
        self.batch = np.concatenate([self.batch, ids])
        self.remaining = np.concatenate([self.remaining, e.output[ids] - e.generated[ids]])
        self.context += int((e.prompt[ids] + e.generated[ids]).sum())

    def _advance(self, t: float, n: int) -> None:
        e = self.engine
        ids = self.batch
        if not len(ids):
            return
        e.generated[ids] += n
        self.context += n * len(ids)
        rem = self.remaining - n
        self.remaining = rem
        left = rem > 0
        if not left.all():
            gone = ids[~left]
            for r in gone.tolist():
                e.finish_request(t, r)
            fp = int((e.prompt[gone] + e.output[gone]).sum())  # finished: generated == output
            self.reserved -= fp
            self.context -= fp
            self.batch, self.remaining = ids[left], rem[left]

    def _admit(self, t: float) -> None:
        added = []
        while self.pending and self._fits(self.pending[0], len(added)):
            r = self.pending.popleft()
            fp = self._footprint(r)
            self.pending_kv -= fp
            self.reserved += fp
            added.append(r)
        if added:
            first = self.engine.first
            for r in added:
                if first[r] != first[r]:  # NaN: its first token is streamed from here, now
                    first[r] = t
            self._join_batch(np.asarray(added, dtype=np.int64))

    def _pick_prefill(self) -> list[int]:
        e, picked, tokens = self.engine, [], 0
        while self.queue:
            r = self.queue[0]
            p = int(e.prompt[r])
            if picked and tokens + p > self.max_prefill_tokens:
                break
            if self.mode == "serial":
                if not self._fits(r, len(picked)):
                    break
                self.reserved += self._footprint(r)
            picked.append(self.queue.popleft())
            tokens += p
            self.queued_tokens -= p
        return picked

    def _pick_chunks(self) -> list[tuple[int, int]]:
        e = self.engine
        budget = self.chunk_tokens - len(self.batch)
        chunks, started = [], 0
        for r in self.queue:  # (not changed in the loop)
            if budget <= 0:
                break
            if e.prefilled[r] == 0:
                if not self._fits(r, started):
                    break
                self.reserved += self._footprint(r)
            started += 1
            c = min(budget, int(e.prompt[r] - e.prefilled[r]))
            chunks.append((r, c))
            budget -= c
        for r, c in chunks:
            self.queued_tokens -= c
            if e.prefilled[r] + c == e.prompt[r]:
                if self.queue[0] == r:  # chunks come from the front, in order
                    self.queue.popleft()
                else:
                    self.queue.remove(r)
        return chunks

    def _start(self, t: float) -> None:
        e = self.engine
        was_prefilling = self.work is not None and self.work[0] != "decode"
        self.work = None
        if self.mode == "decode":
            self._admit(t)
        if self.mode in ("serial", "prefill") and self.queue:
            reqs = self._pick_prefill()
            if reqs:
                p = e.prompt[reqs]
                dt = self.pricer.prefill_s(int(p.sum()), float((p * (p + 1) / 2).sum()), 0, len(reqs))
                self.work = ("prefill", reqs)
        if self.work is None and self.mode == "mixed" and self.queue:
            chunks = self._pick_chunks()
            if chunks:
                done = np.asarray([e.prefilled[r] for r, _ in chunks], dtype=np.float64)
                c = np.asarray([c for _, c in chunks], dtype=np.float64)
                ctx = float(self.context)
                last = sum(1 for (r, k) in chunks if e.prefilled[r] + k == e.prompt[r])
                dt = self.pricer.mixed_s(int(c.sum()) + len(self.batch),
                                         float((c * done + c * (c + 1) / 2).sum()) + ctx,
                                         float(done.sum()) + ctx, last + len(self.batch))
                self.work = ("mixed", chunks)
        if self.work is None and len(self.batch):
            n = int(min(int(self.remaining.min()), MAX_MACRO))
            B = len(self.batch)
            ctx = float(self.context) + B * (n - 1) / 2
            dt = self.pricer.decode_s(B, ctx)
            self.work = ("decode", t, dt, n)
            self.version += 1
            e.push(t + n * dt, _DONE, self, self.version)
            self.busy_time += n * dt
        elif self.work is not None:
            self.version += 1
            e.push(t + dt, _DONE, self, self.version)
            self.busy_time += dt
        if was_prefilling != self.prefilling:
            for other in self.listeners:
                other.cut(t)


class Engine:
    """Runs requests through executors; ``transfer_s(prompt, src, dst)`` prices KV hand-offs:
    seconds (no link contention), or ``(seconds, link)``: the transfer then waits for a free
    link of that kind at both ends (``Executor.links`` each)."""

    def __init__(self, arrival_N: np.ndarray, prompt_N: np.ndarray, output_N: np.ndarray,
                 executors: list[Executor], transfer_s=None):
        self.arrival, self.prompt, self.output = arrival_N, prompt_N, output_N
        n = len(arrival_N)
        self.first = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.generated = np.zeros(n, dtype=np.int64)
        self.prefilled = np.zeros(n, dtype=np.int64)
        self.finished_count = np.zeros(n, dtype=np.int64)
        self.executors = executors
        self.entry = [x for x in executors if x.mode != "decode"]
        self.decoders = [x for x in executors if x.mode == "decode"]
        for x in executors:
            x.engine = self
        self.transfer_s = transfer_s or (lambda p, src, dst: 0.0)
        self._lanes: dict = {}  # (executor name, link) -> heap of its links' free times
        self.slo = None  # (ttft_s, tpot_s) when stop_after_misses is used
        self.missed = np.zeros(n, dtype=bool)
        self.misses, self.miss_budget = 0, n
        self.aborted = False
        self._heap: list = []
        self._seq = 0
        self.events = 0
        self._floor = -math.inf  # no event may be scheduled before this (see SWEEP_SLACK)

    def push(self, t: float, kind: int, target, payload: int) -> None:
        if t < self._floor:  # (an engine bug: the early stop's deadline sweep would be unsound)
            raise RuntimeError(f"serving engine: an event at {t!r} s, over SWEEP_SLACK before the latest one")
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, target, payload))

    def _miss(self, r: int) -> None:
        self.missed[r] = True
        self.misses += 1
        if self.misses > self.miss_budget:
            raise _Aborted

    def finish_request(self, t: float, r: int) -> None:
        self.finish[r] = t
        self.finished_count[r] += 1
        if self.slo is not None and not self.missed[r]:
            out = self.output[r]
            tpot = (t - self.first[r]) / (out - 1) if out > 1 else 0.0
            if self.first[r] - self.arrival[r] > self.slo[0] + SLO_TOL or tpot > self.slo[1] + SLO_TOL:
                self._miss(r)

    def _least_loaded_entry(self) -> Executor:
        """Least queued prefill tokens (a running batch counts full), reserved KV, name."""
        best = None
        for x in self.entry:
            w = x.work
            key = (x.queued_tokens + (x.max_prefill_tokens if w is not None and w[0] != "decode" else 0),
                   x.reserved, x.name)
            if best is None or key < best_key:
                best, best_key = x, key
        return best

    def hand_off(self, t: float, src: Executor, r: int) -> None:
        dst = src.partner
        if dst is None:  # the least-loaded decode executor (reserved + waiting KV over capacity)
            ds = self.decoders
            dst = ds[0] if len(ds) == 1 else min(
                ds, key=lambda x: ((x.reserved + x.pending_kv) / max(x.kv_capacity, 1), x.name))
        d = self.transfer_s(int(self.prompt[r]), src, dst)
        if isinstance(d, tuple):  # (seconds, link): queue on the sender's and the receiver's links
            d, link = d
            end = self._reserve(t, d, (src, link), (dst, link))
        else:
            end = t + d
        self.push(end, _JOIN, dst, r)

    def _reserve(self, t: float, d: float, *ends) -> float:
        """A transfer of ``d`` seconds that needs one free link of each end (an executor and a
        link kind; an executor has ``links`` of each kind): it starts when both are free (the
        sender's egress and the receiver's ingress both limit it) and holds them ``d``."""
        heaps = []
        for x, link in ends:
            h = self._lanes.get((x.name, link))
            if h is None:
                h = self._lanes[(x.name, link)] = [0.0] * x.links
            heaps.append(h)
        start = max([t] + [h[0] for h in heaps])
        for h in heaps:
            heapq.heapreplace(h, start + d)
        return start + d

    def stop_after_misses(self, ttft_s: float, tpot_s: float, budget: int) -> None:
        """Stop the run once more than ``budget`` requests have missed the SLO (then the
        attainment is known to be below ``1 - budget / N``; ``aborted`` is set).

        A miss counts as soon as it is certain: a finished request's TTFT or TPOT over its
        SLO (``> slo + SLO_TOL``, the scoring test of ``goodput.run_config``), or a request
        still without its first token more than the TTFT SLO after its arrival (the deadline
        sweep in ``_run``); so an aborted run's requests would have missed in the full run too."""
        self.slo, self.miss_budget = (ttft_s, tpot_s), budget

    def run(self, max_events: int = 50_000_000) -> None:
        try:
            self._run(max_events)
        except _Aborted:
            self.aborted = True

    def _run(self, max_events: int) -> None:
        arrival = self.arrival.tolist()
        n = len(arrival)
        # arrivals merged in sorted order, not pushed up front (an early-stopped run would push
        # them all for nothing); before other events at one time, in index order, as if pushed first
        if n < 2 or bool((np.diff(self.arrival) >= 0).all()):
            order = range(n)
        else:
            order = np.argsort(self.arrival, kind="stable").tolist()
        heap, entry = self._heap, self.entry
        nxt_a = 0  # the next arrival (position in ``order``)
        t_a = arrival[order[0]] if n else math.inf
        # deadline sweep (early stop only): requests in arrival order whose TTFT deadline has
        # passed by ``latest - SWEEP_SLACK``; any first token still to come is at least then
        sweep = self.slo is not None
        if sweep:
            first, missed, lim = self.first, self.missed, self.slo[0] + SLO_TOL
        latest, nxt = -math.inf, 0
        while True:
            if t_a <= (heap[0][0] if heap else math.inf) and nxt_a < n:
                t, kind, target, payload = t_a, _ARRIVE, None, order[nxt_a]
                nxt_a += 1
                t_a = arrival[order[nxt_a]] if nxt_a < n else math.inf
            elif heap:
                t, _, kind, target, payload = heapq.heappop(heap)
            else:
                break
            self.events += 1
            if sweep and t > latest:
                latest = t
                self._floor = low = latest - SWEEP_SLACK
                while nxt < n:
                    r = order[nxt]
                    if not low - arrival[r] > lim:
                        break
                    if not missed[r] and not (first[r] - arrival[r] <= lim):
                        self._miss(r)  # no first token yet (NaN), or a late one
                    nxt += 1
            if self.events > max_events:
                raise RuntimeError(f"serving engine exceeded {max_events} events; the configuration "
                                   f"cannot keep up (an unstable queue)")
            if kind == _ARRIVE:
                x = entry[0] if len(entry) == 1 else self._least_loaded_entry()
                x.enqueue(t, payload)
            elif kind == _DONE:
                if payload == target.version:
                    target.done(t)
            else:
                target.join(t, payload)
