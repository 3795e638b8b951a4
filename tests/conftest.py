import os
import sys

# The Triton kernel tests run in the interpreter on CPU. The flag must be set before the
# first `@triton.jit` decorator runs, and any test module may import the ops first, so it is
# set here for the whole session. It changes nothing else: on CPU the ops default to their
# torch reference path whatever the flag says.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

# Tests import helper modules from this folder (tests/_rank_fns.py) in spawned ranks too.
sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)
