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

# On a lent GPU machine, with its own torch and nothing installed: the tests that run on CUDA (2
# minutes on an H200 with -n 16; -v names each failure as it happens, so a call's limit that cuts
# the summary off loses no name), then the predictions (about 4) and the curve against
# checkpointing (about 2): two calls of 10 minutes (BENCHMARKS.md, the H200 sections).
gpu-check:
	OMP_NUM_THREADS=1 PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest -v -rfE --tb=short -n 16 -p no:cacheprovider tests/torch_patch tests/runtime tests/profiles \
		tests/cli/test_run_cli.py tests/cli/test_profile_cli.py
	PYTHONPATH=$(CURDIR) $(PYTHON) bench/fidelity.py --gpu --sizes 2k --steps 6 --quiet-budget 0
	PYTHONPATH=$(CURDIR) $(PYTHON) bench/rok_gpu.py --sizes 2k --peers recompute --steps 6

clean:
	rm -rf $(VENV) $(DEMO) bench-out .pytest_cache .mypy_cache .ruff_cache
