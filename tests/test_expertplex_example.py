"""examples/expertplex_serve.py: the trace scaling (the full run is ~1 min of process start-up:
run it by hand, `python examples/expertplex_serve.py`)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import expertplex_serve as ex  # noqa: E402


@pytest.mark.skipif(not os.path.exists(ex.TRACE), reason="the Azure trace is not in ../shared/data")
def test_the_azure_stream_is_scaled_to_the_tiny_lm():
    reqs = ex.load_requests(ex.TRACE, 40, speedup=4.0, seed=0)
    assert [r.rid for r in reqs] == list(range(40))
    assert reqs[0].arrival == 0.0 and all(a.arrival <= b.arrival for a, b in zip(reqs, reqs[1:]))
    # the trace's first requests: 374 context / 44 generated tokens at t = 0, then 396 / 109 at 4.31 s
    assert (len(reqs[0].prompt), len(reqs[0].continuation)) == (2, 2)
    assert len(reqs[1].prompt) == 2 and len(reqs[1].continuation) == 4
    assert abs(reqs[1].arrival - 4.3145788 / 4) < 1e-6
    for r in reqs:
        assert 2 <= len(r.prompt) <= 12 and 1 <= len(r.continuation) <= ex.CFG.max_len - len(r.prompt)
        assert all(0 <= t < ex.CFG.vocab_size for t in r.prompt + r.continuation)
    assert reqs == ex.load_requests(ex.TRACE, 40, speedup=4.0, seed=0)


def test_an_empty_trace_is_refused(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(ValueError, match="has no requests"):
        ex.load_requests(str(path), 5, 1.0, 0)


def test_percentile():
    assert ex.pct([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and ex.pct([3.0, 1.0, 2.0, 4.0], 90) == 4.0
