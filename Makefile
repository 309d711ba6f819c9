# teraio: `make demo` runs the whole chain on the built-in example; `make test` runs every check.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO := demo-out
DEMO_ARGS := --layers 4 --hidden 256 --seq 256 --batch 8 --steps 6

.PHONY: install demo test lint bench clean

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
	$(VENV)/bin/pytest -q

demo: install
	rm -rf $(DEMO)
	$(VENV)/bin/teraio profile examples/train_gpt.py --out $(DEMO)/profile -- $(DEMO_ARGS)
	$(VENV)/bin/teraio inspect $(DEMO)/profile

bench: install
	$(PY) bench/profile_overhead.py

clean:
	rm -rf $(VENV) $(DEMO) .pytest_cache .mypy_cache .ruff_cache
