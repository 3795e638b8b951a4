import os
import sys

import torch

# Tests import helper modules from this folder (tests/_rank_fns.py) in spawned ranks too.
sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)
