# perfsleuth: `make demo` and `make test` each do all set-up themselves on a fresh machine.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-busy check-wheel lint format bench bench-ingest bench-scale bench-accuracy bench-findings bench-evidence bench-capture bench-ui bench-instructions bench-pressure bench-realworld fuzz clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(BIN)/perfsleuth demo

test: setup
	$(BIN)/pytest -q

# Issue 21's acceptance: the zoo and the async-evidence app on a quiet and on an oversubscribed
# machine (4 busy loops per core), the demo on the oversubscribed one; about 6 minutes on two
# cores, so `make test` leaves it out.
test-busy: setup
	BUSY_ACCEPTANCE=1 $(BIN)/pytest -q tests/test_busy_acceptance.py tests/test_starved_short_requests.py

# The wheel a user installs: built, installed with no extras into a new venv, demo + findings + UI.
check-wheel: setup
	@bash scripts/check_wheel.sh

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/python scripts/check_imports.py --deferred
	$(BIN)/python scripts/openapi_ts.py --check

format: setup
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

bench: setup
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/shipping.py

bench-ingest: setup
	$(BIN)/python benchmarks/ingest.py

bench-scale: setup
	$(BIN)/python benchmarks/scale.py

bench-accuracy: setup
	$(BIN)/python benchmarks/accuracy.py

bench-findings: setup
	$(BIN)/python benchmarks/findings.py

bench-ui: setup
	$(BIN)/python benchmarks/ui.py

bench-evidence: setup
	$(BIN)/python benchmarks/evidence.py

bench-capture: setup
	$(BIN)/python benchmarks/capture_decision.py

bench-instructions: setup
	$(BIN)/python benchmarks/instructions.py

bench-pressure: setup
	$(BIN)/python benchmarks/pressure.py

# The fuzz suites' long mode (make test runs a few hundred cases of each): 100,000
# structure-aware spool records, then 100,000 API requests (25,000 per test; ~40 min).
fuzz: setup
	$(BIN)/python benchmarks/fuzz.py --cases 100000
	PERFSLEUTH_FUZZ_CASES=25000 $(BIN)/pytest -q -p no:cacheprovider tests/test_fuzz_api.py

# Real open-source apps from PyPI at releases with documented performance bugs (long; network).
bench-realworld: setup
	$(BIN)/python benchmarks/realworld/run.py

clean:
	rm -rf $(VENV) .venvs .perfsleuth .perfsleuth-demo build dist src/*.egg-info
