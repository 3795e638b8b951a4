"""Routing replay files: validation, the :class:`RoutingReplay` object, token counts.

File format ``relibra.routing/1`` (safetensors):

* tensor ``routed_experts``: int16 or int32 ``[total_tokens, num_layers, top_k]``, the
  expert ids every token was routed to in every MoE layer, samples concatenated in order;
* tensor ``sample_offsets``: int64 ``[num_samples + 1]``, ``0 = o_0 < o_1 < ... < o_N =
  total_tokens``; sample ``i`` owns tokens ``o_i .. o_{i+1}-1`` (every sample >= 1 token);
* optional tensors ``sample_step`` and ``sample_task``: int64 ``[num_samples]``, >= 0
  (the optimizer step a sample belongs to, and a task/data-source id);
* metadata ``format = "relibra.routing/1"``, ``num_experts``, ``top_k``, ``num_layers``
  (decimal integers), optional ``model`` (printable text). Nothing else is allowed.

Inside one token's top-k the expert ids are distinct, and every id is in ``[0, num_experts)``.

Shape legend:
  T  tokens (all samples concatenated)     L  MoE layers       K  top-k
  E  logical experts                        N  samples          M  micro-batches
  S  source ranks (data-parallel/EP ranks that hold the tokens)
"""

from __future__ import annotations

import heapq
import os
from dataclasses import InitVar, dataclass, field

import torch

from ._io import (
    _one_line,
    check_text_metadata,
    parse_int_metadata,
    read_header,
    read_tensors,
    write_tensors,
)

__all__ = [
    "ROUTING_FORMAT",
    "RoutingReplay",
    "SampleAssignment",
    "validate_expert_ids",
    "validate_routing",
    "counts_for_tokens",
    "batch_samples",
    "save_routing",
    "load_routing",
]

ROUTING_FORMAT = "relibra.routing/1"
# Limits on metadata integers: generous, but small enough that products stay in int64.
MAX_EXPERTS = 2**20
MAX_LAYERS = 2**16
MAX_TOP_K = 2**10

_ID_DTYPES = (torch.int16, torch.int32, torch.int64)  # accepted in memory
_FILE_ID_DTYPES = (torch.int16, torch.int32)  # accepted in files
_REQUIRED_META = ("format", "num_experts", "top_k", "num_layers")
_OPTIONAL_META = ("model",)
_REQUIRED_TENSORS = ("routed_experts", "sample_offsets")
_OPTIONAL_TENSORS = ("sample_step", "sample_task")

# Token chunk for the vectorised passes: bounds temporary memory (chunk * L * K int64
# indices) on million-token files without falling back to per-token Python loops.
_CHUNK_ELEMENTS = 1 << 22


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_tensor(value, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} is {type(value).__name__}; allowed: a torch.Tensor")
    return value


def _check_pos_int(value, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} is {type(value).__name__} {value!r}; allowed: int in [{lo}, {hi}]")
    if not lo <= value <= hi:
        raise ValueError(f"{name} = {value}; allowed: an integer in [{lo}, {hi}]")
    return value


def _token_chunks(num_tokens: int, per_token: int):
    step = max(1, _CHUNK_ELEMENTS // max(1, per_token))
    for start in range(0, num_tokens, step):
        yield start, min(num_tokens, start + step)


def validate_expert_ids(expert_ids, num_experts: int, *, name: str = "routed_experts", check_duplicates: bool = True) -> None:
    """Check an integer tensor ``[..., K]`` of expert ids.

    Every id must be in ``[0, num_experts)`` and (with ``check_duplicates``) the ``K`` ids of
    one row distinct. dtype must be int16, int32 or int64. Usable on in-memory routing, e.g.
    ``[T, K]`` from a router or ``[T, L, K]`` from a replay. Raises ``ValueError`` naming the
    first bad position and value, ``TypeError`` for a non-tensor.
    """
    expert_ids = _check_tensor(expert_ids, name)
    _check_pos_int(num_experts, "num_experts", 1, MAX_EXPERTS)
    if expert_ids.dtype not in _ID_DTYPES:
        raise ValueError(f"{name} has dtype {_dtype_name(expert_ids.dtype)}; allowed: int16, int32 or int64")
    if expert_ids.dim() < 1:
        raise ValueError(f"{name} has shape {tuple(expert_ids.shape)}; allowed: [..., top_k]")
    k = expert_ids.shape[-1]
    if k > num_experts:
        raise ValueError(f"{name}: top_k = {k} exceeds num_experts = {num_experts}; allowed: top_k <= num_experts")
    if expert_ids.numel() == 0:
        return
    bad = (expert_ids < 0) | (expert_ids >= num_experts)
    if bool(bad.any()):
        pos = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name}{list(pos)} = {int(expert_ids[pos])} is out of range; allowed: expert ids in [0, {num_experts})"
        )
    if not check_duplicates or k < 2:
        return
    rows = expert_ids.reshape(-1, k)
    for start, stop in _token_chunks(rows.shape[0], k):
        srt = rows[start:stop].sort(dim=-1).values
        dup = (srt[:, 1:] == srt[:, :-1]).any(dim=-1)
        if bool(dup.any()):
            flat = start + int(dup.nonzero()[0, 0])
            pos = list(torch.unravel_index(torch.tensor(flat), expert_ids.shape[:-1])) if expert_ids.dim() > 1 else []
            pos = [int(p) for p in pos]
            raise ValueError(
                f"{name}{pos} = {rows[flat].tolist()} repeats an expert; allowed: distinct expert ids "
                "within one token's top-k"
            )


def _validate_offsets(sample_offsets, num_tokens: int) -> None:
    sample_offsets = _check_tensor(sample_offsets, "sample_offsets")
    if sample_offsets.dtype != torch.int64:
        raise ValueError(f"sample_offsets has dtype {_dtype_name(sample_offsets.dtype)}; allowed: int64")
    if sample_offsets.dim() != 1 or sample_offsets.numel() < 2:
        raise ValueError(
            f"sample_offsets has shape {tuple(sample_offsets.shape)}; allowed: [num_samples + 1] with num_samples >= 1"
        )
    if int(sample_offsets[0]) != 0:
        raise ValueError(f"sample_offsets[0] = {int(sample_offsets[0])}; allowed: 0")
    diff = sample_offsets[1:] - sample_offsets[:-1]
    if bool((diff <= 0).any()):
        i = int((diff <= 0).nonzero()[0, 0])
        raise ValueError(
            f"sample_offsets[{i}:{i + 2}] = {sample_offsets[i:i + 2].tolist()} is not increasing; "
            "allowed: strictly increasing offsets (every sample has at least one token)"
        )
    if int(sample_offsets[-1]) != num_tokens:
        raise ValueError(
            f"sample_offsets[-1] = {int(sample_offsets[-1])} but routed_experts has {num_tokens} tokens; "
            "allowed: the last offset equals the token count"
        )


def _validate_per_sample(value, name: str, num_samples: int) -> None:
    if value is None:
        return
    value = _check_tensor(value, name)
    if value.dtype != torch.int64:
        raise ValueError(f"{name} has dtype {_dtype_name(value.dtype)}; allowed: int64")
    if tuple(value.shape) != (num_samples,):
        raise ValueError(f"{name} has shape {tuple(value.shape)}; allowed: [num_samples] = [{num_samples}]")
    if num_samples and int(value.min()) < 0:
        i = int((value < 0).nonzero()[0, 0])
        raise ValueError(f"{name}[{i}] = {int(value[i])}; allowed: integers >= 0")


def validate_routing(
    routed_experts_TLK,
    sample_offsets,
    num_experts: int,
    *,
    top_k: int | None = None,
    num_layers: int | None = None,
    sample_step=None,
    sample_task=None,
    model: str | None = None,
) -> None:
    """Check routing replay tensors (in memory or just read from a file).

    Args:
        routed_experts_TLK: int16/int32/int64 ``[T, L, K]`` expert ids.
        sample_offsets: int64 ``[N + 1]``, 0 first, strictly increasing, ``T`` last.
        num_experts: ``E``; every id must be in ``[0, E)``.
        top_k, num_layers: if given, must equal ``K`` and ``L``.
        sample_step, sample_task: optional int64 ``[N]``, values >= 0.
        model: optional printable one-line name.

    Raises ``ValueError`` (``TypeError`` for wrong Python types) naming the field, the bad
    value and what is allowed.
    """
    routed_experts_TLK = _check_tensor(routed_experts_TLK, "routed_experts")
    _check_pos_int(num_experts, "num_experts", 1, MAX_EXPERTS)
    if routed_experts_TLK.dim() != 3:
        raise ValueError(
            f"routed_experts has shape {tuple(routed_experts_TLK.shape)}; allowed: [total_tokens, num_layers, top_k]"
        )
    T, L, K = routed_experts_TLK.shape
    if num_layers is not None:
        _check_pos_int(num_layers, "num_layers", 1, MAX_LAYERS)
        if L != num_layers:
            raise ValueError(f"routed_experts has {L} layers (shape {tuple(routed_experts_TLK.shape)}) but num_layers = {num_layers}; allowed: equal")
    if top_k is not None:
        _check_pos_int(top_k, "top_k", 1, MAX_TOP_K)
        if K != top_k:
            raise ValueError(f"routed_experts has top-k {K} (shape {tuple(routed_experts_TLK.shape)}) but top_k = {top_k}; allowed: equal")
    if not (1 <= L <= MAX_LAYERS and 1 <= K <= MAX_TOP_K):
        raise ValueError(
            f"routed_experts has shape {tuple(routed_experts_TLK.shape)}; allowed: 1 <= num_layers <= {MAX_LAYERS}, 1 <= top_k <= {MAX_TOP_K}"
        )
    if model is not None:
        check_text_metadata(model, "model", "routing")
    _validate_offsets(sample_offsets, T)
    num_samples = sample_offsets.numel() - 1
    _validate_per_sample(sample_step, "sample_step", num_samples)
    _validate_per_sample(sample_task, "sample_task", num_samples)
    validate_expert_ids(routed_experts_TLK, num_experts, name="routed_experts")


def counts_for_tokens(expert_ids_TLK, num_experts: int) -> torch.Tensor:
    """Tokens per (layer, expert): int64 ``[L, E]`` from expert ids ``[T, L, K]``.

    Ids are range-checked (``ValueError`` outside ``[0, E)``); duplicates inside a top-k are
    not checked here (use :func:`validate_expert_ids`), they would simply count twice.
    """
    expert_ids_TLK = _check_tensor(expert_ids_TLK, "expert_ids")
    if expert_ids_TLK.dim() != 3:
        raise ValueError(f"expert_ids has shape {tuple(expert_ids_TLK.shape)}; allowed: [T, L, K]")
    validate_expert_ids(expert_ids_TLK, num_experts, name="expert_ids", check_duplicates=False)
    T, L, K = expert_ids_TLK.shape
    device = expert_ids_TLK.device
    layer_base_L = torch.arange(L, dtype=torch.int64, device=device) * num_experts
    out = torch.zeros(L * num_experts, dtype=torch.int64, device=device)
    for start, stop in _token_chunks(T, L * K):
        idx = expert_ids_TLK[start:stop].long() + layer_base_L[None, :, None]
        out += torch.bincount(idx.reshape(-1), minlength=L * num_experts)
    return out.view(L, num_experts)


@dataclass(frozen=True)
class SampleAssignment:
    """Which source rank and micro-batch each sample goes to.

    ``rank_N`` and ``micro_batch_N`` are int64 ``[N]`` with values in ``[0, num_ranks)`` and
    ``[0, num_micro_batches)``. A micro-batch may be empty on some ranks (its counts are 0).
    """

    rank_N: torch.Tensor
    micro_batch_N: torch.Tensor
    num_ranks: int
    num_micro_batches: int

    def __post_init__(self):
        _check_pos_int(self.num_ranks, "num_ranks", 1, 2**20)
        _check_pos_int(self.num_micro_batches, "num_micro_batches", 1, 2**20)
        for name, bound in (("rank_N", self.num_ranks), ("micro_batch_N", self.num_micro_batches)):
            value = _check_tensor(getattr(self, name), name)
            if value.dtype != torch.int64 or value.dim() != 1:
                raise ValueError(
                    f"{name} is {_dtype_name(value.dtype)} {tuple(value.shape)}; allowed: int64 [num_samples]"
                )
            bad = (value < 0) | (value >= bound)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise ValueError(f"{name}[{i}] = {int(value[i])}; allowed: [0, {bound})")
        if self.rank_N.shape != self.micro_batch_N.shape:
            raise ValueError(
                f"rank_N has {self.rank_N.numel()} samples but micro_batch_N has {self.micro_batch_N.numel()}; allowed: equal"
            )

    @property
    def num_samples(self) -> int:
        return self.rank_N.numel()


def batch_samples(
    sample_lengths_N,
    num_ranks: int,
    *,
    num_micro_batches: int | None = None,
    max_tokens_per_micro_batch: int | None = None,
) -> SampleAssignment:
    """The default, deterministic rule that batches samples into ranks and micro-batches.

    1. Ranks: samples in file order; each goes to the rank holding the fewest tokens so far
       (ties: the lowest rank). This is greedy longest-free-bin, not optimal packing.
    2. Micro-batches, per rank, keeping the rank's samples in file order (contiguous runs).
       Give exactly one of:

       * ``num_micro_batches = M``: sample ``j`` of a rank whose samples total ``W`` tokens
         goes to micro-batch ``floor(M * (P_j + len_j / 2) / W)``, where ``P_j`` is the
         tokens before it on that rank; i.e. each sample goes where its midpoint falls when
         the rank's tokens are cut into ``M`` equal parts. Micro-batches can be empty when a
         rank has fewer samples than ``M``.
       * ``max_tokens_per_micro_batch = B``: a new micro-batch starts when the next sample
         would push the current one over ``B`` tokens (verl/slime-style dynamic batch size);
         ``M`` is the largest count over ranks and shorter ranks have trailing empty
         micro-batches. A sample longer than ``B`` raises ``ValueError``.

    Args:
        sample_lengths_N: integer ``[N]`` token counts, each >= 1.
    Returns:
        :class:`SampleAssignment`.
    """
    sample_lengths_N = _check_tensor(sample_lengths_N, "sample_lengths")
    if sample_lengths_N.dtype.is_floating_point or sample_lengths_N.dtype == torch.bool or sample_lengths_N.is_complex():
        raise ValueError(f"sample_lengths has dtype {_dtype_name(sample_lengths_N.dtype)}; allowed: an integer dtype")
    if sample_lengths_N.dim() != 1 or sample_lengths_N.numel() == 0:
        raise ValueError(f"sample_lengths has shape {tuple(sample_lengths_N.shape)}; allowed: [num_samples >= 1]")
    if int(sample_lengths_N.min()) < 1:
        i = int((sample_lengths_N < 1).nonzero()[0, 0])
        raise ValueError(f"sample_lengths[{i}] = {int(sample_lengths_N[i])}; allowed: >= 1")
    _check_pos_int(num_ranks, "num_ranks", 1, 2**20)
    if (num_micro_batches is None) == (max_tokens_per_micro_batch is None):
        raise ValueError(
            f"num_micro_batches = {num_micro_batches}, max_tokens_per_micro_batch = {max_tokens_per_micro_batch}; "
            "allowed: exactly one of them"
        )
    lengths = [int(x) for x in sample_lengths_N.tolist()]
    # Greedy over samples (not tokens): a heap keeps it O(N log S).
    heap = [(0, r) for r in range(num_ranks)]
    rank = [0] * len(lengths)
    for i, n in enumerate(lengths):
        load, r = heapq.heappop(heap)
        rank[i] = r
        heapq.heappush(heap, (load + n, r))
    per_rank: list[list[int]] = [[] for _ in range(num_ranks)]
    for i, r in enumerate(rank):
        per_rank[r].append(i)

    micro = [0] * len(lengths)
    if num_micro_batches is not None:
        M = _check_pos_int(num_micro_batches, "num_micro_batches", 1, 2**20)
        for samples in per_rank:
            total = sum(lengths[i] for i in samples)
            before = 0
            for i in samples:
                # Integer form of floor(M * (before + len/2) / total): exact, no float rounding.
                micro[i] = min(M - 1, (M * (2 * before + lengths[i])) // (2 * total))
                before += lengths[i]
    else:
        budget = _check_pos_int(max_tokens_per_micro_batch, "max_tokens_per_micro_batch", 1, 2**62)
        M = 1
        for samples in per_rank:
            m, used = 0, 0
            for i in samples:
                if lengths[i] > budget:
                    raise ValueError(
                        f"sample_lengths[{i}] = {lengths[i]} exceeds max_tokens_per_micro_batch = {budget}; "
                        "allowed: every sample fits in one micro-batch"
                    )
                if used and used + lengths[i] > budget:
                    m, used = m + 1, 0
                micro[i] = m
                used += lengths[i]
            M = max(M, m + 1)
    return SampleAssignment(
        rank_N=torch.tensor(rank, dtype=torch.int64),
        micro_batch_N=torch.tensor(micro, dtype=torch.int64),
        num_ranks=num_ranks,
        num_micro_batches=M,
    )


@dataclass(frozen=True, eq=False)
class RoutingReplay:
    """Validated routing replay: ``routed_experts_TLK`` and ``sample_offsets`` plus metadata.

    Construction validates everything (:func:`validate_routing`). Tensors are stored as
    given (int16/int32/int64 ids, int64 offsets); ``save`` writes int16 when the ids fit.
    """

    routed_experts_TLK: torch.Tensor
    sample_offsets: torch.Tensor
    num_experts: int
    model: str | None = None
    sample_step: torch.Tensor | None = None
    sample_task: torch.Tensor | None = None
    check: InitVar[bool] = True
    num_layers: int = field(init=False)
    top_k: int = field(init=False)

    def __post_init__(self, check: bool):
        # check=False is for tensors that validate_routing has just accepted (load_routing).
        if check:
            validate_routing(
                self.routed_experts_TLK,
                self.sample_offsets,
                self.num_experts,
                sample_step=self.sample_step,
                sample_task=self.sample_task,
                model=self.model,
            )
        object.__setattr__(self, "num_layers", int(self.routed_experts_TLK.shape[1]))
        object.__setattr__(self, "top_k", int(self.routed_experts_TLK.shape[2]))

    @property
    def num_samples(self) -> int:
        return self.sample_offsets.numel() - 1

    @property
    def num_tokens(self) -> int:
        return int(self.routed_experts_TLK.shape[0])

    @property
    def sample_lengths(self) -> torch.Tensor:
        """int64 ``[N]`` tokens per sample."""
        return self.sample_offsets[1:] - self.sample_offsets[:-1]

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, i: int) -> torch.Tensor:
        """Expert ids ``[T_i, L, K]`` of sample ``i`` (a view; negative ``i`` counts from the end)."""
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"sample index is {type(i).__name__}; allowed: int")
        n = self.num_samples
        if not -n <= i < n:
            raise ValueError(f"sample index {i}; allowed: [{-n}, {n})")
        i %= n
        return self.routed_experts_TLK[int(self.sample_offsets[i]) : int(self.sample_offsets[i + 1])]

    __getitem__ = sample

    def select(self, sample_ids) -> "RoutingReplay":
        """A new replay holding the given samples (int ``[n]`` indices, in the given order)."""
        ids = torch.as_tensor(sample_ids)
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"sample_ids is {_dtype_name(ids.dtype)} {tuple(ids.shape)}; allowed: integer [n >= 1]")
        ids = ids.long()
        n = self.num_samples
        if bool(((ids < 0) | (ids >= n)).any()):
            bad = int(ids[(ids < 0) | (ids >= n)][0])
            raise ValueError(f"sample_ids contains {bad}; allowed: [0, {n})")
        lengths = self.sample_lengths[ids]
        starts = self.sample_offsets[ids]
        # Token gather index built without Python loops over tokens.
        within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        token_idx = torch.repeat_interleave(starts, lengths) + within
        offsets = torch.zeros(ids.numel() + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        return RoutingReplay(
            self.routed_experts_TLK[token_idx],
            offsets,
            self.num_experts,
            model=self.model,
            sample_step=None if self.sample_step is None else self.sample_step[ids],
            sample_task=None if self.sample_task is None else self.sample_task[ids],
        )

    def split_by_step(self) -> dict[int, "RoutingReplay"]:
        """``{step: replay of that step's samples}`` in ascending step order, file order inside.

        Raises ``ValueError`` when the file has no ``sample_step``.
        """
        if self.sample_step is None:
            raise ValueError("sample_step is absent; allowed: split_by_step needs per-sample steps")
        return {
            int(step): self.select((self.sample_step == step).nonzero().squeeze(1))
            for step in torch.unique(self.sample_step).tolist()
        }

    def expert_counts(self) -> torch.Tensor:
        """int64 ``[L, E]``: tokens routed to each expert in each layer, over all samples."""
        return counts_for_tokens(self.routed_experts_TLK, self.num_experts)

    def counts(self, assignment: SampleAssignment) -> torch.Tensor:
        """Token counts ``loads_MLSE`` (int64 ``[M, L, S, E]``) for an assignment of samples.

        ``loads[m, l, s, e]`` = number of tokens of the samples assigned to (source rank
        ``s``, micro-batch ``m``) that layer ``l`` routes to expert ``e``. Each token counts
        once per expert of its top-k, so ``loads[m, l, s].sum() == K * tokens(m, s)``.
        Vectorised: one bincount per chunk of tokens over flattened (m, l, s, e) indices.
        The result is on the device of ``routed_experts_TLK``.
        """
        if not isinstance(assignment, SampleAssignment):
            raise TypeError(f"assignment is {type(assignment).__name__}; allowed: SampleAssignment")
        if assignment.num_samples != self.num_samples:
            raise ValueError(
                f"assignment covers {assignment.num_samples} samples but the replay has {self.num_samples}; allowed: equal"
            )
        M, S = assignment.num_micro_batches, assignment.num_ranks
        T, L, K = self.routed_experts_TLK.shape
        E = self.num_experts
        # Flattened index of (m, l, s, e) = ((m * L + l) * S + s) * E + e, split into a
        # per-token part (m, s), a per-layer part (l) and the expert id.
        device = self.routed_experts_TLK.device
        base_N = (assignment.micro_batch_N * (L * S * E) + assignment.rank_N * E).to(device)
        base_T = torch.repeat_interleave(base_N, self.sample_lengths.to(device))
        layer_L = torch.arange(L, dtype=torch.int64, device=device) * (S * E)
        out = torch.zeros(M * L * S * E, dtype=torch.int64, device=device)
        for start, stop in _token_chunks(T, L * K):
            idx = base_T[start:stop, None, None] + layer_L[None, :, None] + self.routed_experts_TLK[start:stop].long()
            out += torch.bincount(idx.reshape(-1), minlength=out.numel())
        return out.view(M, L, S, E)

    def save(self, path) -> None:
        """Write this replay to ``path`` (see :func:`save_routing`)."""
        save_routing(
            path, self.routed_experts_TLK, self.sample_offsets, self.num_experts,
            model=self.model, sample_step=self.sample_step, sample_task=self.sample_task,
        )


def _as_int64(value, name: str):
    if value is None:
        return None
    value = torch.as_tensor(value)
    if value.dtype.is_floating_point or value.dtype == torch.bool or value.is_complex():
        raise ValueError(f"{name} has dtype {_dtype_name(value.dtype)}; allowed: an integer dtype")
    return value.to(torch.int64)


def save_routing(
    path,
    routed_experts_TLK,
    sample_offsets,
    num_experts: int,
    *,
    model: str | None = None,
    sample_step=None,
    sample_task=None,
) -> None:
    """Validate and write a ``relibra.routing/1`` file.

    Args:
        routed_experts_TLK: int16/int32/int64 ``[T, L, K]``; stored as int16 when
            ``num_experts <= 32768``, else int32.
        sample_offsets: int64 ``[N + 1]`` (other integer dtypes are converted).
        num_experts: ``E``.
        model: optional printable name.
        sample_step, sample_task: optional integer ``[N]`` (stored as int64).
    """
    sample_offsets = _as_int64(sample_offsets, "sample_offsets")
    sample_step = _as_int64(sample_step, "sample_step")
    sample_task = _as_int64(sample_task, "sample_task")
    validate_routing(
        routed_experts_TLK, sample_offsets, num_experts,
        sample_step=sample_step, sample_task=sample_task, model=model,
    )
    T, L, K = routed_experts_TLK.shape
    id_dtype = torch.int16 if num_experts <= 2**15 else torch.int32
    tensors = {"routed_experts": routed_experts_TLK.to(id_dtype), "sample_offsets": sample_offsets}
    if sample_step is not None:
        tensors["sample_step"] = sample_step
    if sample_task is not None:
        tensors["sample_task"] = sample_task
    metadata = {"format": ROUTING_FORMAT, "num_experts": str(num_experts), "top_k": str(K), "num_layers": str(L)}
    if model is not None:
        metadata["model"] = model
    write_tensors(path, tensors, metadata)


def check_format(metadata: dict[str, str], expected: str, where: str) -> None:
    """Raise ``ValueError`` unless ``metadata["format"] == expected``."""
    if "format" not in metadata:
        raise ValueError(f"{where}: metadata 'format' is missing; allowed: {expected!r}")
    if metadata["format"] != expected:
        raise ValueError(f"{where}: metadata format = {_one_line(metadata['format'])}; allowed: {expected!r}")


def _check_names(found, required, optional, kind: str, where: str) -> None:
    found = set(found)
    missing = [k for k in required if k not in found]
    if missing:
        raise ValueError(f"{where}: {kind} {missing[0]!r} is missing; required: {list(required)}")
    unknown = sorted(found - set(required) - set(optional))
    if unknown:
        raise ValueError(
            f"{where}: unknown {kind} {_one_line(unknown[0])}; allowed: {list(required) + list(optional)}"
        )


def load_routing(path) -> RoutingReplay:
    """Read and fully validate a ``relibra.routing/1`` file.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` (naming the field,
    the value and what is allowed) for anything else wrong: not safetensors, truncated,
    wrong or missing metadata, wrong dtypes or shapes, bad offsets, bad expert ids.
    """
    header = read_header(path)
    where = f"file {os.fspath(path)!r}"
    meta = header.metadata
    check_format(meta, ROUTING_FORMAT, where)
    _check_names(meta, _REQUIRED_META, _OPTIONAL_META, "metadata", where)
    _check_names(header.tensors, _REQUIRED_TENSORS, _OPTIONAL_TENSORS, "tensor", where)
    num_experts = parse_int_metadata(meta, "num_experts", where, 1, MAX_EXPERTS)
    top_k = parse_int_metadata(meta, "top_k", where, 1, MAX_TOP_K)
    num_layers = parse_int_metadata(meta, "num_layers", where, 1, MAX_LAYERS)
    model = meta.get("model")
    if model is not None:
        check_text_metadata(model, "metadata model", where)
    if header.dtype("routed_experts") not in _FILE_ID_DTYPES:
        raise ValueError(
            f"{where}: routed_experts has dtype {_dtype_name(header.dtype('routed_experts'))}; allowed: int16 or int32"
        )
    # Cheap header-level shape checks before any tensor data is read.
    shape = header.shape("routed_experts")
    if len(shape) != 3 or shape[1] != num_layers or shape[2] != top_k:
        raise ValueError(
            f"{where}: routed_experts has shape {list(shape)}; allowed: [total_tokens, num_layers={num_layers}, top_k={top_k}]"
        )
    for name in ("sample_offsets",) + _OPTIONAL_TENSORS:
        if name in header.tensors and header.dtype(name) != torch.int64:
            raise ValueError(f"{where}: {name} has dtype {_dtype_name(header.dtype(name))}; allowed: int64")
    tensors = read_tensors(header, list(header.tensors))
    try:
        validate_routing(
            tensors["routed_experts"], tensors["sample_offsets"], num_experts,
            top_k=top_k, num_layers=num_layers,
            sample_step=tensors.get("sample_step"), sample_task=tensors.get("sample_task"),
        )
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return RoutingReplay(
        tensors["routed_experts"], tensors["sample_offsets"], num_experts,
        model=model, sample_step=tensors.get("sample_step"), sample_task=tensors.get("sample_task"),
        check=False,
    )
