"""Which implementation the ops use: the Triton kernels or the torch reference.

Resolution, per call and per device:

1. the override set by :func:`set_backend` / :func:`use_backend`, if any;
2. else the environment variable ``RELIBRA_OPS_BACKEND``;
3. else ``"auto"``.

``"auto"`` means Triton for CUDA tensors and the torch reference elsewhere. ``"triton"``
forces the kernels everywhere; on CPU tensors that needs the Triton interpreter
(``TRITON_INTERPRET=1`` in the environment before the kernels are first used).
``"torch"`` forces the reference everywhere.

The choice is read when an op runs (inside the custom op), so a graph compiled with
``torch.compile`` follows the switch at run time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from ..checks import check_choice

ENV_VAR = "RELIBRA_OPS_BACKEND"
BACKENDS = ("auto", "triton", "torch")

_override: str | None = None


def _check(name: object, field: str) -> str:
    return check_choice(field, name, BACKENDS)


def get_backend() -> str:
    """The configured backend name: one of ``"auto"``, ``"triton"``, ``"torch"``."""
    if _override is not None:
        return _override
    return _check(os.environ.get(ENV_VAR, "auto") or "auto", ENV_VAR)


def set_backend(name: str | None) -> None:
    """Force the ops backend for this process (``None`` returns to the environment/auto)."""
    global _override
    _override = None if name is None else _check(name, "backend")


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Context manager: use backend ``name`` inside the block, restore the previous setting."""
    global _override
    _check(name, "backend")
    prev = _override
    _override = name
    try:
        yield
    finally:
        _override = prev


def interpreter_enabled() -> bool:
    """True when the Triton interpreter is requested (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def uses_triton(device: torch.device) -> bool:
    """Whether an op on tensors of ``device`` runs the Triton kernels under the current setting.

    Raises RuntimeError when Triton is forced on CPU tensors without the interpreter.
    """
    name = get_backend()
    if name == "torch":
        return False
    if name == "auto":
        return device.type == "cuda"
    if device.type != "cuda" and not interpreter_enabled():
        raise RuntimeError(
            f"ops backend 'triton' on {device.type} tensors needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 before the first op call, or use backend 'torch'/'auto'")
    return True
