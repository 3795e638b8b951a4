"""Routing replay files: validation, the :class:`RoutingReplay` object, token counts.

File format ``relibra.routing/1`` (safetensors):

* tensor ``routed_experts``: int16 or int32 ``[total_tokens, num_layers, top_k]``, the
  expert ids every token was routed to in every MoE layer, samples concatenated in order;
* tensor ``sample_offsets``: int64 ``[num_samples + 1]``, ``0 = o_0 < o_1 < ... < o_N =
  total_tokens``; sample ``i`` owns tokens ``o_i .. o_{i+1}-1`` (every sample >= 1 token);
* optional tensors ``sample_step`` and ``sample_task``: int64 ``[num_samples]``, >= 0
  (the optimizer step a sample belongs to, and a task/data-source id);
* metadata ``format = "relibra.routing/1"``, ``num_experts``, ``top_k``, ``num_layers``
  (decimal integers), optional ``model`` (printable text), optional ``coverage =
  "completion-only"`` (some samples hold only their generated tokens' rows; absent: every
  token). Nothing else is allowed.

Inside one token's top-k the expert ids are distinct, and every id is in ``[0, num_experts)``.

Shape legend:
  T  tokens (all samples concatenated)     L  MoE layers       K  top-k
  E  logical experts                        N  samples          M  micro-batches
  S  source ranks (data-parallel/EP ranks that hold the tokens)
"""

from __future__ import annotations

import os
from dataclasses import InitVar, dataclass, field

import torch

from ..checks import check_int, check_tensor
from .batching import SampleAssignment, batch_samples  # noqa: F401 - batch_samples: old home, kept importable
from .counts import MAX_EXPERTS, count_by_group, count_experts, validate_expert_ids
from .fileio import (
    check_format,
    check_names,
    check_text_metadata,
    dtype_name,
    one_line,
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
MAX_LAYERS = 2**16
MAX_TOP_K = 2**10

_FILE_ID_DTYPES = (torch.int16, torch.int32)  # accepted in files
_REQUIRED_META = ("format", "num_experts", "top_k", "num_layers")
_OPTIONAL_META = ("model", "coverage")
# metadata coverage: which rows of each sample the file holds (absent: all of its tokens)
COVERAGES = ("completion-only",)
_REQUIRED_TENSORS = ("routed_experts", "sample_offsets")
_OPTIONAL_TENSORS = ("sample_step", "sample_task")



def _validate_offsets(sample_offsets, num_tokens: int) -> None:
    sample_offsets = check_tensor("sample_offsets", sample_offsets)
    if sample_offsets.dtype != torch.int64:
        raise ValueError(f"sample_offsets has dtype {dtype_name(sample_offsets.dtype)}; allowed: int64")
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
    value = check_tensor(name, value)
    if value.dtype != torch.int64:
        raise ValueError(f"{name} has dtype {dtype_name(value.dtype)}; allowed: int64")
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
    coverage: str | None = None,
) -> None:
    """Check routing replay tensors (in memory or just read from a file).

    Args:
        routed_experts_TLK: int16/int32/int64 ``[T, L, K]`` expert ids.
        sample_offsets: int64 ``[N + 1]``, 0 first, strictly increasing, ``T`` last.
        num_experts: ``E``; every id must be in ``[0, E)``.
        top_k, num_layers: if given, must equal ``K`` and ``L``.
        sample_step, sample_task: optional int64 ``[N]``, values >= 0.
        model: optional printable one-line name.
        coverage: None (every token of every sample) or ``"completion-only"`` (some
            samples hold only the rows of their generated tokens; their prompt rows are
            missing, see ``relibra convert --completion-only``).

    Raises ``ValueError`` (``TypeError`` for wrong Python types) naming the field, the bad
    value and what is allowed.
    """
    routed_experts_TLK = check_tensor("routed_experts", routed_experts_TLK)
    check_int("num_experts", num_experts, 1, MAX_EXPERTS)
    if routed_experts_TLK.dim() != 3:
        raise ValueError(
            f"routed_experts has shape {tuple(routed_experts_TLK.shape)}; allowed: [total_tokens, num_layers, top_k]"
        )
    T, L, K = routed_experts_TLK.shape
    if num_layers is not None:
        check_int("num_layers", num_layers, 1, MAX_LAYERS)
        if L != num_layers:
            raise ValueError(f"routed_experts has {L} layers (shape {tuple(routed_experts_TLK.shape)}) but num_layers = {num_layers}; allowed: equal")
    if top_k is not None:
        check_int("top_k", top_k, 1, MAX_TOP_K)
        if K != top_k:
            raise ValueError(f"routed_experts has top-k {K} (shape {tuple(routed_experts_TLK.shape)}) but top_k = {top_k}; allowed: equal")
    if not (1 <= L <= MAX_LAYERS and 1 <= K <= MAX_TOP_K):
        raise ValueError(
            f"routed_experts has shape {tuple(routed_experts_TLK.shape)}; allowed: 1 <= num_layers <= {MAX_LAYERS}, 1 <= top_k <= {MAX_TOP_K}"
        )
    if model is not None:
        check_text_metadata(model, "model", "routing")
    if coverage is not None and coverage not in COVERAGES:
        raise ValueError(f"coverage = {coverage!r}; allowed: None (all tokens) or one of {list(COVERAGES)}")
    _validate_offsets(sample_offsets, T)
    num_samples = sample_offsets.numel() - 1
    _validate_per_sample(sample_step, "sample_step", num_samples)
    _validate_per_sample(sample_task, "sample_task", num_samples)
    validate_expert_ids(routed_experts_TLK, num_experts, name="routed_experts")


def counts_for_tokens(expert_ids_TLK, num_experts: int) -> torch.Tensor:
    """Tokens per (layer, expert): int64 ``[L, E]`` from expert ids ``[T, L, K]``.

    Ids are range-checked (``ValueError`` outside ``[0, E)``); duplicates inside a top-k are
    not checked here (use :func:`validate_expert_ids`), they would simply count twice.
    The strict ``[T, L, K]`` form of :func:`relibra_torch.replay.counts.count_experts`.
    """
    expert_ids_TLK = check_tensor("expert_ids", expert_ids_TLK)
    if expert_ids_TLK.dim() != 3:
        raise ValueError(f"expert_ids has shape {tuple(expert_ids_TLK.shape)}; allowed: [T, L, K]")
    return count_experts(expert_ids_TLK, num_experts, name="expert_ids")


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
    coverage: str | None = None
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
                coverage=self.coverage,
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
        n = self.num_samples
        check_int("sample index", i, -n, n - 1)
        i %= n
        return self.routed_experts_TLK[int(self.sample_offsets[i]) : int(self.sample_offsets[i + 1])]

    __getitem__ = sample

    def select(self, sample_ids) -> "RoutingReplay":
        """A new replay holding the given samples (int ``[n]`` indices, in the given order)."""
        ids = torch.as_tensor(sample_ids)
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"sample_ids is {dtype_name(ids.dtype)} {tuple(ids.shape)}; allowed: integer [n >= 1]")
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
            coverage=self.coverage,
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
        Counted per (micro-batch, source) group by
        :func:`~relibra_torch.replay.counts.count_by_group`; the result is on the device of
        ``routed_experts_TLK``.
        """
        if not isinstance(assignment, SampleAssignment):
            raise TypeError(f"assignment is {type(assignment).__name__}; allowed: SampleAssignment")
        if assignment.num_samples != self.num_samples:
            raise ValueError(
                f"assignment covers {assignment.num_samples} samples but the replay has {self.num_samples}; allowed: equal"
            )
        M, S = assignment.num_micro_batches, assignment.num_ranks
        device = self.routed_experts_TLK.device
        group_N = (assignment.micro_batch_N * S + assignment.rank_N).to(device)
        group_T = torch.repeat_interleave(group_N, self.sample_lengths.to(device))
        counts_BLE = count_by_group(self.routed_experts_TLK, group_T, M * S, self.num_experts,
                                    name="routed_experts")
        return counts_BLE.view(M, S, self.num_layers, self.num_experts).transpose(1, 2).contiguous()

    def save(self, path) -> None:
        """Write this replay to ``path`` (see :func:`save_routing`)."""
        save_routing(
            path, self.routed_experts_TLK, self.sample_offsets, self.num_experts,
            model=self.model, sample_step=self.sample_step, sample_task=self.sample_task,
            coverage=self.coverage,
        )


def _as_int64(value, name: str):
    if value is None:
        return None
    value = torch.as_tensor(value)
    if value.dtype.is_floating_point or value.dtype == torch.bool or value.is_complex():
        raise ValueError(f"{name} has dtype {dtype_name(value.dtype)}; allowed: an integer dtype")
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
    coverage: str | None = None,
) -> None:
    """Validate and write a ``relibra.routing/1`` file.

    Args:
        routed_experts_TLK: int16/int32/int64 ``[T, L, K]``; stored as int16 when
            ``num_experts <= 32768``, else int32.
        sample_offsets: int64 ``[N + 1]`` (other integer dtypes are converted).
        num_experts: ``E``.
        model: optional printable name.
        sample_step, sample_task: optional integer ``[N]`` (stored as int64).
        coverage: optional ``"completion-only"`` (see :func:`validate_routing`).
    """
    sample_offsets = _as_int64(sample_offsets, "sample_offsets")
    sample_step = _as_int64(sample_step, "sample_step")
    sample_task = _as_int64(sample_task, "sample_task")
    validate_routing(
        routed_experts_TLK, sample_offsets, num_experts,
        sample_step=sample_step, sample_task=sample_task, model=model, coverage=coverage,
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
    if coverage is not None:
        metadata["coverage"] = coverage
    write_tensors(path, tensors, metadata)


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
    check_names(meta, _REQUIRED_META, _OPTIONAL_META, "metadata", where)
    check_names(header.tensors, _REQUIRED_TENSORS, _OPTIONAL_TENSORS, "tensor", where)
    num_experts = parse_int_metadata(meta, "num_experts", where, 1, MAX_EXPERTS)
    top_k = parse_int_metadata(meta, "top_k", where, 1, MAX_TOP_K)
    num_layers = parse_int_metadata(meta, "num_layers", where, 1, MAX_LAYERS)
    model = meta.get("model")
    if model is not None:
        check_text_metadata(model, "metadata model", where)
    coverage = meta.get("coverage")
    if coverage is not None and coverage not in COVERAGES:
        raise ValueError(f"{where}: metadata coverage = {one_line(coverage)}; allowed: {', '.join(COVERAGES)} "
                         f"(or absent: every token)")
    if header.dtype("routed_experts") not in _FILE_ID_DTYPES:
        raise ValueError(
            f"{where}: routed_experts has dtype {dtype_name(header.dtype('routed_experts'))}; allowed: int16 or int32"
        )
    # Cheap header-level shape checks before any tensor data is read.
    shape = header.shape("routed_experts")
    if len(shape) != 3 or shape[1] != num_layers or shape[2] != top_k:
        raise ValueError(
            f"{where}: routed_experts has shape {list(shape)}; allowed: [total_tokens, num_layers={num_layers}, top_k={top_k}]"
        )
    for name in ("sample_offsets",) + _OPTIONAL_TENSORS:
        if name in header.tensors and header.dtype(name) != torch.int64:
            raise ValueError(f"{where}: {name} has dtype {dtype_name(header.dtype(name))}; allowed: int64")
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
        coverage=coverage, check=False,
    )
