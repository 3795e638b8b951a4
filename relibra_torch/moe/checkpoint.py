"""Checkpoints in logical expert order, whatever the placement in force.

Parameters live in *physical* order (row ``i`` of EP rank ``r`` holds the logical expert the
placement puts in native slot ``r * El + i``); checkpoints always hold *logical* order
(expert ``e`` at row ``e``), so a checkpoint loads on any placement and any EP size. The
state-dict hooks here are shared by :class:`~relibra_torch.moe.ReplayBalancedMoE` and the
torchtitan routed experts: they differ only in where the weights sit in the module tree.

With a mesh, a logical tensor is a DTensor sharded evenly in logical order (expert ``e`` on
EP rank ``e // El``), which DCP can reshard to any EP size; without one, a plain ``[E, ...]``
tensor. The conversions move rows with one all-to-all (a collective: every EP rank runs the
same hooks with the same placement).

Whole-model safetensors export/import of the same logical rows: ``save_expert_safetensors``
and ``load_expert_safetensors`` in :mod:`relibra_torch.moe.host`.

Legend: E logical experts, El = E / G native experts per EP rank, G EP ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.migration import move_expert_rows
from .engine import ExpertEngine, local_tensor

__all__ = ["SAFETENSORS_FORMAT", "load_logical_expert_weights", "logical_expert_weights",
           "logical_state_dict_hook", "physical_load_pre_hook", "physical_from_logical"]

SAFETENSORS_FORMAT = "relibra.experts/1"


def _rewrap(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor with ``like``'s mesh, placements and global shape (if ``like`` is one)."""
    from torch.distributed.tensor import DTensor
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def _check_rows(engine: ExpertEngine, key: str, local: torch.Tensor) -> None:
    El = engine.topology.experts_per_gpu
    if local.shape[0] != El:
        raise ValueError(
            f"{key}: local shard has {local.shape[0]} expert rows, expected E/EP = {El}; moving "
            f"experts between placements needs every EP rank to hold its experts whole (no FSDP "
            f"sharding of the experts inside the EP group)")


def logical_state_dict_hook(engine: ExpertEngine, state_dict: dict, keys: dict[str, str]) -> None:
    """Rewrite the expert entries of ``state_dict`` from physical to logical order (in place).

    Args:
        keys: expert parameter name (``EXPERT_PARAMS``) -> its key in ``state_dict``.
    """
    if engine.identity_placement:
        return
    identity_E = torch.arange(engine.num_experts)
    for name, key in keys.items():
        if key not in state_dict:
            continue
        value = state_dict[key]
        local = local_tensor(value).detach()
        _check_rows(engine, key, local)
        moved = move_expert_rows(local, engine.placement_cpu, identity_E, engine.ep.rank, engine.ep.group)
        state_dict[key] = _rewrap(moved, value)


def physical_from_logical(engine: ExpertEngine, value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A logically ordered expert tensor (full ``[E, ...]``, or a DTensor) -> ``param``'s physical value.

    A DTensor laid out like ``param`` moves its local rows; any other DTensor is gathered
    first; a full tensor gives this rank its rows. A value of another shape is returned
    as it is, so that the loader reports the size mismatch.
    """
    from torch.distributed.tensor import DTensor
    if tuple(value.shape) != tuple(param.shape):
        return value
    same_layout = (isinstance(value, DTensor) and isinstance(param, DTensor)
                   and value.device_mesh == param.device_mesh and value.placements == param.placements)
    both_plain = not isinstance(value, DTensor) and not isinstance(param, DTensor)
    if engine.identity_placement and (same_layout or both_plain):
        return value
    device = local_tensor(param).device
    if same_layout:
        local = move_expert_rows(value.to_local().detach().to(device), torch.arange(engine.num_experts),
                                 engine.placement_cpu, engine.ep.rank, engine.ep.group)
        return _rewrap(local, param)
    if isinstance(value, DTensor):
        value = value.full_tensor()
    local = value.detach().index_select(0, engine.native_experts().to(value.device)).to(device)
    return _rewrap(local, param)


def physical_load_pre_hook(engine: ExpertEngine, state_dict: dict, keys: dict[str, str],
                           params: dict[str, torch.Tensor]) -> None:
    """Rewrite the expert entries of ``state_dict`` from logical to physical order (in place).

    Args:
        keys: expert parameter name -> its key in ``state_dict``.
        params: expert parameter name -> the module's parameter (the target layout).
    """
    for name, key in keys.items():
        if key in state_dict:
            state_dict[key] = physical_from_logical(engine, state_dict[key], params[name])


def logical_expert_weights(engine: ExpertEngine, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full ``[E, ...]`` expert weights in logical order on every rank (collective)."""
    out = {}
    identity_E = torch.arange(engine.num_experts)
    for name, p in params.items():
        local = move_expert_rows(local_tensor(p).detach(), engine.placement_cpu, identity_E,
                                 engine.ep.rank, engine.ep.group)
        if engine.ep.group is not None:
            parts = [torch.empty_like(local) for _ in range(engine.ep.size)]
            dist.all_gather(parts, local.contiguous(), group=engine.ep.group)
            local = torch.cat(parts)
        out[name] = local
    return out


@torch.no_grad()
def load_logical_expert_weights(engine: ExpertEngine, params: dict[str, torch.Tensor],
                                weights: dict[str, torch.Tensor]) -> None:
    """Load full ``[E, ...]`` logical expert weights (this rank takes its rows; no collective)."""
    rows = engine.native_experts()
    for name, p in params.items():
        if name not in weights:
            raise ValueError(f"missing expert weight {name!r}; got keys {sorted(weights)}")
        full = weights[name]
        if tuple(full.shape) != tuple(p.shape):
            raise ValueError(f"expert weight {name} has shape {tuple(full.shape)}, expected {tuple(p.shape)}")
        local_tensor(p).copy_(full.index_select(0, rows.to(full.device)))
