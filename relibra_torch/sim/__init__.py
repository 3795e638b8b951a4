"""Trace-driven cluster simulator: presets, the step cost model, workloads, the simulator
and its reports (``relibra simulate``; see docs/simulator.md).

The synthetic RL trace generator lives in :mod:`relibra_torch.sim.traces` and is imported
only when a synthetic workload is built.
"""

from .baselines import BaselineOptions
from .cost import CostModel, CostOptions, ReorderWeights, StepCost
from .memory import MemoryBreakdown, MemoryOptions
from .presets import HARDWARE, MODELS, HardwareSpec, ModelSpec, get_hardware, get_model
from .simulator import SYSTEMS, SimConfig, SimResult, SystemResult, simulate
from .transfers import hook_step_collectives, transfer_counts
from .workload import Workload, synthetic_workload, workload_from_file, workload_from_loads

__all__ = [
    "BaselineOptions", "CostModel", "CostOptions", "HARDWARE", "HardwareSpec", "MODELS", "MemoryBreakdown",
    "MemoryOptions", "ModelSpec", "ReorderWeights",
    "SYSTEMS", "SimConfig", "SimResult", "StepCost", "SystemResult", "Workload", "get_hardware",
    "get_model", "hook_step_collectives", "simulate", "synthetic_workload", "transfer_counts",
    "workload_from_file", "workload_from_loads",
]
