import sys

from relibra_torch.gpu_check.runner import main

sys.exit(main())
