"""``planning.base.check_placement``: the one placement check of the planner and the layer.

Every row a permutation of ``0..E-1`` passes (as int64 CPU); any other row is refused with a
message whose stated fact (the row, the slot missing or taken twice) is true of the input.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra_torch.planning.base import check_placement


@st.composite
def placements(draw):
    """``(placement_xE, E, leading)``: random permutations, some rows then damaged."""
    E = draw(st.integers(1, 12))
    leading = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    rows = 1
    for n in leading:
        rows *= n
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    p_RE = torch.stack([torch.randperm(E, generator=g) for _ in range(rows)])
    damage = draw(st.lists(st.tuples(st.integers(0, rows - 1), st.integers(0, E - 1), st.integers(-2, E + 1)),
                           max_size=3))
    for r, e, v in damage:
        p_RE[r, e] = v
    return p_RE.view(*leading, E), E, leading


@settings(max_examples=200, deadline=None)
@given(placements(), st.sampled_from([torch.int32, torch.int64]))
def test_permutations_pass_and_anything_else_names_a_true_fault(case, dtype):
    p_xE, E, leading = case
    p_RE = p_xE.reshape(-1, E)
    good_R = (p_RE.sort(-1).values == torch.arange(E)).all(-1)
    if bool(good_R.all()):
        out = check_placement(p_xE.to(dtype), E, "placement_LE", leading)
        assert out.dtype == torch.int64 and torch.equal(out, p_xE)
        return
    with pytest.raises(ValueError) as err:
        check_placement(p_xE.to(dtype), E, "placement_LE", leading)
    msg = str(err.value)
    first_bad = int((~good_R).nonzero()[0])
    row = list(torch.unravel_index(torch.tensor(first_bad), leading)) if leading else []
    assert msg.startswith(f"placement_LE{[int(i) for i in row] if row else ''} is not a permutation of 0..{E - 1}")
    bad_E = p_RE[first_bad]
    counts = {v: int((bad_E == v).sum()) for v in bad_E.tolist()}
    if m := re.search(r"\((-?\d+) is no slot\)", msg):
        assert int(m[1]) < 0 and int(m[1]) in counts
    elif m := re.search(r"slot (\d+) taken more than once", msg):
        assert counts[int(m[1])] >= 2
    else:
        m = re.search(r"slot (\d+) missing", msg)
        assert m and int(m[1]) not in counts


def test_shape_and_type_are_named():
    with pytest.raises(ValueError, match=r"previous_placement_LE has shape \(3, 8\); allowed: \[L, E\] = \[2, 8\]"):
        check_placement(torch.zeros(3, 8, dtype=torch.int64), 8, "previous_placement_LE", (2,))
    with pytest.raises(ValueError, match=r"new_placement_E has shape \(2, 4\); allowed: \[E\] = \[4\]"):
        check_placement(torch.zeros(2, 4, dtype=torch.int64), 4, "new_placement_E")
    with pytest.raises(TypeError, match="placement_E has dtype float32; allowed: int32, int64"):
        check_placement(torch.arange(4.0), 4)
    with pytest.raises(TypeError, match="placement_E is list; allowed: a torch.Tensor"):
        check_placement([0, 1, 2, 3], 4)
