"""The packing problem: evaluate a packing's step time, the starts, and the annealing search.

Legend: see :mod:`relibra_torch.planning.packing`.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from ...checks import check_tensor
from .config import INT_DTYPES, PackingConfig, PackingCosts, aggregate_LE, balanced_node_placement


class PackingProblem:
    """One step's samples, demand and prices; evaluates packings (see the module docstring).

    Args:
        lengths_N: integer ``[N]`` sample lengths (>= 1).
        counts_NLE: integer ``[N, L, E]`` token-expert pairs of each sample per layer and
            expert (from the replay), or ``None`` to price attention only.
        config: :class:`PackingConfig`; costs: :class:`PackingCosts`.
        node_LE: optional int ``[L, E]`` expert-to-node map; default
            :func:`balanced_node_placement` of the step's aggregate demand.
    """

    def __init__(self, lengths_N: torch.Tensor, counts_NLE: torch.Tensor | None, config: PackingConfig,
                 costs: PackingCosts, node_LE: torch.Tensor | None = None):
        check_tensor("lengths_N", lengths_N, dim=1, dtypes=INT_DTYPES)
        N = lengths_N.numel()
        if N == 0:
            raise ValueError("lengths_N is empty; allowed: at least one sample per micro-batch")
        if int(lengths_N.min()) < 1:
            i = int((lengths_N < 1).nonzero()[0, 0])
            raise ValueError(f"lengths_N[{i}] = {int(lengths_N[i])}; allowed: >= 1")
        self.config, self.costs = config, costs
        S, M, g = config.num_ranks, config.num_micro_batches, config.gpus_per_node
        self.S, self.M, self.g, self.Q = S, M, g, S // g
        self.N = N
        if N < S * M:
            raise ValueError(f"{N} samples cannot fill num_ranks x num_micro_batches = {S} x {M} = "
                             f"{S * M} micro-batches (none may be empty); allowed: at least {S * M} "
                             f"samples, or fewer ranks / micro-batches")
        self.n_N = lengths_N.to(torch.int64).numpy().copy()
        cap = config.max_tokens
        long_N = self.n_N > cap
        if int(long_N.sum()) > S * M:
            raise ValueError(f"{int(long_N.sum())} samples are longer than max_tokens = {cap} and each "
                             f"needs a micro-batch of its own, but there are only {S * M}; allowed: a "
                             f"larger max_tokens or more micro-batches")
        rest_bins = S * M - int(long_N.sum())
        rest_tokens = int(self.n_N[~long_N].sum())
        if rest_tokens > rest_bins * cap:
            raise ValueError(f"{rest_tokens} tokens of samples up to max_tokens = {cap} do not fit in the "
                             f"{rest_bins} micro-batches left beside the over-long samples ({rest_bins * cap} "
                             f"tokens); allowed: a larger max_tokens or more micro-batches")
        self.pairs_N = (self.n_N.astype(np.float64) * (self.n_N + 1) / 2.0)
        if counts_NLE is None:
            self.L = 1
            self.d_NLQ = np.zeros((N, 1, self.Q))
            self.tot_NL = np.zeros((N, 1))
            self.moe = False
        else:
            check_tensor("counts_NLE", counts_NLE, dim=3, dtypes=INT_DTYPES)
            if counts_NLE.shape[0] != N:
                raise ValueError(f"counts_NLE has {counts_NLE.shape[0]} samples but lengths_N has {N}")
            if int(counts_NLE.min()) < 0:
                raise ValueError(f"counts_NLE holds {int(counts_NLE.min())}; allowed: counts >= 0")
            L, E = counts_NLE.shape[1:]
            self.L = L
            counts_f = counts_NLE.to(torch.float32)
            if node_LE is None:
                node_LE = balanced_node_placement(aggregate_LE(counts_f, int(self.n_N.max())), self.Q)
            check_tensor("node_LE", node_LE, dim=2)
            if tuple(node_LE.shape) != (L, E) or int(node_LE.min()) < 0 or int(node_LE.max()) >= self.Q:
                raise ValueError(f"node_LE must be [L, E] = [{L}, {E}] with nodes in [0, {self.Q}), got "
                                 f"shape {tuple(node_LE.shape)}")
            onehot_LEQ = torch.nn.functional.one_hot(node_LE.to(torch.int64), self.Q).to(torch.float32)
            # exact in float32 while a sample has fewer than 2**24 token-expert pairs per layer
            self.d_NLQ = torch.einsum("nle,leq->nlq", counts_f, onehot_LEQ).to(torch.float64).numpy()
            self.tot_NL = self.d_NLQ.sum(-1)
            self.moe = True
        self.node_S = np.arange(S) // g
        c = costs
        self._attn = (c.num_moe_layers * c.moe_layer_s_per_token, c.num_moe_layers * c.s_per_attention_pair,
                      c.num_dense_layers * c.dense_layer_s_per_token, c.num_dense_layers * c.s_per_attention_pair,
                      c.head_s_per_token)
        # A sample's routing-blind work on its rank: attention and dense parts, plus the
        # all-to-all send of its token-expert pairs if its experts were spread evenly over
        # the nodes (a fraction (Q-1)/Q crosses nodes, (g-1)/(g Q) stays on other local GPUs).
        a_t = self._attn[0] + self._attn[2] + self._attn[4]
        a_p = self._attn[1] + self._attn[3]
        send = c.cross_node_s_per_token * (self.Q - 1) / self.Q + c.intra_node_s_per_token * (g - 1) / (g * self.Q)
        self.work_N = a_t * self.n_N + a_p * self.pairs_N + send * self.tot_NL.sum(-1)
        if not self.work_N.any():
            self.work_N = self.n_N.astype(np.float64)

    # -- evaluation ------------------------------------------------------------------------
    def _bin_state(self, bin_N: np.ndarray):
        """Per-bin sums: tokens ``[M, S]``, pairs, own-node demand ``[M, S, L]``, total demand."""
        B, L = self.M * self.S, self.L
        T = np.bincount(bin_N, weights=self.n_N, minlength=B).reshape(self.M, self.S)
        P = np.bincount(bin_N, weights=self.pairs_N, minlength=B).reshape(self.M, self.S)
        node_N = self.node_S[bin_N % self.S]
        own_NL = self.d_NLQ[np.arange(self.N), :, node_N]
        Q = self.Q
        # one flat bincount per quantity (np.add.at is unbuffered and slow)
        flat_NL = (bin_N[:, None] * L + np.arange(L)).ravel()
        own = np.bincount(flat_NL, weights=own_NL.ravel(), minlength=B * L).reshape(B, L)
        tot = np.bincount(flat_NL, weights=self.tot_NL.ravel(), minlength=B * L).reshape(B, L)
        flat_NLQ = ((bin_N // self.S)[:, None] * (L * Q) + np.arange(L * Q)).ravel()
        NL = np.bincount(flat_NLQ, weights=self.d_NLQ.ravel(), minlength=self.M * L * Q).reshape(self.M, L, Q)
        return T, P, own.reshape(self.M, self.S, L), tot.reshape(self.M, self.S, L), NL

    def _cost(self, T, P, own, tot, NL) -> np.ndarray:
        """Cost of micro-batches (leading dims ``[...]``): T, P ``[..., S]``, own/tot
        ``[..., S, L]``, NL ``[..., L, Q]``; returns float64 ``[...]``."""
        a_t, a_p, d_t, d_p, h_t = self._attn
        attn = ((a_t * T + a_p * P).max(-1) + (d_t * T + d_p * P).max(-1) + (h_t * T).max(-1))
        if not self.moe:
            return attn
        c, g = self.costs, self.g
        compute = c.compute_s_per_token * NL.max(-1).sum(-1) / g
        # node-level own sums: per node, the own-node demand of its ranks
        sh = own.shape
        own_Q = own.reshape(sh[:-2] + (self.Q, g, sh[-1])).sum(-2)        # [..., Q, L]
        NL_QL = np.swapaxes(NL, -1, -2)                                    # [..., Q, L]
        recv_cross = np.repeat((NL_QL - own_Q) / g, g, axis=-2)           # [..., S, L]
        recv_intra = np.repeat(own_Q * ((g - 1) / (g * g)), g, axis=-2)
        send_cross = tot - own
        send_intra = own * ((g - 1) / g)
        per_gpu = (c.cross_node_s_per_token * np.maximum(send_cross, recv_cross)
                   + c.intra_node_s_per_token * np.maximum(send_intra, recv_intra))
        return attn + compute + per_gpu.max(-2).sum(-1)

    def micro_batch_costs(self, rank_N, micro_batch_N) -> np.ndarray:
        """float64 ``[M]`` objective seconds per micro-batch of a packing."""
        bin_N = self._bins(rank_N, micro_batch_N)
        return self._cost(*self._bin_state(bin_N))

    def objective(self, rank_N, micro_batch_N) -> float:
        """The step's objective (seconds) of a packing (any, feasible or not)."""
        return float(self.micro_batch_costs(rank_N, micro_batch_N).sum())

    def _bins(self, rank_N, micro_batch_N) -> np.ndarray:
        r = torch.as_tensor(rank_N).to(torch.int64).numpy()
        m = torch.as_tensor(micro_batch_N).to(torch.int64).numpy()
        if r.shape != (self.N,) or m.shape != (self.N,):
            raise ValueError(f"rank_N and micro_batch_N must be [{self.N}], got {r.shape} and {m.shape}")
        if r.min() < 0 or r.max() >= self.S or m.min() < 0 or m.max() >= self.M:
            raise ValueError(f"ranks must be in [0, {self.S}) and micro-batches in [0, {self.M})")
        return m * self.S + r

    def violations(self, rank_N, micro_batch_N) -> list[str]:
        """What makes a packing infeasible (empty micro-batches, overfilled ones); [] if none."""
        bin_N = self._bins(rank_N, micro_batch_N)
        B = self.M * self.S
        cnt = np.bincount(bin_N, minlength=B)
        T = np.bincount(bin_N, weights=self.n_N, minlength=B)
        out = []
        if (cnt == 0).any():
            out.append(f"{int((cnt == 0).sum())} empty micro-batches")
        over = (T > self.config.max_tokens) & (cnt > 1)
        if over.any():
            out.append(f"{int(over.sum())} micro-batches over max_tokens = {self.config.max_tokens} "
                       f"with more than one sample")
        return out

    # -- starts ----------------------------------------------------------------------------
    def length_start(self) -> np.ndarray:
        """Longest first, each sample to the bin (micro-batch-major) with the least work that
        has room; returns bins ``[N]`` (``m * S + s``). Work is routing-blind: attention and
        dense time plus the all-to-all send of evenly spread tokens (``work_N``). Where that
        greedy finds no bin with room although the tokens fit (a tight cap: bin packing), it
        packs again best fit (the fullest bin with room), which fills tight caps the balanced
        greedy leaves in fragments; a ``ValueError`` when that fails too (both are greedy:
        on caps within a few tokens of the fullest feasible packing they can fail where a
        packing exists)."""
        for best_fit in (False, True):
            bins = self._longest_first(best_fit)
            if bins is not None:
                return bins
        raise ValueError(f"the longest-first greedy found no packing under max_tokens = {self.config.max_tokens} "
                         f"(tight caps are bin packing; one may still exist); allowed: a larger max_tokens, more "
                         f"micro-batches, or method='routepack' with a feasible initial packing")

    def _longest_first(self, best_fit: bool) -> np.ndarray | None:
        """:meth:`length_start`'s greedy: each sample, longest first, to the bin with room that
        has the least work (``best_fit``: the most tokens); ``None`` where it finds no room."""
        B, cap = self.M * self.S, self.config.max_tokens
        order = np.argsort(-self.n_N, kind="stable")
        T = np.zeros(B)
        work = np.zeros(B)
        cnt = np.zeros(B, dtype=np.int64)
        bin_N = np.empty(self.N, dtype=np.int64)
        for i in order:
            n = self.n_N[i]
            room = cnt == 0 if n > cap else T + n <= cap
            key = np.where(room, -T if best_fit else work, np.inf)
            b = int(key.argmin())
            if not np.isfinite(key[b]):
                return None
            bin_N[i] = b
            T[b] += n
            cnt[b] += 1
            work[b] += self.work_N[i]
        # empty bins (long samples leave too few, or best fit filled others first): _repair, None if it fails
        return self._repair(bin_N) if (cnt == 0).any() else bin_N

    def _repair(self, bin_N: np.ndarray) -> np.ndarray | None:
        """Make a packing feasible with few moves: overfilled bins give their shortest samples
        to the emptiest bins with room; empty bins take the shortest sample of the bin with the
        most samples. ``None`` if that fails."""
        bin_N = bin_N.copy()
        B, cap = self.M * self.S, self.config.max_tokens
        T = np.bincount(bin_N, weights=self.n_N, minlength=B)
        cnt = np.bincount(bin_N, minlength=B)
        for b in np.nonzero((T > cap) & (cnt > 1))[0]:
            members = np.nonzero(bin_N == b)[0]
            members = members[np.argsort(self.n_N[members], kind="stable")]
            for i in members:
                if T[b] <= cap or cnt[b] <= 1:
                    break
                n = self.n_N[i]
                if n > cap:
                    continue
                key = np.where((T + n <= cap) & (np.arange(B) != b), T, np.inf)
                t = int(key.argmin())
                if not np.isfinite(key[t]):
                    return None
                bin_N[i] = t
                T[b] -= n
                T[t] += n
                cnt[b] -= 1
                cnt[t] += 1
            if T[b] > cap and cnt[b] > 1:
                return None
        for b in np.nonzero(cnt == 0)[0]:
            donor = int(cnt.argmax())
            if cnt[donor] < 2:
                return None
            members = np.nonzero(bin_N == donor)[0]
            i = members[np.argmin(self.n_N[members])]
            bin_N[i] = b
            T[donor] -= self.n_N[i]
            T[b] += self.n_N[i]
            cnt[donor] -= 1
            cnt[b] += 1
        return bin_N

    # -- search ----------------------------------------------------------------------------
    def anneal(self, bin_N: np.ndarray) -> tuple[np.ndarray, int, int]:
        """Simulated annealing from a feasible packing; returns the best (bins, proposals,
        accepted). Every proposal keeps the packing feasible."""
        cfg = self.config
        rng = np.random.default_rng(cfg.seed)
        S, M, N, cap = self.S, self.M, self.N, cfg.max_tokens
        bin_N = bin_N.copy()
        T, P, own, tot, NL = self._bin_state(bin_N)
        cost_M = self._cost(T, P, own, tot, NL)
        cnt = np.bincount(bin_N, minlength=M * S).reshape(M, S)
        work_N = self.work_N
        W = np.bincount(bin_N, weights=work_N, minlength=M * S).reshape(M, S)
        cur = float(cost_M.sum())
        best, best_bins = cur, bin_N.copy()
        temp0 = cfg.temperature * cur / M
        order = np.argsort(self.n_N, kind="stable")
        pos = np.empty(N, dtype=np.int64)
        pos[order] = np.arange(N)
        n_N, p_N, d_NLQ, tot_NL, node_S = self.n_N, self.pairs_N, self.d_NLQ, self.tot_NL, self.node_S
        width = 8
        t_end = None if cfg.time_budget_s is None else time.perf_counter() + cfg.time_budget_s
        total = cfg.max_proposals
        accepted = 0
        done = 0

        def shift(i, m, s, sign):
            T[m, s] += sign * n_N[i]
            P[m, s] += sign * p_N[i]
            own[m, s] += sign * d_NLQ[i, :, node_S[s]]
            tot[m, s] += sign * tot_NL[i]
            NL[m] += sign * d_NLQ[i]
            cnt[m, s] += sign
            W[m, s] += sign * work_N[i]

        for it in range(total):
            if t_end is not None and (it & 63) == 0 and time.perf_counter() > t_end:
                break
            done = it + 1
            kind = rng.random()
            if kind < 0.4:
                # Balance one micro-batch: from its busiest rank to its least busy one.
                m1 = m2 = int(rng.integers(M))
                s1, s2 = int(W[m1].argmax()), int(W[m1].argmin())
                if s1 == s2:
                    continue
                b1, b2 = m1 * S + s1, m1 * S + s2
                members = np.flatnonzero(bin_N == b1)
                i = int(members[rng.integers(members.size)])
                swap = members.size < 2 or rng.random() < 0.5
                if swap:
                    others = np.flatnonzero(bin_N == b2)
                    j = int(others[rng.integers(others.size)])
                    if work_N[j] >= work_N[i]:
                        continue
            else:
                i = int(rng.integers(N))
                b1 = int(bin_N[i])
                m1, s1 = divmod(b1, S)
                swap = kind < 0.7
                if swap:  # a sample of similar length elsewhere: routing changes, attention barely
                    j = int(order[min(N - 1, max(0, pos[i] + int(rng.integers(-width, width + 1))))])
                    b2 = int(bin_N[j])
                else:
                    b2 = int(rng.integers(M * S))
                if b2 == b1:
                    continue
                m2, s2 = divmod(b2, S)
            if swap:
                dn = n_N[j] - n_N[i]
                if (cnt[m1, s1] > 1 and T[m1, s1] + dn > cap) or (cnt[m2, s2] > 1 and T[m2, s2] - dn > cap):
                    continue
            elif cnt[m1, s1] < 2 or T[m2, s2] + n_N[i] > cap:
                continue
            ms = (m1,) if m1 == m2 else (m1, m2)
            saved = [(T[m].copy(), P[m].copy(), own[m].copy(), tot[m].copy(), NL[m].copy(), cnt[m].copy(),
                      W[m].copy()) for m in ms]
            shift(i, m1, s1, -1)
            shift(i, m2, s2, +1)
            if swap:
                shift(j, m2, s2, -1)
                shift(j, m1, s1, +1)
            new = [float(self._cost(T[m], P[m], own[m], tot[m], NL[m])) for m in ms]
            delta = sum(new) - sum(float(cost_M[m]) for m in ms)
            temp = temp0 * (1.0 - it / max(total, 1))
            if delta <= 0 or (temp > 0 and rng.random() < math.exp(-delta / temp)):
                for m, c in zip(ms, new):
                    cost_M[m] = c
                bin_N[i] = b2
                if swap:
                    bin_N[j] = b1
                cur += delta
                accepted += 1
                if cur < best - 1e-12 * abs(best):
                    best, best_bins = cur, bin_N.copy()
            else:
                for m, (t_, p_, o_, to_, nl_, c_, w_) in zip(ms, saved):
                    T[m], P[m], own[m], tot[m], NL[m], cnt[m], W[m] = t_, p_, o_, to_, nl_, c_, w_
        return best_bins, done, accepted


