"""Turning an EPLB replica table into a placement that moves few experts.

EPLB's load balance does not change when whole nodes are permuted, nor when the GPUs of a
node are permuted (the hierarchical policy packs groups onto *some* node and physical
experts onto *some* GPU of it; the global policy treats every GPU alike). DeepSeek's
``rebalance_experts`` computes every placement from scratch, so its labels are arbitrary
and almost every expert changes GPU at each rebalance. :func:`relabel_replicas` chooses
the labels instead: the permutation of nodes, and of GPUs inside each node, under which
the most experts are hosted by the GPU that owns them now (an exact maximum-weight
matching per node pair, then over nodes). :func:`assign_owners` then keeps every such
expert with its owner, and gives the others an owner that hosts an instance where one has
native room.

Legend: L layers, E experts, G GPUs, J slots per GPU, N nodes, g GPUs per node,
El native experts per GPU.
"""

from __future__ import annotations

import torch

from .assignment import max_weight_assignment
from .topology import Topology

__all__ = ["assign_owners", "moved_experts", "relabel_replicas"]


def _hosts_LGE(replicas_LGJ: torch.Tensor, num_experts: int) -> torch.Tensor:
    """bool ``[L, G, E]``: GPU ``g`` holds at least one replica of expert ``e``."""
    L, G, J = replicas_LGJ.shape
    hosts = torch.zeros(L, G, num_experts + 1, dtype=torch.bool)
    hosts.scatter_(2, (replicas_LGJ + 1).clamp(min=0), True)
    return hosts[..., 1:]


def relabel_replicas(replicas_LGJ: torch.Tensor, topology: Topology,
                     previous_placement_LE: torch.Tensor) -> torch.Tensor:
    """Permute the nodes, and the GPUs inside each node, of a replica table.

    Score of relabeling new GPU ``a`` as physical GPU ``p``: the number of experts ``a``
    hosts whose current owner is ``p``. For every (new node, physical node) pair the best
    GPU matching is found, then the best node matching on those values. Ties prefer the
    identity (each score is scaled and the identity entries get +1), so a table that is
    already well labelled is left as it is.

    Args:
        replicas_LGJ: int64 ``[L, G, J]`` expert of every physical replica (no ``-1``).
        previous_placement_LE: int64 ``[L, E]`` the placement in force.
    Returns:
        int64 ``[L, G, J]``: the same replicas, GPU rows permuted per layer.
    """
    L, G, J = replicas_LGJ.shape
    N, g, El, E = topology.num_nodes, topology.gpus_per_node, topology.experts_per_gpu, topology.num_experts
    hosts_LGE = _hosts_LGE(replicas_LGJ, E).to(torch.int64)
    owner_LE = previous_placement_LE // El
    onehot_LEG = torch.nn.functional.one_hot(owner_LE, G).to(torch.int64)
    score_LGG = torch.einsum("lae,lep->lap", hosts_LGE, onehot_LEG)       # [L, new GPU, physical GPU]
    gpu_scale, node_scale = g + 1, N + 1                                   # so +1 only breaks ties
    out = torch.empty_like(replicas_LGJ)
    for l in range(L):
        s = score_LGG[l].view(N, g, N, g).tolist()                         # [A][a][P][p]
        gpu_perm, node_value = {}, [[0] * N for _ in range(N)]
        for A in range(N):
            for P in range(N):
                w = [[s[A][a][P][p] * gpu_scale + (a == p) for p in range(g)] for a in range(g)]
                perm = max_weight_assignment(w)
                gpu_perm[A, P] = perm
                node_value[A][P] = sum(s[A][a][P][perm[a]] for a in range(g))
        node_perm = max_weight_assignment(
            [[node_value[A][P] * node_scale + (A == P) for P in range(N)] for A in range(N)])
        rows = [0] * G                                                     # physical GPU -> new GPU
        for A in range(N):
            P = node_perm[A]
            for a, p in enumerate(gpu_perm[A, P]):
                rows[P * g + p] = A * g + a
        out[l] = replicas_LGJ[l, rows]
    return out


def assign_owners(replicas_LGJ: torch.Tensor, topology: Topology,
                  previous_placement_LE: torch.Tensor) -> torch.Tensor:
    """Choose every expert's owner GPU (``El`` per GPU) for a replica table.

    Three passes per layer, each deterministic:

    1. an expert stays with its current owner when that GPU hosts an instance (a GPU owns
       at most ``El`` experts now, so this never overfills it);
    2. experts still without owner, fewest hosting GPUs first, go to the first hosting GPU
       with native room;
    3. the rest (their hosting GPUs are full) stay with their current owner if it has room,
       else go to the first GPU with room in the node of their first instance, else to the
       first GPU with room. Such an expert is a fill on every GPU that runs it.

    An expert that stays on its GPU keeps its native slot; the others take the free native
    slots of their owner in increasing order. Running this again on its own result with an
    unchanged table moves nothing (pass 2 finds no hosting GPU with room for a pass-3
    expert, because rooms only shrink during a pass).

    Returns:
        int64 ``[L, E]`` physical native slot of every expert.
    """
    L, G, J = replicas_LGJ.shape
    E, El, g = topology.num_experts, topology.experts_per_gpu, topology.gpus_per_node
    hosts = _hosts_LGE(replicas_LGJ, E).transpose(1, 2).tolist()          # [L][E][G]
    prev = previous_placement_LE.tolist()
    placement = []
    for l in range(L):
        host_gpus = [[gpu for gpu in range(G) if hosts[l][e][gpu]] for e in range(E)]
        prev_gpu = [p // El for p in prev[l]]
        room = [El] * G
        owner = [-1] * E
        for e in range(E):
            if hosts[l][e][prev_gpu[e]]:
                owner[e] = prev_gpu[e]
                room[prev_gpu[e]] -= 1
        for e in sorted(range(E), key=lambda e: (len(host_gpus[e]), e)):
            if owner[e] < 0:
                free = [gpu for gpu in host_gpus[e] if room[gpu] > 0]
                if free:
                    owner[e] = free[0]
                    room[free[0]] -= 1
        for e in range(E):
            if owner[e] >= 0:
                continue
            if room[prev_gpu[e]] > 0:
                gpu = prev_gpu[e]
            else:
                node = host_gpus[e][0] // g if host_gpus[e] else prev_gpu[e] // g
                free = [gpu for gpu in range(G) if room[gpu] > 0]
                gpu = next((x for x in free if x // g == node), free[0])
            owner[e] = gpu
            room[gpu] -= 1
        # native slots: stayers keep theirs, newcomers take the free ones in order
        taken = [[False] * El for _ in range(G)]
        place = [-1] * E
        for e in range(E):
            if owner[e] == prev_gpu[e]:
                place[e] = prev[l][e]
                taken[owner[e]][prev[l][e] % El] = True
        for e in range(E):
            if place[e] < 0:
                local = taken[owner[e]].index(False)
                taken[owner[e]][local] = True
                place[e] = owner[e] * El + local
        placement.append(place)
    return torch.tensor(placement, dtype=torch.int64).view(L, E)


def moved_experts(previous_placement_LE: torch.Tensor, placement_LE: torch.Tensor,
                  experts_per_gpu: int) -> int:
    """Experts whose owner GPU differs between two placements (all layers)."""
    return int((previous_placement_LE // experts_per_gpu != placement_LE // experts_per_gpu).sum())
