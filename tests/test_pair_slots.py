"""planning.pair_slots.assign_pair_slots, the one rule that sends every (token, k) pair to an
instance of its expert (the layer and the simulator's exact hierarchical count both call it):
checked against the rule written out pair by pair.

Legend: T tokens, K top-k, S sources, X slots, E experts.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra_torch.planning.pair_slots import assign_pair_slots, slot_quota_runs


def by_hand(ids_TK, slot_expert_X, quota_SX, source_T):
    """A source's pairs of expert ``e``, in flat ``t * K + k`` order, fill ``e``'s instances in
    slot order, each up to its quota; pads go to ``X``."""
    T, K = ids_TK.shape
    X = slot_expert_X.numel()
    left = quota_SX.clone()
    out = torch.full((T, K), X, dtype=torch.int64)
    for t in range(T):
        s = int(source_T[t])
        for k in range(K):
            e = int(ids_TK[t, k])
            if e < 0:
                continue
            for x in range(X):
                if int(slot_expert_X[x]) == e and int(left[s, x]) > 0:
                    left[s, x] -= 1
                    out[t, k] = x
                    break
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), S=st.integers(1, 4), E=st.integers(1, 6), K=st.integers(1, 3),
       X=st.integers(1, 8), T=st.integers(0, 30), pad=st.sampled_from([0.0, 0.2]))
def test_the_rule_pair_by_pair(seed, S, E, K, X, T, pad):
    g = torch.Generator().manual_seed(seed)
    K = min(K, E)
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K,
                                                                                                         dtype=torch.int64)
    if pad and T:
        ids_TK = torch.where(torch.rand(T, K, generator=g) < pad, -1, ids_TK)
    source_T = torch.sort(torch.randint(0, S, (T,), generator=g)).values
    slot_expert_X = torch.randint(-1, E, (X,), generator=g)    # -1: an empty slot
    # quotas that hold every source's pairs: each pair of (s, e) on a random instance of e, if any
    quota_SX = torch.zeros(S, X, dtype=torch.int64)
    routable = torch.ones(T, K, dtype=torch.bool)
    for t in range(T):
        for k in range(K):
            e = int(ids_TK[t, k])
            inst = (slot_expert_X == e).nonzero().flatten()
            if e < 0 or not inst.numel():
                routable[t, k] = False
                continue
            quota_SX[int(source_T[t]), int(inst[torch.randint(0, inst.numel(), (1,), generator=g)])] += 1
    ids_TK = torch.where(routable, ids_TK, -1)   # an expert with no instance: not routable, a pad here
    order_X, cum_R = slot_quota_runs(slot_expert_X, quota_SX)
    got = assign_pair_slots(ids_TK, order_X, cum_R, E, source_T)
    assert torch.equal(got, by_hand(ids_TK, slot_expert_X, quota_SX, source_T))
    if S == 1:  # the layer's call: its own tokens, no sources
        assert torch.equal(assign_pair_slots(ids_TK, order_X, cum_R, E), got)


def test_keys_past_int32_sort_as_int64():
    """Sources x experts past int32: the keys stay int64 and the rule holds."""
    E = 1 << 20
    source_T = torch.tensor([0, 3000, 3000])
    ids_TK = torch.tensor([[5], [7], [5]])
    slot_expert_X = torch.tensor([5, 7])
    quota_SX = torch.zeros(3001, 2, dtype=torch.int64)
    quota_SX[0, 0] = quota_SX[3000, 0] = quota_SX[3000, 1] = 1
    order_X, cum_R = slot_quota_runs(slot_expert_X, quota_SX)
    assert assign_pair_slots(ids_TK, order_X, cum_R, E, source_T).flatten().tolist() == [0, 1, 0]
