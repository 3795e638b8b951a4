"""Inference-side balancing of relibra MoE layers: Replicate-and-Quantize (R&Q).

* :mod:`.calibrate` -- per-expert load and importance (gate-weighted output norm) of every
  layer on a calibration set (live routing or a replay);
* :mod:`.plan` -- the pure decisions: greedy resident replicas of heavy experts, int8 for
  the least important experts within a memory budget, and the live even token split;
* :mod:`.quant` -- weight-only int8 with per-output-channel scales;
* :mod:`.transform` -- :func:`replicate_and_quantize`, which rebuilds the layers' expert
  storage (:class:`ResidentExperts`) and hooks it into their engines.

See ``docs/inference.md``.
"""

from .calibrate import CalibrationStats, calibrate, expert_importance
from .plan import LayerDecision, choose_replicas, decide_layer, even_quota, fit_budget, gpu_loads, live_layer_plan
from .quant import dequantize_int8, int8_bytes, quantize_int8
from .transform import ResidentExperts, TransformReport, expert_sizes, replicate_and_quantize

__all__ = ["CalibrationStats", "LayerDecision", "ResidentExperts", "TransformReport", "calibrate",
           "choose_replicas", "decide_layer", "dequantize_int8", "even_quota", "expert_importance",
           "expert_sizes", "fit_budget", "gpu_loads", "int8_bytes", "live_layer_plan", "quantize_int8",
           "replicate_and_quantize"]
