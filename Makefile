# swarm-node — `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
DEMO_STEPS ?= 150

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

# Without an NVIDIA GPU we pin the small CPU build of torch first; with one, pip takes the
# normal CUDA wheel. hivemind and libp2p are installed in ONE pip command (protobuf 6.x).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "setup: NVIDIA GPU found, installing the CUDA build of torch"; \
		$(PIP) install -q "torch>=2.3"; \
	else \
		echo "setup: no NVIDIA GPU, installing the CPU build torch==2.13.0"; \
		$(PIP) install -q "torch==2.13.0"; \
	fi
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

# a bootstrap peer + 3 stage processes on 127.0.0.1 train stages/runs/default.toml on the bundled corpus;
# stops by itself after DEMO_STEPS tail steps (or Ctrl-C); `make demo DEMO_STEPS=0` stops at the manifest's train.steps
demo: setup
	$(VENV)/bin/swarm-node demo --steps $(DEMO_STEPS)

lint: setup
	$(VENV)/bin/ruff check .

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -p no:cacheprovider

bench: setup
	for b in scripts/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
