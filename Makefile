# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
# Without GPUs torch's CPU build is installed; on GPU machines override, for example
#   make test TORCH_REQ='torch>=2.11'
PYTHON ?= python3
VENV ?= .venv
TORCH_REQ ?= torch==2.13.0
# Test processes: most tests start ranks that wait on each other, so two keep two cores busy.
TEST_WORKERS ?= 2
BIN := $(VENV)/bin
STAMP := $(VENV)/.hetrain-installed

.PHONY: demo test install prometheus bytecode clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_REQ)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $(STAMP)

demo: $(STAMP) bytecode
	$(BIN)/hetrain demo

test: $(STAMP) prometheus bytecode
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# Every rank and CLI process imports hetrain anew. An editable install is not byte-compiled, and where
# PYTHONDONTWRITEBYTECODE is set no process caches what it compiled: written once here, each process
# reads it (stale files are recompiled by Python, which checks each source's time stamp).
bytecode:
	@$(BIN)/python -m compileall -q hetrain tests examples

# The metrics tests scrape a real Prometheus server; installed from the distribution when missing.
prometheus:
	@sh scripts/install_prometheus.sh

clean:
	rm -rf $(VENV) build *.egg-info
