# Two commands for a fresh clone: `make demo` and `make test`. Both create (or reuse) .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-all test-slow gpu-check lint bench clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch==2.13.0 first, so the local CPU wheel is taken instead of a CUDA download.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	mkdir -p out
	rm -rf out/demo_ckpt
	# Train the tiny MLLM on 2 CPU ranks (gloo) with the Optimus schedule; checkpoint, trace, PNG.
	bash examples/pretrain_tiny_cpu.sh
	# Plan the paper's ViT-22B + GPT-175B on 3072 H100s: megatron vs balanced vs optimus.
	$(PY) tools/plan_schedule.py --encoder vit-22b --backbone gpt-175b --gpus 3072 \
		--tp 8 --pp 8 --global-batch 1536 --micro-batch 2 --seq-len 2048 --gpu h100 \
		--trace out/optimus_trace.json --png out/optimus_timeline.png

# Two test processes: most of a test's time is its rank processes starting and waiting.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not slow" --durations=15 tests

test-all: $(STAMP)
	$(PY) -m pytest -q tests

# The heavier variants make test leaves out (CI runs them after make test).
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow tests

# On a CUDA machine: the tests marked gpu (NCCL, CUDA tensors). Unlike make test, nothing skips
# here: no CUDA stops it with one line before any test runs, and a test marked gpus(n) fails
# when fewer than n GPUs are present. On the one-GPU machine: bash tools/gpu_check.sh.
# Installs nothing (a GPU machine has its own CUDA torch): GPU_PYTHON is the interpreter it is
# given, .venv's where one exists, else python3.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	@$(GPU_PYTHON) tests/conftest.py
	MEGATRON_MLLM_GPU_CHECK=1 $(GPU_PYTHON) -m pytest -q -m gpu tests -rfEs

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) tools/bench_schedule.py

clean:
	rm -rf $(VENV) out *.egg-info
