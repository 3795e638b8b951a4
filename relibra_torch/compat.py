"""The torch APIs whose name depends on the torch version (the package supports torch >= 2.11).

One place for them, so the rest of the package calls a single name and the oldest supported
torch keeps working. Each entry says in which version the name appeared.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Gather ``input`` from every rank of ``group`` into ``output`` (concatenated along dim 0).

    ``dist.all_gather_single`` is the torch 2.13 name; torch 2.11 and 2.12 have the same
    collective as ``dist.all_gather_into_tensor`` (deprecated, with a warning, from 2.13).
    """
    fn = getattr(dist, "all_gather_single", None)
    if fn is None:
        fn = dist.all_gather_into_tensor
    fn(output, input, group=group)
