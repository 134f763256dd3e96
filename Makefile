# Two entry points: `make serve` (install + run the main job) and `make test` (install + tests).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The pinned CPU build of torch first, so the project's `torch>=2.5` pulls nothing more.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/distserve serve --model smollm2-135m --host $(HOST) --port $(PORT) --runtime ray

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) experiments/bench_engine.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
