# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
# torch is installed only when missing: a bare `pip install torch` pulls a multi-GB CUDA build
TORCH_SPEC ?= torch==2.13.0
# Triton likewise: a CUDA torch brings the Triton it was built with; without one, take the version
# the kernels are tested with (CI runs them under TRITON_INTERPRET=1)
TRITON_SPEC ?= triton==3.6.0

.PHONY: install demo test lint bench-cpu

install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	$(PYTHON) -c "import triton" 2>/dev/null || $(PYTHON) -m pip install -q "$(TRITON_SPEC)"
	$(PYTHON) -m pip install -q -e ".[test,examples]"

demo: install
	$(PYTHON) examples/attention_transfer.py

test: install
	$(PYTHON) -m pytest -n auto -q -p no:benchmark

lint:
	ruff check streamkl tests benchmarks tools examples

bench-cpu:
	$(PYTHON) benchmarks/cpu.py
