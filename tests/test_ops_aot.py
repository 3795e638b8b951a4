"""Ahead-of-time compile of every Triton kernel for sm_90 (H100/H200) on CPU.

The interpreter tests cannot see compiler-only failures or a GEMM loop left without a
software pipeline; `python -m relibra_torch.ops.aot` compiles each kernel down to a cubin
with the ptxas bundled in triton, using the JIT's specialisations for aligned shapes. It
runs in a subprocess because this test session sets TRITON_INTERPRET=1 for the interpreter
tests. Budget: ~20 s on one core.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_with_pipelined_gemm_loops():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences triton 3.9's default-change warning
    proc = subprocess.run([sys.executable, "-m", "relibra_torch.ops.aot", "--arch", "90"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "19 kernels compiled for sm_90: 0 failed, 0 GEMM loops not pipelined" in proc.stdout, proc.stdout
