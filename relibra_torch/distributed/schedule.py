"""Compatibility alias: the host-side schedule moved to :mod:`relibra_torch.moe.schedule`."""

from ..moe.schedule import *  # noqa: F401,F403
from ..moe.schedule import __all__  # noqa: F401
