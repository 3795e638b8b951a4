"""The packed row exchange (``distributed.collectives.all_to_all_packed``) on 3 gloo ranks:
one collective carries rows of several dtypes, equal bit for bit to one exchange per tensor,
and its backward sends every gradient back in one reverse exchange."""

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import _rank_fns
from relibra_torch.distributed.collectives import all_to_all_packed
from relibra_torch.testing import RankPool

G = 3


@pytest.fixture(scope="module")
def pool():
    with RankPool(G, timeout_s=30, grace_s=5) as p:
        yield p


@settings(max_examples=8, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate])  # no shrinking: each failing try restarts 3 processes
@given(sizes=st.lists(st.lists(st.integers(0, 5), min_size=G, max_size=G), min_size=G, max_size=G),
       D=st.integers(1, 7), K=st.integers(1, 3), seed=st.integers(0, 1000))
def test_packed_equals_one_exchange_per_tensor(pool, sizes, D, K, seed):
    """Odd widths (bf16 rows of 1-7 values: byte offsets not a multiple of 4), empty sends."""
    for got, want, code_only_calls, codes_equal in pool.run(_rank_fns.packed_exchange, sizes, D, K, seed):
        *values, calls, codes_need_grad = got
        for a, b in zip(values, want):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert calls == 2 and not codes_need_grad    # one forward, one backward exchange
        assert code_only_calls == 1 and codes_equal  # no gradient: no backward exchange


def test_single_rank_is_the_identity_and_checks_rows():
    x, c = torch.randn(3, 2), torch.arange(3)
    out = all_to_all_packed([x, c], [3], [3], None)
    assert out[0] is x and out[1] is c
    with pytest.raises(ValueError, match="send_sizes == recv_sizes"):
        all_to_all_packed([x], [3], [2], None)


def test_empty_and_broadcast_parts_pack():
    """Parts with zero rows or stride-0 rows (an expanded tensor) pack and unpack exactly."""
    from relibra_torch.distributed.collectives import _pack_rows, _unpack_rows
    gates = torch.tensor([0.5]).expand(3, 2)                      # stride 0
    codes = torch.arange(6, dtype=torch.int32).view(3, 2)
    empty = torch.empty(0, 1).expand(0, 4)
    like = [(torch.float32, (2,)), (torch.int32, (2,))]
    back = _unpack_rows(_pack_rows([gates, codes]), like)
    assert torch.equal(back[0], gates) and torch.equal(back[1], codes)
    out = _unpack_rows(_pack_rows([empty, empty.to(torch.bfloat16)]), [(torch.float32, (4,)), (torch.bfloat16, (4,))])
    assert [tuple(t.shape) for t in out] == [(0, 4), (0, 4)]


def test_zero_width_parts_and_bad_rows():
    """A part with rows but no columns unpacks; parts whose rows differ from the sizes, or
    no parts at all, are refused with the sizes named."""
    from relibra_torch.distributed.collectives import _pack_rows, _unpack_rows
    a, z = torch.randn(3, 2), torch.randn(3, 0)
    back = _unpack_rows(_pack_rows([a, z]), [(torch.float32, (2,)), (torch.float32, (0,))])
    assert torch.equal(back[0], a) and back[1].shape == (3, 0)
    with pytest.raises(ValueError, match="sum\\(send_sizes\\) = 3 rows, got \\[2, 3\\]"):
        all_to_all_packed([a, torch.zeros(2, 1)], [3], [3], None)
    with pytest.raises(ValueError, match="no parts"):
        all_to_all_packed([], [3], [3], None)
