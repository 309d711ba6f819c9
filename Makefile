# teraio: `make demo` runs the whole chain on the built-in example; `make test` runs every check.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO := demo-out
DEMO_ARGS := --layers 4 --hidden 256 --seq 256 --batch 8 --steps 6

.PHONY: install demo test lint bench gpu-check clean

install: $(STAMP)

# torch first, pinned, so that pip takes the local CPU build instead of a multi-GB CUDA one.
# editable_mode=compat puts the repo root on sys.path, so our `profiles` package wins over a
# user's ./profiles/ output directory (a namespace package) when run as `python -m teraio`.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet --config-settings editable_mode=compat -e '.[dev]'
	touch $(STAMP)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: lint
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -n 2 --dist worksteal

# Profile, plan at half the profiled peak, run; then peak memory, time and losses side by side.
demo: install
	$(PY) bench/demo.py --out $(DEMO) -- $(DEMO_ARGS)

# Each benchmark's figures go to BENCHMARKS.md with the command that made them.
bench: install
	$(PY) bench/profile_overhead.py
	$(PY) bench/run_overhead.py
	$(PY) bench/run_overhead.py -- --layers 2 --hidden 1024 --heads 16 --seq 512 --batch 8
	$(PY) bench/plan_scale.py
	$(PY) bench/fake_scale.py
	$(PY) bench/policies.py
	$(PY) bench/rok.py --plot bench-out/rok.png
	$(PY) bench/rok_gpu.py --plot bench-out/rok-gpu.png
	$(PY) bench/fidelity.py
	$(PY) bench/compile.py
	$(PY) bench/jobs.py
	$(PY) bench/on_demand.py

# On a lent GPU machine, with its own torch and nothing installed: the predictions with the host's
# waits and with --stream-copies side by side (about 5 minutes), the curve against checkpointing with
# --stream-copies (about 2), then the tests that run on CUDA (4 or more): more than one call of 10
# minutes, so the measurements come first (BENCHMARKS.md, the H200 sections).
gpu-check:
	PYTHONPATH=$(CURDIR) $(PYTHON) bench/fidelity.py --gpu --sizes 2k --steps 6 --quiet-budget 0 --stream-copies
	PYTHONPATH=$(CURDIR) $(PYTHON) bench/rok_gpu.py --sizes 2k --peers recompute --steps 6 --stream-copies
	PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest -q -n 8 -p no:cacheprovider tests/torch_patch tests/runtime tests/profiles \
		tests/cli/test_run_cli.py tests/cli/test_profile_cli.py

clean:
	rm -rf $(VENV) $(DEMO) bench-out .pytest_cache .mypy_cache .ruff_cache
