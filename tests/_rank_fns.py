"""Module-level functions run on gloo ranks by tests (spawned processes import them)."""

import torch
import torch.distributed as dist


def all_reduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    # The other ranks block in a collective that rank 1 never joins.
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def relibra_plan_digest():
    from relibra_torch.planning import Topology, plan_digest, relibra_plan

    topo = Topology(2, 2, 16, 2)
    gen = torch.Generator().manual_seed(7)
    loads = (torch.rand(3, 2, 4, 16, generator=gen) ** 4 * 100).long()
    return plan_digest(relibra_plan(loads, topo))
