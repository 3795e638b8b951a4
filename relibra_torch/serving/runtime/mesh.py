"""The serving mesh of ExpertPlex: prefill-attention, decode-attention and expert ranks.

Ranks are numbered prefill-attention first, then decode-attention, then expert ranks.
Experts are split contiguously over the expert ranks (rank ``x`` holds experts
``x * El .. (x + 1) * El - 1`` of every MoE layer, ``El = E / X``).

Every expert rank owns one **mailbox** per (phase, source): the attention rank ``source`` of
``phase`` (0 = decode, 1 = prefill) writes its routed rows there and reads the outputs back.
Mailbox ``m`` of an expert rank holds rows ``row_base(m) .. row_base(m) + capacity(phase)``
of that rank's one receive buffer, so one grouped GEMM can address every mailbox.

Legend: E experts per layer, X expert ranks, El experts per expert rank, L MoE layers,
D model dim, F expert hidden dim, M mailboxes per expert rank, C rows of a mailbox.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...checks import check_int

__all__ = ["DECODE", "PREFILL", "PHASES", "ServingMesh"]

DECODE, PREFILL = 0, 1
PHASES = ("decode", "prefill")


@dataclass(frozen=True)
class ServingMesh:
    """Roles, expert placement and mailbox layout (identical on every rank).

    Attributes:
        prefill_ranks, decode_ranks: attention ranks per phase (>= 0 each, >= 1 together).
        expert_ranks: X >= 1.
        num_experts: E per MoE layer (divisible by X).
        num_layers: L MoE layers.
        dim: D; hidden_dim: F.
        decode_capacity, prefill_capacity: rows one attention rank may send one expert rank
            for one layer (its mailbox size), per phase: ``tokens * top_k`` bounds it.
    """

    prefill_ranks: int
    decode_ranks: int
    expert_ranks: int
    num_experts: int
    num_layers: int
    dim: int
    hidden_dim: int
    decode_capacity: int
    prefill_capacity: int

    def __post_init__(self) -> None:
        check_int("prefill_ranks", self.prefill_ranks, 0)
        check_int("decode_ranks", self.decode_ranks, 0)
        if self.prefill_ranks + self.decode_ranks == 0:
            raise ValueError("prefill_ranks = decode_ranks = 0; allowed: at least one attention rank")
        check_int("expert_ranks", self.expert_ranks)
        check_int("num_experts", self.num_experts)
        if self.num_experts % self.expert_ranks:
            raise ValueError(f"num_experts = {self.num_experts} is not divisible by expert_ranks = "
                             f"{self.expert_ranks}; allowed: a divisor of the expert count")
        for name in ("num_layers", "dim", "hidden_dim", "decode_capacity", "prefill_capacity"):
            check_int(name, getattr(self, name))

    # ------------------------------------------------------------------ roles

    @property
    def world_size(self) -> int:
        return self.prefill_ranks + self.decode_ranks + self.expert_ranks

    def role(self, rank: int) -> tuple[str, int]:
        """``("prefill" | "decode" | "expert", index within the role)`` of a global rank."""
        check_int("rank", rank, 0, self.world_size - 1)
        if rank < self.prefill_ranks:
            return "prefill", rank
        if rank < self.prefill_ranks + self.decode_ranks:
            return "decode", rank - self.prefill_ranks
        return "expert", rank - self.prefill_ranks - self.decode_ranks

    def rank_of(self, role: str, index: int) -> int:
        base = {"prefill": 0, "decode": self.prefill_ranks, "expert": self.prefill_ranks + self.decode_ranks}
        count = {"prefill": self.prefill_ranks, "decode": self.decode_ranks, "expert": self.expert_ranks}
        if role not in base:
            raise ValueError(f"role = {role!r}; allowed: 'prefill', 'decode', 'expert'")
        check_int("index", index, 0, count[role] - 1)
        return base[role] + index

    # ------------------------------------------------------------------ experts

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.expert_ranks

    def expert_rank_of(self, expert: int) -> int:
        return expert // self.experts_per_rank

    # ------------------------------------------------------------------ mailboxes

    def sources(self, phase: int) -> int:
        return self.decode_ranks if phase == DECODE else self.prefill_ranks

    def capacity(self, phase: int) -> int:
        return self.decode_capacity if phase == DECODE else self.prefill_capacity

    @property
    def mailboxes(self) -> int:
        """M = decode_ranks + prefill_ranks (decode mailboxes first)."""
        return self.decode_ranks + self.prefill_ranks

    def mailbox(self, phase: int, source: int) -> int:
        if phase not in (DECODE, PREFILL):
            raise ValueError(f"phase = {phase!r}; allowed: 0 (decode) or 1 (prefill)")
        check_int("source", source, 0, self.sources(phase) - 1)
        return source if phase == DECODE else self.decode_ranks + source

    def phase_of(self, mailbox: int) -> tuple[int, int]:
        """``(phase, source)`` of mailbox ``m``."""
        check_int("mailbox", mailbox, 0, self.mailboxes - 1)
        if mailbox < self.decode_ranks:
            return DECODE, mailbox
        return PREFILL, mailbox - self.decode_ranks

    def row_base(self, mailbox: int) -> int:
        phase, source = self.phase_of(mailbox)
        if phase == DECODE:
            return source * self.decode_capacity
        return self.decode_ranks * self.decode_capacity + source * self.prefill_capacity

    @property
    def rows(self) -> int:
        """Rows of one expert rank's receive buffer (all its mailboxes)."""
        return self.decode_ranks * self.decode_capacity + self.prefill_ranks * self.prefill_capacity
