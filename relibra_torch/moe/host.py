"""The public face of an :class:`ExpertEngine` on a module: one mixin for every relibra layer.

:class:`EngineHost` is mixed into :class:`~relibra_torch.moe.ReplayBalancedMoE` and the
torchtitan routed experts. It gives both the same methods (plans, placement, counters,
logical weights, checkpoint hooks) over the module's own ``engine``, expert parameters and
``placement_E`` buffer, so the balancer, the recorder and the checkpoint code treat the two
layers alike. A host provides:

* ``engine``: its :class:`ExpertEngine`;
* ``expert_params()``: ``{name: parameter}`` for ``EXPERT_PARAMS`` (physical order);
* ``expert_param_key(name)``: that parameter's key in the module's state dict (no prefix);
* a non-persistent buffer ``placement_E`` (int64 ``[E]``, on the module's device).
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.replicas import ReplicaMemory
from . import checkpoint
from .engine import EXPERT_PARAMS, ExpertEngine, local_tensor
from .schedule import LayerPlan, RankSchedule

__all__ = ["EngineHost", "load_expert_safetensors", "moe_layers", "save_expert_safetensors",
           "share_replica_memory"]


class EngineHost:
    """Methods shared by every module that executes its experts with an :class:`ExpertEngine`."""

    engine: ExpertEngine

    # -- to be provided by the module --
    def expert_params(self) -> dict[str, torch.Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    def expert_param_key(self, name: str) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- engine state, read-only views --
    @property
    def topology(self):
        """The layer's :class:`~relibra_torch.planning.Topology` (EP layout, slots)."""
        return self.engine.topology

    @property
    def ep_rank(self) -> int:
        """This process's EP rank (0 without a mesh)."""
        return self.engine.ep.rank

    @property
    def plan(self) -> LayerPlan | None:
        """The installed :class:`LayerPlan` (``None``: native placement, no replicas)."""
        return self.engine.plan

    @property
    def placement_cpu(self) -> torch.Tensor:
        """int64 CPU ``[E]`` placement in force (a copy; ``placement_E`` is the device buffer)."""
        return self.engine.placement_cpu.clone()

    @property
    def replica_memory(self) -> ReplicaMemory:
        return self.engine.replica_memory

    @replica_memory.setter
    def replica_memory(self, memory: ReplicaMemory) -> None:
        self.engine.replica_memory = memory

    @property
    def last_slot_tokens_J(self) -> torch.Tensor:
        """int64 ``[J]`` expert rows each slot of this GPU processed in the last forward."""
        return self.engine.last_slot_tokens_J

    @property
    def last_expert_tokens(self) -> int:
        """Expert rows (token-expert pairs) this GPU processed in the last forward (pads
        excluded; reading it after a local forward is a device-to-host copy)."""
        return int(self.engine.last_expert_tokens)

    @property
    def last_fills(self) -> list[tuple[int, int]]:
        """``(slot, logical expert)`` of every fill this GPU received in the last forward."""
        return self.engine.last_fills

    def native_experts(self) -> torch.Tensor:
        """int64 ``[El]``: logical expert at each local row of this rank's expert weights."""
        return self.engine.native_experts()

    def local_expert_weights(self) -> dict[str, torch.Tensor]:
        """This rank's expert parameters as plain ``[El, ...]`` tensors, physical order (views)."""
        return {n: local_tensor(p) for n, p in self.expert_params().items()}

    # -- plans and placement --
    def set_plan(self, plan: LayerPlan | None, schedule: RankSchedule | None = None) -> None:
        """Install the plan for the next forwards (``None``: native placement, no replicas).

        The plan stays installed until replaced (activation recomputation in backward reuses
        it). Raises ``ValueError`` for a plan of another topology or placement. ``schedule``:
        this rank's schedule of the validated plan, built ahead, or ``moe.native.NATIVE``
        (``ExpertEngine.set_plan``).
        """
        self.engine.set_plan(plan, self.placement_E.device, schedule)

    def apply_placement(self, new_placement_E: torch.Tensor, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Move expert weights (and gradients, and optimizer state) to ``new_placement_E``.

        Every rank of the EP group must call it with the same placement (between optimizer
        steps). See :meth:`ExpertEngine.apply_placement`. Returns the number of experts whose
        owner GPU changed.
        """
        params = self.expert_params()
        return self.engine.apply_placement(new_placement_E, [params[n] for n in EXPERT_PARAMS],
                                           self.placement_E, optimizer)

    def _run_experts(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, gates_TK: torch.Tensor) -> torch.Tensor:
        params = self.expert_params()
        return self.engine.run(x_TD, ids_TK, gates_TK, [params[n] for n in EXPERT_PARAMS], self.placement_E)

    # -- logical order (checkpoints) --
    def logical_expert_weights(self) -> dict[str, torch.Tensor]:
        """Full ``[E, ...]`` expert weights in logical order on every rank (collective)."""
        return checkpoint.logical_expert_weights(self.engine, self.expert_params())

    def load_logical_expert_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load full ``[E, ...]`` logical expert weights (this rank takes its rows; no collective)."""
        checkpoint.load_logical_expert_weights(self.engine, self.expert_params(), weights)

    def _register_logical_checkpoint(self) -> None:
        """State dicts in logical expert order (see :mod:`relibra_torch.moe.checkpoint`)."""
        self.register_state_dict_post_hook(_state_dict_hook)
        self.register_load_state_dict_pre_hook(_load_pre_hook)


def _keys(module: EngineHost, prefix: str) -> dict[str, str]:
    return {n: prefix + module.expert_param_key(n) for n in EXPERT_PARAMS}


def _state_dict_hook(module: EngineHost, state_dict, prefix, local_metadata) -> None:
    checkpoint.logical_state_dict_hook(module.engine, state_dict, _keys(module, prefix))


def _load_pre_hook(module: EngineHost, state_dict, prefix, local_metadata, strict, missing_keys,
                   unexpected_keys, error_msgs) -> None:
    checkpoint.physical_load_pre_hook(module.engine, state_dict, _keys(module, prefix), module.expert_params())


def moe_layers(model: nn.Module) -> list[tuple[str, EngineHost]]:
    """``(qualified name, layer)`` of every relibra MoE layer in ``model``, in module order.

    Finds :class:`~relibra_torch.moe.ReplayBalancedMoE` layers and torchtitan
    ``RelibraRoutedExperts`` alike (anything that hosts an :class:`ExpertEngine`).
    """
    return [(n, m) for n, m in model.named_modules() if isinstance(m, EngineHost)]


def share_replica_memory(model: nn.Module) -> ReplicaMemory:
    """Give every MoE layer of ``model`` one :class:`ReplicaMemory`; return it.

    Its ``peak_bytes`` is then the peak replica-buffer memory of this GPU over all layers.
    """
    memory = ReplicaMemory()
    for _, layer in moe_layers(model):
        layer.replica_memory = memory
    return memory


def save_expert_safetensors(model: nn.Module, path: str) -> dict[str, torch.Tensor]:
    """Write every MoE layer's expert weights in logical order to a safetensors file.

    Keys are ``<layer name>.w1_EFD`` etc. (``model`` itself being a layer: just ``w1_EFD``).
    Collective when the layers are expert-parallel: call on every rank; global rank 0 writes.
    Returns the tensors written. Written atomically (a half-written file never takes the
    name), with the umask's permissions.
    """
    from ..replay.fileio import write_tensors

    layers = moe_layers(model)
    if not layers:
        raise ValueError("model has no relibra MoE layer (ReplayBalancedMoE or torchtitan RelibraMoE)")
    tensors: dict[str, torch.Tensor] = {}
    for name, layer in layers:
        for k, v in layer.logical_expert_weights().items():
            tensors[f"{name}.{k}" if name else k] = v.detach().cpu().contiguous()
    meta = {"format": checkpoint.SAFETENSORS_FORMAT,
            "layers": json.dumps({n: layer.engine.num_experts for n, layer in layers})}
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_tensors(path, tensors, meta)
    return tensors


def load_expert_safetensors(model: nn.Module, path: str) -> None:
    """Load expert weights written by :func:`save_expert_safetensors` (any EP layout).

    Every rank reads the file and keeps its own experts; no collective.
    """
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != checkpoint.SAFETENSORS_FORMAT:
            raise ValueError(f"{path}: metadata format is {meta.get('format')!r}, expected "
                             f"{checkpoint.SAFETENSORS_FORMAT!r}")
        keys = set(f.keys())
        for name, layer in moe_layers(model):
            weights = {}
            for k in EXPERT_PARAMS:
                key = f"{name}.{k}" if name else k
                if key not in keys:
                    raise ValueError(f"{path}: missing tensor {key!r}")
                weights[k] = f.get_tensor(key)
            layer.load_logical_expert_weights(weights)
