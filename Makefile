# The two set-up commands of the README. Each creates and fills its own virtual
# environment, so both work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned here (not only ranged in pyproject.toml): 2.13.0 is the CPU build on this
# disk; anything pip resolves by itself may be a multi-GB CUDA download.
TORCH_PIN := torch==2.13.0

.PHONY: demo test venv

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test,torchtitan]'
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/relibra simulate

test: $(VENV)/.installed
	$(PY) -m pytest -q tests
