# roadlog developer targets. `make test` is the whole suite; every tier must
# collect at least one test (pytest exits 5 on an empty tier, which fails make).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST := $(PY) -m pytest
SEEDS  ?= 200
START  ?= 0
JOBS   ?= $(shell nproc)
SECONDS ?= 60
SEED    ?= 1

.PHONY: proto setup lint typecheck test test-checks-and-fast-tiers test-unit test-simulation test-integration test-netns test-lab sim nemesis bench demo lock clean

setup:
	./scripts/setup.sh

proto: setup
	PY=$(PY) ./scripts/gen_proto.sh

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

typecheck: setup
	$(PY) -m mypy

test-unit: setup
	$(PYTEST) -m unit tests/unit

test-simulation: setup
	$(PYTEST) -m simulation tests/simulation

test-integration: setup
	$(PYTEST) -m integration tests/integration

# Network namespaces on a bridge (10.77.0.0/24) that the tests create and
# remove; needs root.
test-netns: setup
	$(PYTEST) -m netns tests/netns

# Real systemd hosts (systemd-nspawn) deployed by Ansible, checked by
# testinfra, operated with fab; needs root. Tears everything down after.
# Its hosts' setup (boots, deploys) takes minutes by design: stacks only
# for a test still running after 25 minutes.
test-lab: setup
	$(PYTEST) -m lab -o faulthandler_timeout=1500 tests/lab

# The whole suite. The lab tier mostly waits on its hosts (boots, SSH,
# systemd, Spark), so it runs beside the checks, the unit and the
# simulation tiers (each at one core), each side's output printed whole
# when it ends (-O); integration and netns follow alone (they time real
# processes on loopback, and netns shares the lab's bridge subnet). Any
# failure fails the target, after both sides of the first step ended.
test: setup
	$(MAKE) --no-print-directory -j2 -O test-checks-and-fast-tiers test-lab
	$(MAKE) --no-print-directory test-integration test-netns

# The first step's other side, in order.
test-checks-and-fast-tiers: setup
	$(MAKE) --no-print-directory lint typecheck test-unit test-simulation

sim: setup
	$(PY) -m tests.simulation.run --seeds $(SEEDS) --start $(START) --jobs $(JOBS) $(SIMFLAGS)

# Fault injection against a cluster in network namespaces (root): SECONDS of
# faults drawn from SEED, a history in out/nemesis/, one line of verdicts at
# the end; exits non-zero if a property fails. NEMESISFLAGS: --kinds K,...,
# --replay DIR/schedule.json, --subnet A.B.C, --dir DIR.
nemesis: setup
	$(PY) -m tests.nemesis.run --seconds $(SECONDS) --seed $(SEED) $(NEMESISFLAGS)

bench: setup
	$(PY) -m bench.storage_ceiling
	$(PY) -m bench.core_commits
	$(PY) -m bench.ingest
	$(PY) -m bench.round_timeline
	$(PY) -m bench.round_cost
	$(PY) -m bench.transport_hop
	$(PY) -m bench.failover
	$(PY) -m bench.front_door
	$(PY) -m bench.discovery
	$(PY) -m bench.spark_heatmap
	$(PY) -m bench.plot_groups
	$(PY) -m bench.report

demo:
	./scripts/demo.sh

lock: setup
	$(PY) -m pip install -q --disable-pip-version-check uv
	$(VENV)/bin/uv pip compile pyproject.toml --extra node --extra spark --extra dev --extra ops --extra bench --python-version 3.11 --generate-hashes -o requirements.lock
	$(VENV)/bin/uv pip compile pyproject.toml requirements-host.in --extra node --extra spark -c requirements.lock --python-version 3.11 --generate-hashes -o requirements-host.lock

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
