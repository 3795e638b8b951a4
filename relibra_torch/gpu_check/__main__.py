import sys

from relibra_torch.gpu_check.runner import main

if __name__ == "__main__":  # not in the EP check's spawned ranks, which import this module's package
    sys.exit(main())
