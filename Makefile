# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
VENV    := .venv
PYTHON  := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# torch is pinned to the CPU build that lies on this machine's disk; elsewhere pip picks the matching build.
TORCH   ?= torch==2.13.0
ARGS    ?=
# pytest-xdist workers: the suite waits on servers, Ray and subprocesses much of its time, so two workers on two
# cores take ~17 minutes where one took ~29 (each test keeps its one torch thread: tests/conftest.py).
TEST_WORKERS ?= 2

.PHONY: setup model tools serve test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q "$(TORCH)"
	$(PYTHON) -m pip install -q -e '.[dev]'
	touch $(STAMP)

model: setup
	$(PYTHON) -m decoding.weights.loading

# Prometheus and Chromium for the scrape and browser integration tests; without them those tests skip with the reason.
tools:
	@command -v prometheus >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
	  >/dev/null 2>&1 || echo "prometheus unavailable: its integration test will skip"
	@(command -v chromium && command -v chromedriver) >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver) \
	  >/dev/null 2>&1 || echo "chromium unavailable: the playground browser test will skip"

serve: model
	$(VENV)/bin/lookahead-server $(ARGS)

test: model tools
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) $(ARGS)

lint: setup
	$(VENV)/bin/ruff check decoding server tests scripts bench

bench: model
	$(PYTHON) -m bench $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
