# perfsleuth: `make demo` and `make test` each do all set-up themselves on a fresh machine.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint format bench bench-ingest bench-accuracy bench-findings bench-evidence bench-capture bench-ui bench-instructions clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(BIN)/perfsleuth demo

test: setup
	$(BIN)/pytest -q

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

format: setup
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

bench: setup
	$(BIN)/python benchmarks/overhead.py

bench-ingest: setup
	$(BIN)/python benchmarks/ingest.py

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

clean:
	rm -rf $(VENV) .perfsleuth .perfsleuth-demo build dist src/*.egg-info
