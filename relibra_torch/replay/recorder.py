"""Compatibility shim: ``relibra_torch.replay.recorder`` moved to :mod:`relibra_torch.rollout.recorder`.

Kept so that existing imports keep working; new code imports from ``relibra_torch.rollout``.
This module replaces itself with the moved one, so both paths name the same module object
(same classes, and patching one patches the other). Only importing this path loads the
rollout package; ``import relibra_torch.replay`` does not.
"""

import sys

from ..rollout import recorder as _moved

sys.modules[__name__] = _moved
