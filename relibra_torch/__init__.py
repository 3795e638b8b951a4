"""relibra_torch: balance Mixture-of-Experts load in RL training with routing replay.

Routing replay fixes every training micro-batch's expert choices before the step, so the
expert load is known in advance. relibra_torch plans from that known future:

* expert *reordering* between optimizer steps balances load across nodes;
* expert *replication* per micro-batch inside a node absorbs the fluctuations.

Subpackages: :mod:`relibra_torch.replay` (routing-replay files), :mod:`relibra_torch.planning`
(topology, step plans, planners), :mod:`relibra_torch.sim` (cost model, traces, simulator),
:mod:`relibra_torch.ops` (Triton kernels with torch references),
:mod:`relibra_torch.distributed` (autograd-aware collectives).
"""

__version__ = "0.1.0"
