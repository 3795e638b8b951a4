"""relibra_torch.compat: the torch-version-dependent names resolve on every supported torch.

torch 2.11/2.12 lack ``dist.all_gather_single``; the shim must then call
``dist.all_gather_into_tensor`` with the same arguments, and on torch 2.13 the new name.
Budget: < 1 s.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from relibra_torch import compat


def _recorder(calls, name):
    def fn(output, input, group=None):
        calls.append((name, group))
        output.copy_(input.repeat(output.numel() // input.numel()))
    return fn


def test_all_gather_single_uses_the_new_name_when_torch_has_it(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "all_gather_single", _recorder(calls, "single"), raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", _recorder(calls, "into_tensor"))
    out = torch.zeros(6)
    compat.all_gather_single(out, torch.tensor([1.0, 2.0, 3.0]), group="g")
    assert calls == [("single", "g")]
    assert out.tolist() == [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]


def test_all_gather_single_falls_back_on_torch_before_2_13(monkeypatch):
    calls = []
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", _recorder(calls, "into_tensor"))
    out = torch.zeros(4)
    compat.all_gather_single(out, torch.tensor([5.0, 6.0]), group=None)
    assert calls == [("into_tensor", None)]
    assert out.tolist() == [5.0, 6.0, 5.0, 6.0]
