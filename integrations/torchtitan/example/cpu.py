"""Run torchtitan 0.3.0's ``Trainer`` on CPU processes (gloo): a shim for the example and tests.

Not part of the integration library: on GPUs none of this is needed. torchtitan picks its
device with ``torch._utils._get_available_device_type() or "cuda"``, so on a CPU-only
machine it would call ``torch.cuda``. :func:`enable_cpu` points torchtitan's device globals
at a small CPU stand-in before the trainer is built. The model-side CPU workarounds (DTensor
backend, SDPA attention, FSDP sum reduction) are in :func:`cpu_trainer_config`.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch

__all__ = ["CPUDeviceModule", "enable_cpu", "cpu_trainer_config"]


class CPUDeviceModule:
    """The part of the ``torch.cuda`` interface torchtitan's trainer calls, for CPU."""

    def set_device(self, device) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def is_available(self) -> bool:
        return True

    def get_device_name(self, device=None) -> str:
        return "cpu"

    def get_device_properties(self, device=None):
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return SimpleNamespace(total_memory=pages * page, name="cpu")

    def memory_stats(self, device=None) -> dict:
        return {}

    def reset_peak_memory_stats(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def synchronize(self, device=None) -> None:
        pass


def enable_cpu() -> None:
    """Make torchtitan use ``cpu`` devices and the gloo backend in this process."""
    import torchtitan.tools.utils as tt_utils

    module = CPUDeviceModule()
    for name in ("torchtitan.tools.utils", "torchtitan.components.metrics", "torchtitan.distributed.utils",
                 "torchtitan.distributed.parallel_dims", "torchtitan.models.common.token_dispatcher",
                 "torchtitan.tools.profiler", "torchtitan.trainer"):
        __import__(name)
        mod = sys.modules[name]
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = module
    tt_utils.device_type, tt_utils.device_module = "cpu", module
    import torchtitan.distributed.utils as dist_utils
    if not hasattr(torch.distributed, "set_timeout"):
        # torchtitan shortens the process-group timeouts after step 1 with an API this
        # torch build lacks; keep the launch timeout instead.
        dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None
    from torchtitan.distributed.utils import set_spmd_backend
    set_spmd_backend("partial_dtensor")
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))


def cpu_trainer_config(config):
    """CPU settings on a ``Trainer.Config`` (in place; returns it).

    - ``spmd_backend="partial_dtensor"``: the default ``spmd_types`` backend fails on gloo;
    - SDPA attention: FlexAttention has no CPU backward (SDPA is causal, one document per
      row, which is what the synthetic data is);
    - fp32 parameters (no bf16 FSDP mixed precision on CPU), no compile, no activation
      checkpointing, no CUDA graphs, gloo-friendly FSDP reductions (see
      :func:`force_sum_reduction`).
    """
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    config.compile.enable = False
    config.activation_checkpoint = None
    for layer in config.model_spec.model.layers:
        attention = getattr(layer, "attention", None)
        if attention is not None and hasattr(attention, "inner_attention"):
            attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def force_sum_reduction(model) -> None:
    """FSDP on gloo: reduce with SUM (gloo has no PREMUL_SUM)."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
