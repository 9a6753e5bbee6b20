# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
# torch is installed only when missing: a bare `pip install torch` pulls a multi-GB CUDA build
TORCH_SPEC ?= torch==2.13.0
# Triton likewise: a CUDA torch brings the Triton it was built with; without one, take the version
# the kernels are tested with (CI runs them under TRITON_INTERPRET=1)
TRITON_SPEC ?= triton==3.6.0
# The newest Triton release, in a venv of its own: the interpreter tests run under it too (the Gluon
# kernels need 3.6; everything else must work on the newest). Bump when a newer release is out.
NEW_TRITON_SPEC ?= triton==3.9.0
NEW_TRITON_VENV ?= .venv-triton-new
NEW_TRITON_TESTS ?= tests/test_kl.py -k "triton and not fp16"

.PHONY: install demo test test-new-triton lint bench-cpu

install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	$(PYTHON) -c "import triton" 2>/dev/null || $(PYTHON) -m pip install -q "$(TRITON_SPEC)"
	$(PYTHON) -m pip install -q -e ".[test,examples]"

demo: install
	$(PYTHON) examples/attention_transfer.py

test: install
	$(PYTHON) -m pytest -n auto -q -p no:benchmark
	$(MAKE) test-new-triton

$(NEW_TRITON_VENV)/.installed:
	$(PYTHON) -m venv $(NEW_TRITON_VENV)
	$(NEW_TRITON_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)" "$(NEW_TRITON_SPEC)" numpy pytest pytest-xdist scipy
	touch $@

test-new-triton: $(NEW_TRITON_VENV)/.installed
	$(NEW_TRITON_VENV)/bin/python -c "import triton; print('interpreter tests under triton', triton.__version__)"
	PYTHONPATH=$(CURDIR) $(NEW_TRITON_VENV)/bin/python -m pytest -n auto -q -p no:benchmark -p no:cacheprovider $(NEW_TRITON_TESTS)

lint:
	ruff check streamkl tests benchmarks tools examples

bench-cpu:
	$(PYTHON) benchmarks/cpu.py
