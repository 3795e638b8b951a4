"""The serving engine on hand-made traces: exact TTFT/TPOT, conservation, determinism."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra_torch.serving.engine import Engine, Executor


class Fixed:
    """Prefill: ``a`` seconds per prompt token; decode: ``d`` seconds per step (any batch)."""

    def __init__(self, a: float = 1e-3, d: float = 0.01):
        self.a, self.d = a, d

    def prefill_s(self, tokens, pairs, kv_read, rows):
        return self.a * tokens

    def mixed_s(self, tokens, pairs, kv_read, rows):
        return self.a * tokens

    def decode_s(self, batch, context):
        return self.d


def _run(mode, arrival, prompt, output, *, transfer=0.0, kv=10**9, running=10**6, chunk=8192, pricer=None):
    pricer = pricer or Fixed()
    kw = dict(max_running=running, max_prefill_tokens=16384, chunk_tokens=chunk)
    if mode == "disagg":
        xs = [Executor("p", "prefill", pricer, kv_capacity=0, **kw),
              Executor("d", "decode", pricer, kv_capacity=kv, **kw)]
    else:
        xs = [Executor("x", mode, pricer, kv_capacity=kv, **kw)]
    eng = Engine(np.asarray(arrival, float), np.asarray(prompt, np.int64), np.asarray(output, np.int64), xs,
                 lambda p, s, d: transfer)
    eng.run()
    return eng


def test_one_request_serial_has_the_hand_computed_ttft_and_tpot():
    eng = _run("serial", [0.0], [100], [5])
    assert eng.first[0] == pytest.approx(0.1)  # 100 tokens x 1 ms
    assert eng.finish[0] == pytest.approx(0.1 + 4 * 0.01)  # 4 decode steps after the first token
    assert eng.generated[0] == 5 and eng.finished_count[0] == 1


def test_serial_prefill_pauses_decode_and_a_late_arrival_waits_for_the_step_in_progress():
    # r0 decodes from 0.1; r1 arrives at 0.125 (mid step 3, which ends at 0.13), then its
    # prefill runs 0.13-0.18 (50 tokens) and pauses r0; both decode together afterwards.
    eng = _run("serial", [0.0, 0.125], [100, 50], [10, 3])
    assert eng.first[1] == pytest.approx(0.18)
    assert eng.first[1] - 0.125 == pytest.approx(0.055)  # TTFT = wait to the step end + prefill
    # r0: 3 steps before, 6 after (9 decode tokens), with a 0.05 s pause
    assert eng.finish[0] == pytest.approx(0.1 + 9 * 0.01 + 0.05)
    assert eng.finish[1] == pytest.approx(0.18 + 2 * 0.01)


def test_disagg_ttft_includes_the_kv_transfer_and_the_wait_for_a_decode_slot():
    # SGLang's PD mode streams every token, the first included, from the decode server
    eng = _run("disagg", [0.0], [200], [3], transfer=0.5)
    assert eng.first[0] == pytest.approx(0.2 + 0.5)
    assert eng.finish[0] == pytest.approx(0.2 + 0.5 + 2 * 0.01)
    # one decode slot: r0 prefills 0-0.2 and decodes 19 steps to 0.39; r1 prefills
    # 0.2-0.3, waits for the slot, and its first token comes when it joins at 0.39
    eng = _run("disagg", [0.0, 0.0], [200, 100], [20, 2], transfer=0.0, running=1)
    assert eng.first.tolist() == pytest.approx([0.2, 0.39])
    assert eng.finish.tolist() == pytest.approx([0.39, 0.40])


def test_prefill_batches_queue_fifo_behind_a_long_prompt():
    # head-of-line blocking: the short prompt arriving during the long prefill waits for it
    eng = _run("disagg", [0.0, 0.001], [10000, 10], [2, 2])
    assert eng.first[0] == pytest.approx(10.0)
    assert eng.first[1] == pytest.approx(10.0 + 0.01)


def test_chunked_prefill_mixes_decode_tokens_into_every_iteration():
    # budget 60 tokens: r1 (prompt 100) needs two iterations while r0 decodes one token in each
    eng = _run("mixed", [0.0, 0.06], [50, 100], [5, 2], chunk=60)
    assert eng.first[0] == pytest.approx(0.05)
    # r0 decodes alone 0.05-0.06 (one step, tok 2); then iteration 1: 59 prompt + 1 decode
    # = 60 tokens (0.06 s), iteration 2: 41 prompt + 1 decode = 42 tokens (0.042 s)
    assert eng.first[1] == pytest.approx(0.06 + 0.06 + 0.042)
    assert eng.generated[0] == 5


def test_kv_capacity_holds_a_request_until_another_finishes():
    # each request needs 110 KV tokens; capacity 150 admits one at a time on the decode side
    eng = _run("disagg", [0.0, 0.0], [100, 100], [10, 10], kv=150)
    assert eng.finish[1] >= eng.finish[0] + 9 * 0.01 - 1e-12
    assert (eng.finished_count == 1).all()


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["serial", "mixed", "disagg"]),
       st.lists(st.tuples(st.floats(0, 2), st.integers(1, 3000), st.integers(1, 200)), min_size=1, max_size=30),
       st.integers(1, 8), st.sampled_from([512, 4096, 8192]))
def test_conservation_every_request_finishes_once_with_all_its_tokens(mode, reqs, running, chunk):
    reqs.sort()
    arrival, prompt, output = (np.asarray(x) for x in zip(*reqs))
    eng = _run(mode, arrival, prompt, output, transfer=0.003, running=running, chunk=chunk)
    assert (eng.finished_count == 1).all()
    assert (eng.generated == output).all()
    assert (eng.first >= arrival - 1e-12).all() and (eng.finish >= eng.first - 1e-12).all()
    assert (eng.prefilled[output > 0] <= prompt).all()


def test_identical_inputs_give_identical_outputs():
    rng = np.random.default_rng(3)
    arrival = np.sort(rng.uniform(0, 5, 200))
    prompt, output = rng.integers(1, 2000, 200), rng.integers(1, 300, 200)
    a = _run("mixed", arrival, prompt, output)
    b = _run("mixed", arrival, prompt, output)
    assert np.array_equal(a.first, b.first) and np.array_equal(a.finish, b.finish)


def test_kv_transfers_queue_on_the_receivers_links_as_well_as_the_senders():
    # two prefill servers (one link each) finish 100-token prompts at 0.1 s together and send
    # 0.5 s transfers to one decode server: with one link it takes them one after the other
    # (its ingress limits), with two links side by side; a single sender with one link
    # serialises its own transfers to a two-link receiver (its egress limits)
    def run(dst_links, senders):
        kw = dict(max_running=10**6, max_prefill_tokens=100, chunk_tokens=8192)
        xs = [Executor(f"p{i}", "prefill", Fixed(), kv_capacity=0, links=1, **kw) for i in range(senders)]
        xs.append(Executor("d", "decode", Fixed(), kv_capacity=10**9, links=dst_links, **kw))
        eng = Engine(np.zeros(2), np.asarray([100, 100]), np.asarray([2, 2]), xs, lambda p, s, d: (0.5, "rdma"))
        eng.run()
        return sorted(eng.first.tolist())

    assert run(1, 2) == pytest.approx([0.6, 1.1])
    assert run(2, 2) == pytest.approx([0.6, 0.61])  # the second joins after the decode step in progress
    # p0 prefills r0 (0-0.1) and r1 (0.1-0.2): r1's transfer waits for p0's link (0.6, not 0.2)
    assert run(2, 1) == pytest.approx([0.6, 1.1])
