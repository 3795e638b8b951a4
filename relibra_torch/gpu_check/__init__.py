"""``make gpu-check``: relibra_torch on the CUDA GPUs of this machine, with what is installed.

Run from a checkout with ``PYTHONPATH=. python3 -m relibra_torch.gpu_check [--out DIR]``
(``make gpu-check``; ``GPU_CHECK=full`` or ``--mode full`` for the long run). Nothing is
installed and no virtual environment is needed: the Python that runs it brings torch and
triton (the declared ranges are torch 2.11-2.13, triton 3.6-3.9).

Parts, each check recorded (ok / failed / skipped with a reason) and the run going on
after a failure:

* ``env``: Python, torch, CUDA, triton, torchtitan, GPUs, driver, commit, and whether the
  versions fall in the ranges pyproject.toml declares;
* ``kernels`` (:mod:`.kernels`): the compiled Triton kernels against float64 references
  (fresh random inputs, NaN-poisoned outputs, empty groups, more than 2^31 elements);
  ``full`` adds every autotune config pinned once;
* ``layer`` (:mod:`.layer`): ``ReplayBalancedMoE`` forward + backward on one GPU against
  the CPU layer, a planned forward, and torchtitan's MoE when torchtitan imports; ``full``
  adds ``torch.compile`` and CUDA-graph replay of a planned forward;
* ``bench`` (:mod:`.bench`): a subset of ``benchmarks/kernels.py`` (figures);
* ``expertplex`` (:mod:`.expertplex`): ExpertPlex's kernel microbenchmark (a decode injected
  into a prefill: plain launches, priority streams, the persistent two-phase kernel); writes
  the measured tile time under ``expertplex.tile_time_us`` of ``gpu_check.json``;
* ``ep`` (:mod:`.ep`): expert parallelism over NCCL on every visible GPU, if more than one.

Writes ``gpu_check.json`` (everything) and ``summary.md`` (environment, figures, one line
per check) to ``--out`` (default ``out/gpu-check``). Without torch or without a CUDA device
it prints one line and exits 0; otherwise it exits 1 if any check failed.
"""
