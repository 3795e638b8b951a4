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


def packed_exchange(sizes_GG, D, K, seed):
    """One packed all-to-all of (bf16 rows, fp32 gates, int32 codes) against three separate
    ones: received values, the backward's gradients, and the collectives each issued."""
    from relibra_torch.distributed.collectives import all_to_all_autograd, all_to_all_packed

    r = dist.get_rank()
    send, recv = list(sizes_GG[r]), [row[r] for row in sizes_GG]  # sizes_GG[q][p]: rows q sends to p
    R = sum(send)
    gen = torch.Generator().manual_seed(seed + r)
    x = torch.randn(R, D, generator=gen).to(torch.bfloat16).requires_grad_()
    gates = torch.rand(R, K, generator=gen).requires_grad_()
    codes = torch.randint(-1, 2**31 - 1, (R, K), generator=gen, dtype=torch.int32)
    calls = []
    xp, gp, cp = all_to_all_packed([x, gates, codes], send, recv, dist.group.WORLD, lambda: calls.append(1))
    gp.mul_(1.0)  # outputs are tensors of their own, not views: in-place use is allowed, as on one exchange
    wx, wg = torch.randn(xp.shape, generator=gen).to(torch.bfloat16), torch.randn(gp.shape, generator=gen)
    ((xp.float() * wx.float()).sum() + (gp * wg).sum()).backward()
    got = (xp.detach(), gp.detach(), cp, x.grad.clone(), gates.grad.clone(), len(calls), cp.requires_grad)
    x.grad, gates.grad = None, None
    xs = all_to_all_autograd(x, send, recv, dist.group.WORLD)
    gs = all_to_all_autograd(gates, send, recv, dist.group.WORLD)
    cs = all_to_all_autograd(codes, send, recv, dist.group.WORLD)
    ((xs.float() * wx.float()).sum() + (gs * wg).sum()).backward()
    want = (xs.detach(), gs.detach(), cs, x.grad.clone(), gates.grad.clone())
    # only the codes: no gradient, so no backward exchange
    calls.clear()
    (c_only,) = all_to_all_packed([codes], send, recv, dist.group.WORLD, lambda: calls.append(1))
    return got, want, len(calls), bool(torch.equal(c_only, cs))
