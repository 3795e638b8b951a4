"""Record a rollout's routing and write ``relibra.routing/1`` replay files.

:class:`RoutingRecorder` is a context manager that hooks every MoE layer of a model and, for
every forward pass, stores each token's top-k expert ids per layer. Generation runs many
forwards (a prefill, then one incremental decoding step per token with a KV cache, batched
over sequences that start and stop at different times), so before each forward the caller
says which sequence and which position every flattened token of that forward is
(:meth:`RoutingRecorder.next_forward`). At the end :meth:`RoutingRecorder.replay` assembles
one sample per sequence, tokens in position order ``0 .. len-1`` (prompt then response:
exactly the tokenised sequence the trainer will see), and checks that every position of
every sequence was recorded exactly once.

Layers it understands (found in ``model.modules()`` order, which is the replay's layer order):

* :class:`relibra_torch.moe.ReplayBalancedMoE`, and any module with a
  ``last_expert_ids_TK`` attribute: the layer sets ``last_expert_ids_TK`` (int64 ``[T, K]``,
  the expert ids it used in its last forward, ``T`` flattened tokens) and the recorder
  reads it in a forward hook. With ``routed_experts`` given (replay, or exploration ids
  from the rollout loop) the layer reports those ids, so the recorder also checks that a
  training forward used exactly the recorded experts.
* torchtitan 0.3.0 MoE layers (``torchtitan.models.common.moe.MoE``, and subclasses such as
  ``integrations.torchtitan.RelibraMoE``): a forward pre-hook on the ``routed_experts``
  submodule reads the ``topk_expert_ids_BLK`` it is called with, i.e. the router's choice,
  or the replayed ids when the layer replays (then the router's ``forward`` is not called,
  so a hook on the ``router`` would miss them).

A sequence's last token must also pass through the model once (its routing is part of the
sequence the trainer runs, even though its logits are not needed): a generation loop feeds
the final sampled token in one more decoding step. :meth:`replay` names any sequence and
position that is missing or recorded twice.

Shape legend:
  T  flattened tokens of one forward (or of all forwards)   L  MoE layers   K  top-k
  N  samples (sequences)   E  experts
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn

from ..checks import check_int
from ..replay.routing import RoutingReplay

__all__ = ["MoELayerRef", "RoutingRecorder", "find_moe_layers", "layout_for_batch"]

RELIBRA_ATTR = "last_expert_ids_TK"


@dataclass(frozen=True)
class MoELayerRef:
    """One recorded MoE layer: its name in the model, the module, and how it is read.

    ``kind`` is ``"relibra"`` (reads ``module.last_expert_ids_TK`` after forward) or
    ``"torchtitan"`` (reads the ids passed to its ``routed_experts`` submodule).
    """

    name: str
    module: nn.Module
    kind: str

    @property
    def num_experts(self) -> int | None:
        src = self.module.router if self.kind == "torchtitan" else self.module
        value = getattr(src, "num_experts", None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def _torchtitan_moe_class():
    # Only look when torchtitan is already imported: a model built from torchtitan modules
    # has imported it, and the import costs seconds for everyone else.
    if "torchtitan" not in sys.modules:
        return None
    try:
        from torchtitan.models.common.moe import MoE
    except Exception:  # noqa: BLE001 - another torchtitan version: no integration
        return None
    return MoE


def _relibra_moe_class():
    try:
        from relibra_torch.moe import ReplayBalancedMoE
    except Exception:  # noqa: BLE001 - the module may not exist in a partial install
        return None
    return ReplayBalancedMoE


def find_moe_layers(model: nn.Module) -> list[MoELayerRef]:
    """MoE layers of ``model`` in ``model.modules()`` order (the replay's layer order).

    A module counts as a relibra layer if it is a ``ReplayBalancedMoE`` or has a
    ``last_expert_ids_TK`` attribute; as a torchtitan layer if it is torchtitan's ``MoE``.
    Layers nested inside another found layer are not counted twice.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model is {type(model).__name__}; allowed: a torch.nn.Module")
    relibra_cls = _relibra_moe_class()
    titan_cls = _torchtitan_moe_class()
    found: list[MoELayerRef] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        if (relibra_cls is not None and isinstance(module, relibra_cls)) or hasattr(module, RELIBRA_ATTR):
            found.append(MoELayerRef(name, module, "relibra"))
        elif titan_cls is not None and isinstance(module, titan_cls):
            found.append(MoELayerRef(name, module, "torchtitan"))
        else:
            continue
        inside.append(name)
    return found


def _as_index(value, name: str) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{name} has dtype {t.dtype}; allowed: an integer dtype")
    if t.dim() != 1:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; allowed: [T] (one entry per flattened token)")
    return t.detach().to("cpu", torch.int64)


class RoutingRecorder:
    """Record top-k expert ids per token and layer during generation.

    Args:
        model: the model; its MoE layers are found with :func:`find_moe_layers`.
        layers: instead of ``model``, the MoE modules in layer order (relibra layers, or
            torchtitan ``MoE`` modules).
        num_experts: ``E`` for the file; default: the layers' ``num_experts`` attribute
            (all layers must agree).
        model_name: optional ``model`` metadata for the file.

    Use::

        with RoutingRecorder(model) as rec:
            rec.next_forward(sample_T, position_T)   # before every forward
            logits = model(...)
            ...
        rec.save("rollout.routing.safetensors")

    ``sample_T`` says which sequence (0-based, ``-1`` for a padding token to ignore) and
    ``position_T`` which position in that sequence each flattened token of the next forward
    is, in the order the layers flatten them (row-major ``[B, S]`` for batched inputs).
    Hooks are attached on ``__enter__`` and removed on ``__exit__``; records are kept until
    :meth:`reset`, so several ``with`` blocks can add to one rollout.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        layers: Sequence[nn.Module] | None = None,
        num_experts: int | None = None,
        model_name: str | None = None,
    ):
        if (model is None) == (layers is None):
            raise ValueError("give exactly one of model and layers")
        if model is not None:
            refs = find_moe_layers(model)
            if not refs:
                raise ValueError(
                    f"model {type(model).__name__} has no MoE layers; allowed: a model with ReplayBalancedMoE "
                    f"(or modules with a {RELIBRA_ATTR} attribute) or torchtitan MoE layers"
                )
        else:
            refs = [self._ref_for(i, m) for i, m in enumerate(layers)]
            if not refs:
                raise ValueError("layers is empty; allowed: at least one MoE module")
        self.layers: list[MoELayerRef] = refs
        self.num_experts = self._resolve_num_experts(num_experts)
        self.model_name = model_name
        self._handles: list = []
        self._layout: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending: list[torch.Tensor | None] = []
        self._events: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    # ------------------------------------------------------------ set-up

    @staticmethod
    def _ref_for(i: int, module) -> MoELayerRef:
        if not isinstance(module, nn.Module):
            raise TypeError(f"layers[{i}] is {type(module).__name__}; allowed: torch.nn.Module")
        relibra_cls = _relibra_moe_class()
        titan_cls = _torchtitan_moe_class()
        if (relibra_cls is not None and isinstance(module, relibra_cls)) or hasattr(module, RELIBRA_ATTR):
            return MoELayerRef(f"layers[{i}]", module, "relibra")
        if titan_cls is not None and isinstance(module, titan_cls):
            return MoELayerRef(f"layers[{i}]", module, "torchtitan")
        raise TypeError(
            f"layers[{i}] is {type(module).__name__}; allowed: ReplayBalancedMoE, a module with a "
            f"{RELIBRA_ATTR} attribute, or torchtitan MoE"
        )

    def _resolve_num_experts(self, num_experts) -> int:
        if num_experts is not None:
            return check_int("num_experts", num_experts, 1)
        values = {ref.name: ref.num_experts for ref in self.layers}
        known = {v for v in values.values() if v is not None}
        if len(known) != 1 or None in values.values():
            raise ValueError(
                f"cannot tell num_experts from the layers (their num_experts: {values}); "
                "allowed: pass num_experts=E"
            )
        return known.pop()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def __enter__(self) -> "RoutingRecorder":
        if self._handles:
            raise RuntimeError("RoutingRecorder is already active; nested use of one recorder is not allowed")
        for index, ref in enumerate(self.layers):
            if ref.kind == "torchtitan":
                # The ids the experts receive: also right when the router is bypassed (replay
                # in integrations.torchtitan's RelibraMoE calls the gate, not router.forward).
                hook = self._make_experts_hook(index)
                self._handles.append(ref.module.routed_experts.register_forward_pre_hook(hook, with_kwargs=True))
            else:
                self._handles.append(ref.module.register_forward_hook(self._make_layer_hook(index)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if exc[0] is None:
            self._flush()

    # ------------------------------------------------------------ recording

    def next_forward(self, sample_T, position_T) -> None:
        """Declare the tokens of the next forward: sequence id and position of each.

        Args:
            sample_T: integer ``[T]``, sequence index ``>= 0`` of each flattened token, or
                ``-1`` for a token to ignore (padding).
            position_T: integer ``[T]``, position ``>= 0`` of each token in its sequence
                (prompt tokens first: the trainer's token index).
        Every layer must then run exactly once on exactly ``T`` tokens before the next call
        (checked; ``ValueError`` names the layer).
        """
        sample_T = _as_index(sample_T, "sample_T")
        position_T = _as_index(position_T, "position_T")
        if sample_T.shape != position_T.shape:
            raise ValueError(
                f"sample_T has {sample_T.numel()} tokens but position_T has {position_T.numel()}; allowed: equal"
            )
        if sample_T.numel() and int(sample_T.min()) < -1:
            raise ValueError(f"sample_T contains {int(sample_T.min())}; allowed: sequence ids >= 0, or -1 for padding")
        real = sample_T >= 0
        if bool(real.any()) and int(position_T[real].min()) < 0:
            raise ValueError(f"position_T contains {int(position_T[real].min())}; allowed: positions >= 0")
        self._flush()
        self._layout = (sample_T, position_T)
        self._pending = [None] * self.num_layers

    def _store(self, index: int, ids) -> None:
        ref = self.layers[index]
        if self._layout is None:
            raise RuntimeError(
                f"MoE layer {ref.name!r} ran while recording but no token layout was declared; "
                "call recorder.next_forward(sample_T, position_T) before every forward"
            )
        if not isinstance(ids, torch.Tensor):
            raise RuntimeError(
                f"MoE layer {ref.name!r} did not provide its expert ids (got {type(ids).__name__}); "
                f"a relibra layer must set {RELIBRA_ATTR} in forward"
            )
        if hasattr(ids, "full_tensor"):  # DTensor ids under tensor parallelism
            ids = ids.full_tensor()
        ids_TK = ids.detach().reshape(-1, ids.shape[-1])
        T = self._layout[0].numel()
        if ids_TK.shape[0] != T:
            raise ValueError(
                f"MoE layer {ref.name!r} routed {ids_TK.shape[0]} tokens but next_forward declared {T}; "
                "allowed: equal (declare every flattened token, -1 for padding)"
            )
        if self._pending[index] is not None:
            raise ValueError(
                f"MoE layer {ref.name!r} ran twice for one declared forward; call next_forward before every forward"
            )
        self._pending[index] = ids_TK.to(torch.int64).clone()

    def _make_layer_hook(self, index: int):
        def hook(module, args, output):
            self._store(index, getattr(module, RELIBRA_ATTR, None))

        return hook

    def _make_experts_hook(self, index: int):
        def hook(module, args, kwargs):
            # torchtitan RoutedExperts.forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, ...)
            ids = args[2] if len(args) >= 3 else kwargs.get("topk_expert_ids_BLK")
            self._store(index, ids)

        return hook

    def _flush(self) -> None:
        if self._layout is None:
            return
        missing = [self.layers[i].name for i, v in enumerate(self._pending) if v is None]
        if len(missing) == self.num_layers:
            # Declared but never run (e.g. nothing left to decode): nothing to keep.
            self._layout, self._pending = None, []
            return
        if missing:
            # Drop the broken forward so the error is reported once, not again on exit.
            self._layout, self._pending = None, []
            raise ValueError(
                f"MoE layers {missing} did not run in the last declared forward; allowed: every MoE layer runs "
                "once per forward"
            )
        ks = {v.shape[1] for v in self._pending}
        if len(ks) != 1:
            raise ValueError(f"MoE layers used different top-k {sorted(ks)}; allowed: one top_k for all layers")
        sample_T, position_T = self._layout
        ids_TLK = torch.stack([v.cpu() for v in self._pending], dim=1)
        keep = sample_T >= 0
        self._events.append((sample_T[keep], position_T[keep], ids_TLK[keep]))
        self._layout, self._pending = None, []

    def reset(self) -> None:
        """Forget everything recorded so far."""
        self._layout, self._pending, self._events = None, [], []

    @property
    def num_recorded_tokens(self) -> int:
        """Tokens recorded so far (padding excluded; a pending forward not counted)."""
        return sum(int(s.numel()) for s, _, _ in self._events)

    # ------------------------------------------------------------ output

    def routed_experts(self, sample_lengths=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(routed_experts_TLK int64, sample_offsets int64 [N+1])`` assembled from the records.

        Samples are sequence ids ``0 .. N-1`` with ``N`` = largest id + 1 (or
        ``len(sample_lengths)``), tokens in position order. Raises ``ValueError`` if a
        sequence has no tokens, a position is missing or recorded twice, or a length differs
        from ``sample_lengths`` (integer ``[N]``, e.g. ``len(prompt) + len(response)``).
        """
        self._flush()
        if not self._events:
            raise ValueError("nothing was recorded; allowed: at least one forward with declared tokens")
        S = torch.cat([s for s, _, _ in self._events])
        P = torch.cat([p for _, p, _ in self._events])
        ids = torch.cat([x for _, _, x in self._events])
        if S.numel() == 0:
            raise ValueError("only padding tokens were recorded; allowed: at least one sequence token")
        n_seen = int(S.max()) + 1
        if sample_lengths is not None:
            lengths_N = _as_index(sample_lengths, "sample_lengths")
            N = lengths_N.numel()
            if n_seen > N:
                raise ValueError(f"sequence {n_seen - 1} was recorded but sample_lengths has {N} entries; allowed: equal")
        else:
            lengths_N, N = None, n_seen
        key = S * (int(P.max()) + 1) + P
        order = torch.argsort(key, stable=True)
        S, P, key, ids = S[order], P[order], key[order], ids[order]
        dup = key[1:] == key[:-1]
        if bool(dup.any()):
            i = int(dup.nonzero()[0, 0])
            raise ValueError(
                f"sequence {int(S[i])} position {int(P[i])} was recorded twice; allowed: each position once "
                "(declare recomputed tokens as -1)"
            )
        counts_N = torch.bincount(S, minlength=N)
        # Positions are unique and sorted per sequence, so they are 0..n-1 iff the last is n-1.
        ends = torch.cumsum(counts_N, 0)
        for n in range(N):
            c = int(counts_N[n])
            if c == 0:
                raise ValueError(f"sequence {n} has no recorded tokens; allowed: every sequence 0..{N - 1} recorded")
            last = int(P[int(ends[n]) - 1])
            if last != c - 1:
                have = set(P[int(ends[n]) - c : int(ends[n])].tolist())
                gap = next(q for q in range(last + 1) if q not in have)
                raise ValueError(
                    f"sequence {n} is missing position {gap} (recorded {c} positions up to {last}); allowed: "
                    "positions 0..len-1 all recorded (feed the last sampled token through the model once)"
                )
            if lengths_N is not None and c != int(lengths_N[n]):
                raise ValueError(
                    f"sequence {n} has {c} recorded tokens but sample_lengths[{n}] = {int(lengths_N[n])}; allowed: equal"
                )
        offsets = torch.zeros(N + 1, dtype=torch.int64)
        offsets[1:] = ends
        return ids, offsets

    def replay(self, sample_lengths=None, *, sample_step=None, sample_task=None) -> RoutingReplay:
        """The recorded rollout as a validated :class:`RoutingReplay` (one sample per sequence)."""
        ids, offsets = self.routed_experts(sample_lengths)
        to64 = (lambda v: None if v is None else torch.as_tensor(v).to(torch.int64))
        return RoutingReplay(
            ids, offsets, self.num_experts, model=self.model_name,
            sample_step=to64(sample_step), sample_task=to64(sample_task),
        )

    def save(self, path: str | os.PathLike, sample_lengths=None, *, sample_step=None, sample_task=None) -> RoutingReplay:
        """Write the recorded rollout as a ``relibra.routing/1`` file; returns the replay."""
        replay = self.replay(sample_lengths, sample_step=sample_step, sample_task=sample_task)
        replay.save(path)
        return replay


def layout_for_batch(sample_B: Iterable[int], start_B: Iterable[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sample_T, position_T)`` for a ``[B, S]`` batch where row ``b`` is sequence
    ``sample_B[b]`` at positions ``start_B[b] .. start_B[b] + S - 1`` (no padding)."""
    sample_B = torch.as_tensor(list(sample_B), dtype=torch.int64)
    start_B = torch.as_tensor(list(start_B), dtype=torch.int64)
    pos_BS = start_B[:, None] + torch.arange(seq_len, dtype=torch.int64)[None, :]
    return sample_B[:, None].expand(-1, seq_len).reshape(-1), pos_BS.reshape(-1)

