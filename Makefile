# One command to run locally, one to test. Each sets up what it needs first (a venv in .venv).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup browser run run-streaming test lint benchmark benchmark-streaming benchmark-feed benchmark-incremental retrieval soak clean

$(VENV)/.installed: setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0 -e '.[cpu,store,test,bench,search,serve,lint]'
	# PyPI's torchvision/torchaudio/torchcodec are CUDA-linked and break `from vllm import LLM` on the
	# CPU; triton (pulled by xgrammar) is of no use there.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	touch $@

setup: $(VENV)/.installed

# Debian's Chromium and ChromeDriver, which the browser tests drive (tests/browser.py; without them
# those tests are skipped, and fail under CI=true). Installed only where missing; root or sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -q && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	fi

run: setup
	$(PY) -m pipeline --config configs/local.yaml

run-streaming: setup
	$(PY) -m tools.streaming_demo

# Two pytest-xdist workers, each a session of its own (its engine, emulators and temporary
# folder), a test file each at a time: the suite is CPU-bound on one core in one process.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q tests -n $(TEST_WORKERS) --dist loadfile --durations=25

# Style (ruff: ruff.toml) and types (mypy on pipeline/ and transforms/: setup.cfg). CI runs it first.
lint: setup
	$(PY) -m ruff check
	$(PY) -m mypy

benchmark: setup
	$(PY) -m benchmarks.batch

benchmark-streaming: setup
	$(PY) -m benchmarks.streaming

benchmark-feed: setup
	$(PY) -m benchmarks.feed

benchmark-incremental: setup
	$(PY) -m benchmarks.incremental

retrieval: setup
	$(PY) -m benchmarks.retrieval

soak: setup
	$(PY) -m benchmarks.soak

clean:
	rm -rf out bench-results/*.png  # the runs kept in bench-results/*.json stay
