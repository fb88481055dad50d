# roadlog developer targets. `make test` is the whole suite; every tier must
# collect at least one test (pytest exits 5 on an empty tier, which fails make).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST := $(PY) -m pytest
# Runs a tier's command and says how long it took against the tier's budget
# (tests/budgets.toml): "TIER BUDGET EXCEEDED: ..." past it. The exit status
# is the command's.
BUDGET := $(PY) -m tests.budget
# The unit tier's pytest-xdist workers: its tests wait on sockets, timers and
# subprocesses for about half their time (45 CPU-s in 86 s in one process),
# so four processes on the two cores end it sooner (54 s); UNIT_JOBS=0 runs
# it in one process.
UNIT_JOBS ?= 4
SEEDS  ?= 200
START  ?= 0
JOBS   ?= $(shell nproc)
SECONDS ?= 60
SEED    ?= 1
# The nemesis's cluster: 0 the product's default (one data group per voter, in
# worker processes); 1 every ping in group 0 (the shape before data groups).
DATA_GROUPS ?= 0

.PHONY: proto setup lint typecheck test test-tiers test-bridge-tiers test-loopback-tiers test-unit test-simulation test-integration test-netns test-lab sim nemesis bench demo lock clean

setup:
	./scripts/setup.sh

proto: setup
	PY=$(PY) ./scripts/gen_proto.sh

lint: setup
	$(BUDGET) lint -- sh -ec '$(PY) -m ruff check . && $(PY) -m ruff format --check . && $(VENV)/bin/lint-imports --no-cache'

typecheck: setup
	$(BUDGET) typecheck -- $(PY) -m mypy

test-unit: setup
	$(BUDGET) unit -- $(PYTEST) -m unit $(if $(filter-out 0,$(UNIT_JOBS)),-n $(UNIT_JOBS)) tests/unit

test-simulation: setup
	$(BUDGET) simulation -- $(PYTEST) -m simulation tests/simulation

test-integration: setup
	$(BUDGET) integration -- $(PYTEST) -m integration tests/integration

# Network namespaces on a bridge (10.77.0.0/24) that the tests create and
# remove; needs root.
test-netns: setup
	$(BUDGET) netns -- $(PYTEST) -m netns tests/netns

# Real systemd hosts (systemd-nspawn) deployed by Ansible, checked by
# testinfra, operated with fab; needs root. Tears everything down after.
# Its hosts' setup (boots, deploys) takes minutes by design: stacks only
# for a test still running after 25 minutes.
test-lab: setup
	$(BUDGET) lab -- $(PYTEST) -m lab -o faulthandler_timeout=1500 tests/lab

# The whole suite, within its budget (tests/budgets.toml: 30 minutes in CI on
# the 2-core machine), ending with every tier's time against its budget.
test: setup
	$(BUDGET) suite -- $(MAKE) --no-print-directory test-tiers

# Two sides at once, each side's output printed whole when it ends (-O): the
# tiers on the bridge subnet 10.77.0.0/24 (the lab, then netns: one at a
# time, they share it), and the checks and the loopback tiers. A failed tier
# does not stop the others (-k); any failure fails the target, once every
# tier ended.
test-tiers: setup
	$(MAKE) --no-print-directory -k -j2 -O test-bridge-tiers test-loopback-tiers

test-bridge-tiers: setup
	$(MAKE) --no-print-directory -k test-lab test-netns

test-loopback-tiers: setup
	$(MAKE) --no-print-directory -k lint typecheck test-unit test-simulation test-integration

sim: setup
	$(PY) -m tests.simulation.run --seeds $(SEEDS) --start $(START) --jobs $(JOBS) $(SIMFLAGS)

# Fault injection against a cluster in network namespaces (root): SECONDS of
# faults drawn from SEED, a history in out/nemesis/, one line of verdicts at
# the end; exits non-zero if a property fails. NEMESISFLAGS: --kinds K,...,
# --replay DIR/schedule.json, --subnet A.B.C, --dir DIR. DATA_GROUPS=1: one group.
nemesis: setup
	$(PY) -m tests.nemesis.run --seconds $(SECONDS) --seed $(SEED) --data-groups $(DATA_GROUPS) $(NEMESISFLAGS)

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
