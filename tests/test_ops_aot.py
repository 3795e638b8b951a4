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
from pathlib import Path

import pytest


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_with_pipelined_gemm_loops():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences triton 3.9's default-change warning
    proc = subprocess.run([sys.executable, "-m", "relibra_torch.ops.aot", "--arch", "90"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "19 kernels compiled for sm_90: 0 failed, 0 GEMM loops not pipelined" in proc.stdout, proc.stdout


_SPIN = '''
import triton
import triton.language as tl

from relibra_torch.ops.aot import compile_kernel


@triton.jit
def spin_volatile(ctrl_ptr):
    while tl.load(ctrl_ptr, volatile=True) == 0:
        tl.atomic_add(ctrl_ptr + 1, 1)


@triton.jit
def spin_atomic(ctrl_ptr):
    while tl.atomic_add(ctrl_ptr, 0) == 0:
        tl.atomic_add(ctrl_ptr + 1, 1)


bad = compile_kernel(spin_volatile, "", {"ctrl_ptr": "*i32"}, {}, [], uniform=True)
good = compile_kernel(spin_atomic, "", {"ctrl_ptr": "*i32"}, {}, [], uniform=True)
assert not bad["ok"] and "volatile" in bad["error"], bad
assert good["ok"], good
print("uniform check ok")
'''


@pytest.mark.slow
def test_the_compile_check_refuses_branches_on_volatile_control_reads(tmp_path):
    # The persistent kernel once branched on volatile loads of its control words and crashed
    # on an H200: the check must tell that kernel from one that reads them by atomics.
    script = tmp_path / "spin.py"
    script.write_text(_SPIN)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                      env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "uniform check ok" in proc.stdout, proc.stdout + proc.stderr
