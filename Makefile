# The two commands: `make demo` and `make test`. Each creates or refreshes .venv idempotently.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean bench

$(VPY):
	$(PY) -m venv $(VENV)

$(STAMP): $(VPY) pyproject.toml
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet "torch==2.13.0"
	$(VPY) -m pip install --quiet -e ".[test,demo]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/sparsa demo

test: $(STAMP)
	$(VPY) -m pytest tests

clean:
	rm -rf $(VENV) build *.egg-info

# Every benchmark (full runs; tens of minutes on 2 cores), then the markdown tables in docs/ and README.
bench: $(STAMP)
	$(VPY) benchmarks/dispatch_overhead.py
	$(VPY) benchmarks/linear_kernels.py
	$(VPY) benchmarks/bert_inference.py
	$(VPY) benchmarks/adaptive_training.py
	$(VPY) benchmarks/quality.py
	$(VPY) benchmarks/plots.py
	$(VPY) benchmarks/tables.py
