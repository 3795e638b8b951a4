"""Replay-aware packing of a step's samples into (data-parallel rank, micro-batch) bins.

Legend (shape suffixes): N samples, L MoE layers, E experts, S data-parallel ranks (one
per EP rank, node-major), M micro-batches per rank, B bins (``M * S``), Q nodes.

Routing replay tells, before the training step, each sample's length and how many of its
tokens every expert of every layer receives. Packing sets both halves of a step's time:

* the dense attention work of each rank and micro-batch (sample lengths, quadratic in a
  sample's length), where every layer waits for the slowest rank;
* the sparse expert work: the experts a micro-batch's samples use, hence how evenly a
  balanced plan can spread them over nodes and how much crosses the network.

:func:`plan_packing` minimises the step time of a packing in the cost model's seconds
(:class:`PackingCosts`, plain numbers: the simulator builds them from its ``CostModel``,
a trainer from its model and hardware). Per micro-batch it charges

* attention / dense: ``L_moe * max_s(a T_s + p P_s) + L_dense * max_s(d T_s + p P_s) +
  max_s(h T_s)`` (``T`` tokens and ``P`` causal pairs ``sum n (n + 1) / 2`` of rank
  ``s``'s samples), the slowest rank per layer, as the cost model does;
* per MoE layer, a lower bound of a *balanced* plan instead of running a planner: experts
  are placed on nodes once per step from the step's aggregate demand (greedy, heaviest
  expert to the lightest node with room); expert compute is the busiest node's load over
  its GPUs (what relibra's intra-node replication reaches); the all-to-all is the busiest
  GPU's ``max(cross-node send, receive)`` plus ``max(intra-node send, receive)``, with a
  node's receive spread evenly over its GPUs and a rank's intra-node tokens spread evenly
  over its node.

Starts: ``fixed`` (the caller's rule, e.g. :func:`relibra_torch.replay.batch_samples` or a
generator's sequential packing; repaired when it leaves a micro-batch empty or overfills
one) and ``length`` (longest first, each sample to the bin with the least attention work
that has room; bins in micro-batch-major order, so the longest samples share micro-batches
and their slowest-rank time is paid once). ``routepack`` then runs simulated annealing
from the better start: moves of one sample and swaps of two samples of similar length
(so routing changes while attention barely does), each priced by re-evaluating only the
one or two micro-batches it touches. The result is never worse than either start on the
objective, and it is deterministic for a given seed and proposal count (a wall-clock
``time_budget_s`` is a safety cap only: when it ends the search, results depend on speed).

Pure: imports nothing from the simulator, the layer or the distributed code.
"""

from .api import pack_replay, per_sample_counts, plan_packing
from .config import PACKING_METHODS, PackingConfig, PackingCosts, PackingPlan, balanced_node_placement
from .problem import PackingProblem

__all__ = ["PACKING_METHODS", "PackingCosts", "PackingConfig", "PackingPlan", "PackingProblem",
           "balanced_node_placement", "plan_packing", "per_sample_counts", "pack_replay"]
