# The two set-up commands of the README. Each creates and fills its own virtual
# environment, so both work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch and triton are pinned here (pyproject.toml only gives their ranges): 2.13.0 is the
# CPU build on this disk; anything pip resolves by itself may be a multi-GB CUDA download.
TORCH_PIN := torch==2.13.0
TRITON_PIN := triton==3.9.0
# The oldest triton of the supported range (the one torch 2.11 ships with): the kernel tests
# run a second time under it, from a folder inside the venv put first on PYTHONPATH.
TRITON_OLD_VERSION := 3.6.0
TRITON_OLD := $(VENV)/triton-$(TRITON_OLD_VERSION)
TRITON_TESTS := tests/test_ops_triton.py tests/test_ops_aot.py tests/test_expertplex_kernel.py tests/test_expertplex_gpucheck.py
# `make gpu-check` runs on a CUDA machine with torch and triton already installed: it uses
# that Python (override with PYTHON=...), not the venv, and installs nothing.
PYTHON ?= python3
GPU_CHECK ?=
GPU_CHECK_OUT ?= out/gpu-check

.PHONY: demo test venv gpu-check

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN) $(TRITON_PIN)
	$(PY) -m pip install -q -e '.[test,torchtitan]'
	touch $@

$(TRITON_OLD)/.installed: $(VENV)/.installed
	rm -rf $(TRITON_OLD)
	$(PY) -m pip install -q --no-deps --target $(TRITON_OLD) triton==$(TRITON_OLD_VERSION)
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/relibra simulate

test: $(VENV)/.installed $(TRITON_OLD)/.installed
	$(PY) -m pytest -q tests
	PYTHONPATH=$(TRITON_OLD) $(PY) -c 'import triton; v = triton.__version__; print("kernel tests again under triton", v); assert v == "$(TRITON_OLD_VERSION)", v'
	PYTHONPATH=$(TRITON_OLD) $(PY) -m pytest -q -p no:cacheprovider $(TRITON_TESTS)

# GPU_CHECK=full for the long run; PYTHON=... for another interpreter.
gpu-check:
	@GPU_CHECK=$(GPU_CHECK) PYTHONPATH=. $(PYTHON) -m relibra_torch.gpu_check --out $(GPU_CHECK_OUT)
