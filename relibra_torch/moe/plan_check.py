"""Whether the routed ids a layer runs match its installed plan (``ExpertEngine``'s checks).

The plan was made from replayed counts; a forward whose routed ids disagree (a replay bug,
or ids outside ``[-1, E)``) must not exchange rows by the plan's sizes. A scheduled plan is
checked with one all-reduce of per-rank flags; a native plan (``moe.native``) from the
counts its forward gathers anyway. Every rank reaches the same verdict, so none waits alone
in an exchange.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .native import routed_counts
from .schedule import RankSchedule

__all__ = ["MISMATCH_MODES", "PlanChecks"]

#: What a layer does when routed ids disagree with the installed plan (see ExpertEngine).
MISMATCH_MODES = ("degrade", "raise")

# One warning per process for degraded micro-batches (they are counted, not re-announced).
_MISMATCH_WARNED = False


class PlanChecks:
    """The checks of :class:`~relibra_torch.moe.engine.ExpertEngine` (a mixin: it reads the
    engine's ``ep``, ``num_experts``, ``plan``, ``on_mismatch`` and degraded counters)."""

    def _host_counts(self, ids_TK: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``(counts_E, bad)``: int64 CPU ``[E]`` pairs per expert (pads skipped) and the
        number of ids outside ``[-1, E)``, from one device-to-host copy."""
        row = routed_counts(ids_TK, self.num_experts).cpu()
        return row[:-1], int(row[-1])

    def _agree(self, flag: int, device: torch.device, count=None) -> torch.Tensor:
        """int64 CPU ``[G]``: every rank's ``flag`` (one all-reduce; no exchange on one process)."""
        ep = self.ep
        flags = torch.zeros(max(ep.size, 1), dtype=torch.int64)
        flags[ep.rank] = flag
        if ep.group is not None:
            if count is not None:
                count("collectives", 1)
            flags = flags.to(device)
            dist.all_reduce(flags, group=ep.group)
            flags = flags.cpu()
        return flags

    def _raise_bad_ids(self, flags_G: torch.Tensor) -> None:
        ranks = flags_G.nonzero().flatten().tolist()
        raise ValueError(f"routed experts have ids outside [-1, num_experts={self.num_experts}) on EP "
                         f"ranks {ranks}; allowed: expert ids, or -1 for a pad (no expert)")

    def _plan_matches(self, counts_E: torch.Tensor, bad_ids: int, sched: RankSchedule,
                      device: torch.device, count=None, num_tokens: int | None = None) -> bool:
        """Whether every rank's routed ids match the installed plan (all ranks agree).

        One all-reduce of per-rank flags first, so that a mismatch or a bad id on one rank
        cannot leave the others waiting in the token exchange. Bad ids raise on every rank;
        a mismatch raises (``on_mismatch="raise"``) or returns ``False`` everywhere, and the
        caller runs the forward degraded. A plan that relays more tokens than this rank has
        (``num_tokens``) is a mismatch too (flag ``E + 2``), so no rank raises alone in the relay.
        """
        ep = self.ep
        diff = (counts_E != sched.expected_counts_E).nonzero().flatten()
        first = int(diff[0]) if len(diff) else -1
        relay = getattr(self.plan, "relay_Gg", None)
        if first < 0 and relay is not None and num_tokens is not None and int(relay[ep.rank].sum()) > num_tokens:
            first = self.num_experts + 1  # flag E + 2: more relayed tokens than tokens
        # Flag per rank: 0 match, E + 1 bad ids, E + 2 too many relayed tokens, else 1 + first mismatching expert.
        flags = self._agree(self.num_experts + 1 if bad_ids else first + 1, device, count)
        if (flags == self.num_experts + 1).any():
            self._raise_bad_ids(flags == self.num_experts + 1)
        if not flags.any():
            return True
        ranks = flags.nonzero().flatten().tolist()
        if first == self.num_experts + 1:
            detail = (f"here (EP rank {ep.rank}) the plan relays {int(relay[ep.rank].sum())} tokens but the rank "
                      f"has {num_tokens}")
        elif first >= 0:
            detail = (f"here (EP rank {ep.rank}) expert {first} has {int(counts_E[first])} token-expert "
                      f"pairs but the plan's split_SGJ[{ep.rank}] sends {int(sched.expected_counts_E[first])}")
        else:
            detail = f"this rank (EP rank {ep.rank}) matches"
        return self._mismatch(ranks, detail)

    def _mismatch(self, ranks: list[int], detail: str) -> bool:
        """Routed ids disagree with the installed plan on ``ranks`` (every rank calls it
        alike): raise (``on_mismatch="raise"``), or record the degraded forward, warn once
        per process and return ``False``."""
        global _MISMATCH_WARNED
        if self.on_mismatch == "raise":
            raise ValueError(f"routed experts do not match the installed plan on EP ranks {ranks}: {detail}; "
                             f"install the plan made from these routed experts' counts")
        self.degraded_forwards += 1
        tag = self.plan.micro_batch if self.plan is not None and self.plan.micro_batch is not None else -1
        self.degraded_micro_batches.add(tag)
        if not _MISMATCH_WARNED:
            _MISMATCH_WARNED = True
            warnings.warn(f"routed experts do not match the installed plan on EP ranks {ranks} ({detail}); "
                          f"running this forward on the current placement without replicas (correct, "
                          f"slower). Counted in ReplayBalancer.report.degraded_micro_batches; warned once "
                          f"per process. on_mismatch='raise' makes this an error.", RuntimeWarning)
        return False

    def _native_matches(self, counts_SE: torch.Tensor) -> None:
        """Check the gathered int64 ``[S, E]`` counts against the installed native plan's
        ``split_SGJ`` (every rank holds them all: no collective); the forward runs the
        native path either way, so a mismatch is only raised or recorded."""
        se_X = self.plan.slot_expert_GJ.reshape(-1)
        want_SX = self.plan.split_SGJ.reshape(len(counts_SE), -1)
        bad_SX = counts_SE[:, se_X.clamp(min=0)] * (se_X >= 0) != want_SX
        if bad_SX.any():
            s, x = (int(i) for i in bad_SX.nonzero()[0])
            self._mismatch(bad_SX.any(1).nonzero().flatten().tolist(),
                           f"EP rank {s} has {int(counts_SE[s, se_X[x]])} token-expert pairs of expert "
                           f"{int(se_X[x])} but the plan's split_SGJ[{s}] sends {int(want_SX[s, x])}")
