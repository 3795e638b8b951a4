"""Request traces for the serving model: arrival time, prompt and output length per request.

Three sources, one type (:class:`Requests`):

* Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``; the 2023
  Splitwise data in ``../shared/data``, CC-BY 4.0, Patel et al., ISCA 2024);
* Mooncake JSONL (one object a line: ``timestamp`` in ms, ``input_length``,
  ``output_length``; the FAST'25 Mooncake trace format);
* Poisson arrivals at a given rate with lengths drawn (seeded) from a real trace's lengths.

Every reader rejects a bad trace with one line naming the file, the row and the fix:
negative, non-integer or huge lengths, booleans, non-finite (NaN, Infinity) or huge
timestamps, unsorted times, an empty file, missing columns, a malformed CSV row (a stray
quote), a JSON array or a multi-line JSON document instead of JSONL, bytes that are not
UTF-8 text (a gzip file). A UTF-8 byte order mark and spaces around the CSV header's names
are accepted. Azure timestamps are read as the traces write them, 2023's
``2023-11-16 18:15:46.6805900`` and 2024's ``2024-05-10 00:00:00.009930+00:00`` (an ISO
``T`` and ``Z`` too); a stamp without an offset is UTC (the traces' zone), never the
machine's local time.

Legend: N requests.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import numpy as np

from ..checks import check_int, check_number

__all__ = ["Requests", "load_trace", "poisson_requests", "read_azure_csv", "read_mooncake_jsonl"]

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
# Lengths up to 2^31 - 1 tokens: sums and products of two lengths (prompt + output, the
# attention's prompt x context) stay exact in int64 and float64. Timestamps (ms) up to the
# int64 range in magnitude.
MAX_LENGTH = (1 << 31) - 1
MAX_TIMESTAMP_MS = (1 << 63) - 1
JSONL_HINT = "allowed: one JSON object per line (JSONL, the Mooncake format) with " + ", ".join(MOONCAKE_KEYS)
# An Azure TIMESTAMP: date, time, any number of fractional digits (2023 writes 7, Python's
# parser takes at most 6), then an optional zone (2024 writes +00:00).
AZURE_STAMP = re.compile(r"(\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}(?::\d{2})?)(?:\.(\d+))?(Z|[+-]\d{2}:?\d{2})?")
AZURE_STAMP_HINT = "allowed: 'YYYY-MM-DD HH:MM:SS[.fffffff][+HH:MM or Z]' (no offset: UTC)"


@dataclass(frozen=True)
class Requests:
    """A request trace, sorted by arrival.

    Attributes:
        arrival_N: float64 seconds from the first arrival (non-decreasing, starts at 0).
        prompt_N: int64 prompt (context) tokens, ``>= 1``.
        output_N: int64 generated tokens, ``>= 1``.
        source: where it came from (for reports).
    """

    arrival_N: np.ndarray
    prompt_N: np.ndarray
    output_N: np.ndarray
    source: str

    def __post_init__(self) -> None:
        n = len(self.arrival_N)
        if not n:
            raise ValueError(f"{self.source}: no requests; allowed: a trace with at least one request")
        if len(self.prompt_N) != n or len(self.output_N) != n:
            raise ValueError(f"{self.source}: arrival, prompt and output arrays differ in length")
        if not np.all(np.isfinite(self.arrival_N)):
            i = int(np.argmax(~np.isfinite(self.arrival_N)))
            raise ValueError(f"{self.source}: request {i} arrives at {float(self.arrival_N[i])} s; "
                             f"allowed: finite times")
        if np.any(np.diff(self.arrival_N) < 0):
            i = int(np.argmax(np.diff(self.arrival_N) < 0)) + 1
            raise ValueError(f"{self.source}: request {i} arrives before request {i - 1}; allowed: "
                             f"times sorted in increasing order (sort the file by its timestamp)")
        for name, arr in (("prompt", self.prompt_N), ("output", self.output_N)):
            if np.any(arr < 1):
                i = int(np.argmax(arr < 1))
                raise ValueError(f"{self.source}: request {i} has {name} length {int(arr[i])}; "
                                 f"allowed: lengths >= 1")

    def __len__(self) -> int:
        return len(self.arrival_N)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_N[-1] - self.arrival_N[0])

    @property
    def rate(self) -> float:
        """Mean arrival rate, requests/s (N / span; one request: 1; a burst: inf)."""
        if len(self) == 1:
            return 1.0
        return len(self) / self.duration_s if self.duration_s > 0 else float("inf")

    def window(self, start_s: float, length_s: float) -> "Requests":
        """Requests arriving in ``[start_s, start_s + length_s)``, times shifted to start at 0."""
        t = self.arrival_N - self.arrival_N[0]
        keep = (t >= start_s) & (t < start_s + length_s)
        if not keep.any():
            where = (f"the trace spans {self.duration_s:.0f} s; allowed: a window starting before "
                     f"{self.duration_s:.0f} s" if start_s >= self.duration_s else
                     "no request arrives in it (a gap in the trace); allowed: a window that holds requests")
            raise ValueError(f"{self.source}: no request in the window --window-start {start_s:.6g} s, --window "
                             f"{length_s:.6g} s; {where}")
        a = t[keep]
        span = "end" if math.isinf(length_s) else f"+{length_s:g} s"
        return Requests(a - a[0], self.prompt_N[keep], self.output_N[keep], f"{self.source} [{start_s:g} s, {span})")

    def with_output(self, tokens: int) -> "Requests":
        """The same arrivals and prompts, every request generating ``tokens`` tokens."""
        return Requests(self.arrival_N, self.prompt_N, np.full(len(self), tokens, dtype=np.int64),
                        f"{self.source}, every output {tokens} tokens")

    def scaled(self, factor: float, min_span_s: float = 0.0, max_requests: int = 50_000) -> "Requests":
        """The same requests with every inter-arrival time divided by ``factor`` (rate x factor);
        ``math.inf`` makes them one burst at time 0.

        ``min_span_s``: when the scaled trace spans less, it is repeated back to back (copy
        ``j`` shifted by ``j`` spans, so the rate ``N / span`` is unchanged) until it spans at
        least that long: a short window at a high rate would otherwise be one transient burst
        that no steady state ever reaches (see docs/serving.md, ``serving.min_trace_s``); at
        most ``max_requests`` requests in all (at least one copy), which bounds a run's cost."""
        if factor == float("inf"):
            return Requests(np.zeros_like(self.arrival_N), self.prompt_N, self.output_N, self.source)
        factor = check_number("scale factor", factor, 0, strict=True)
        arrival = self.arrival_N / factor
        span = float(arrival[-1] - arrival[0])
        if min_span_s <= 0 or span <= 0 or span >= min_span_s:
            return Requests(arrival, self.prompt_N, self.output_N, self.source)
        k = max(1, min(math.ceil(min_span_s / span), max_requests // len(self)))
        if k == 1:
            return Requests(arrival, self.prompt_N, self.output_N, self.source)
        tiled = np.maximum.accumulate(np.concatenate([arrival + j * span for j in range(k)]))  # (rounding)
        return Requests(tiled, np.tile(self.prompt_N, k),
                        np.tile(self.output_N, k), f"{self.source} x{k} back to back")


def _fail(path: str, where: str, what: str) -> ValueError:
    return ValueError(f"{os.path.basename(path)}{where}: {what}")


def _show(raw) -> str:
    """``repr(raw)`` (JSON's ``true``, ``false``, ``null`` as JSON spells them), shortened for
    long values (a 400-digit number)."""
    text = json.dumps(raw) if raw is None or isinstance(raw, bool) else repr(raw)
    return text if len(text) <= 80 else text[:77] + "..."


def _number(raw) -> int | float | None:
    """A JSON number or a numeric string as an exact ``int`` or a ``float``; ``None`` for
    anything else (``bool`` included: ``true`` is no count or time)."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, (int, float)):
        return raw
    if isinstance(raw, str):
        text = raw.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            return float(text)
        except ValueError:
            return None
    return None


def _length(path: str, where: str, column: str, raw) -> int:
    allowed = f"allowed: a whole number >= 1 and <= {MAX_LENGTH}"
    value = _number(raw)
    if value is None or (isinstance(value, float) and not value.is_integer()) or value > MAX_LENGTH:
        raise _fail(path, where, f"{column} = {_show(raw)}; {allowed}")  # nan and inf included
    if value < 1:
        raise _fail(path, where, f"{column} = {_show(raw)}; {allowed} (negative or zero lengths are not requests)")
    return int(value)


def _millis(path: str, where: str, raw) -> float:
    """A Mooncake ``timestamp`` (ms) in seconds."""
    allowed = "allowed: a finite number of milliseconds"
    value = _number(raw)
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        raise _fail(path, where, f"timestamp = {_show(raw)}; {allowed}")
    if abs(value) > MAX_TIMESTAMP_MS:
        raise _fail(path, where, f"timestamp = {_show(raw)}; {allowed} in [-{MAX_TIMESTAMP_MS}, {MAX_TIMESTAMP_MS}]")
    return float(value) / 1000.0


def _no_twice(pairs: list) -> dict:
    """A JSON object whose keys each appear once (``json.loads`` would keep the last silently)."""
    seen: set = set()
    for key, _ in pairs:
        if key in seen:
            raise json.JSONDecodeError(f"key {key!r} appears more than once", "", 0)
        seen.add(key)
    return dict(pairs)


def _azure_seconds(stamp: str) -> float:
    """Seconds since the epoch of an Azure ``TIMESTAMP`` (``ValueError`` when malformed)."""
    m = AZURE_STAMP.fullmatch(stamp)
    if m is None:
        raise ValueError(stamp)
    head, frac, zone = m.groups()
    tz = timezone.utc
    if zone and zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        hours, minutes = int(zone[1:3]), int(zone[-2:])
        tz = timezone(sign * timedelta(hours=hours, minutes=minutes))
    return datetime.fromisoformat(head).replace(tzinfo=tz).timestamp() + (float("0." + frac) if frac else 0.0)


def _read_text(path: str, fh, reading):
    """Run ``reading(fh)``; bytes that are not UTF-8 (a gzip or Latin-1 file) fail naming the
    file, and a gzip file says so."""
    try:
        return reading(fh)
    except UnicodeDecodeError:
        with open(path, "rb") as raw:
            gz = raw.read(2) == b"\x1f\x8b"
        raise _fail(path, "", "gzip-compressed; decompress it first (gunzip)" if gz else
                    "not UTF-8 text; allowed: a UTF-8 (or ASCII) text file") from None


def _finish(path: str, times: list[float], prompt: list[int], output: list[int], label: str,
            where: list[str]) -> Requests:
    if not times:
        raise _fail(path, "", "the file holds no requests; allowed: at least one data row")
    t = np.asarray(times, dtype=np.float64)
    bad = np.flatnonzero(np.diff(t) < 0)
    if bad.size:
        raise _fail(path, where[int(bad[0]) + 1], "its time is earlier than the previous row's; "
                    "allowed: rows sorted by time (sort the file)")
    return Requests(t - t[0], np.asarray(prompt, dtype=np.int64), np.asarray(output, dtype=np.int64), label)


def read_azure_csv(path: str) -> Requests:
    """An Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--trace {path!r} does not exist")
    times, prompt, output, rows = [], [], [], []

    def reading(fh):
        reader = csv.DictReader(fh)
        if reader.fieldnames is None:
            raise _fail(path, "", "the file is empty; allowed: a CSV with header " + ",".join(AZURE_COLUMNS))
        # "TIMESTAMP, ContextTokens" and "timestamp,contexttokens" name the same columns
        canon = {c.lower(): c for c in AZURE_COLUMNS}
        names = [name.strip() for name in reader.fieldnames]
        reader.fieldnames = [canon.get(name.lower(), name) for name in names]
        twice = sorted({c for c in AZURE_COLUMNS if reader.fieldnames.count(c) > 1})
        if twice:  # DictReader would keep the last silently
            raise _fail(path, "", f"column(s) {', '.join(twice)} appear more than once; allowed: each once")
        missing = [c for c in AZURE_COLUMNS if c not in reader.fieldnames]
        if missing:
            raise _fail(path, "", f"missing column(s) {', '.join(missing)} (header: {','.join(names)[:120]}); "
                        f"allowed: an Azure LLM inference trace CSV with header " + ",".join(AZURE_COLUMNS)
                        + " (convert another trace to these columns, or to Mooncake JSONL)")
        done = reader.line_num  # the last line of the last row read whole (the header's)
        try:
            for i, row in enumerate(reader):
                where = f" row {i + 2}"
                rows.append(where)
                stamp = (row["TIMESTAMP"] or "").strip()
                try:
                    times.append(_azure_seconds(stamp))
                except (ValueError, OverflowError, OSError):
                    raise _fail(path, where, f"TIMESTAMP = {stamp!r}; {AZURE_STAMP_HINT}") from None
                prompt.append(_length(path, where, "ContextTokens", row["ContextTokens"]))
                output.append(_length(path, where, "GeneratedTokens", row["GeneratedTokens"]))
                done = reader.line_num
        except csv.Error as exc:  # a stray quote swallows the rest of the file into one field
            raise _fail(path, f" line {done + 1}", f"not a well-formed CSV row ({exc}); allowed: "
                        "comma-separated fields, quotes balanced") from None

    with open(path, newline="", encoding="utf-8-sig") as fh:  # -sig: a byte order mark is dropped
        _read_text(path, fh, reading)
    return _finish(path, times, prompt, output, f"azure:{os.path.basename(path)}", rows)


def read_mooncake_jsonl(path: str) -> Requests:
    """A Mooncake-format JSONL trace (``timestamp`` ms, ``input_length``, ``output_length``)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--trace {path!r} does not exist")
    times, prompt, output, rows = [], [], [], []

    def reading(fh):
        for i, line in enumerate(fh):
            if not line.strip():
                continue
            where = f" line {i + 1}"
            rows.append(where)
            if line.lstrip().startswith("["):  # a .json file holding one array of requests
                raise _fail(path, where, f"a JSON array, not a JSON object; {JSONL_HINT}")
            try:
                obj = json.loads(line, object_pairs_hook=_no_twice)
            except json.JSONDecodeError as exc:
                if len(rows) == 1 and line.strip() == "{":  # the first object spans several lines
                    raise _fail(path, where, f"a JSON document over several lines, not one object per "
                                f"line; {JSONL_HINT}") from None
                raise _fail(path, where, f"not valid JSON ({exc.msg}); {JSONL_HINT}") from None
            if not isinstance(obj, dict):
                raise _fail(path, where, f"not a JSON object; {JSONL_HINT}")
            missing = [k for k in MOONCAKE_KEYS if k not in obj]
            if missing:
                raise _fail(path, where, f"missing key(s) {', '.join(missing)}; allowed: objects with "
                            + ", ".join(MOONCAKE_KEYS))
            times.append(_millis(path, where, obj["timestamp"]))
            prompt.append(_length(path, where, "input_length", obj["input_length"]))
            output.append(_length(path, where, "output_length", obj["output_length"]))

    with open(path, encoding="utf-8-sig") as fh:  # -sig: a byte order mark is dropped
        _read_text(path, fh, reading)
    return _finish(path, times, prompt, output, f"mooncake:{os.path.basename(path)}", rows)


def load_trace(path: str) -> Requests:
    """A trace file by its suffix: ``.csv`` Azure, ``.jsonl``/``.json`` Mooncake."""
    low = path.lower()
    if low.endswith(".csv"):
        return read_azure_csv(path)
    if low.endswith((".jsonl", ".json")):
        return read_mooncake_jsonl(path)
    raise ValueError(f"--trace {path!r}: unknown format; allowed: .csv (Azure) or .jsonl (Mooncake)")


def poisson_requests(rate: float, num: int, lengths: Requests, seed: int = 0) -> Requests:
    """``num`` Poisson arrivals at ``rate`` req/s; (prompt, output) pairs drawn from ``lengths``."""
    rate = check_number("--rate", rate, 0, strict=True)
    num = check_int("--num-requests", num)
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=num)
    gaps[0] = 0.0
    pick = rng.integers(0, len(lengths), size=num)
    return Requests(np.cumsum(gaps), lengths.prompt_N[pick], lengths.output_N[pick],
                    f"poisson {rate:g} req/s, lengths from {lengths.source}")
