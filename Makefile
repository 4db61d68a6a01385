# Two commands on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0

.PHONY: install demo test test-fast bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test,plot]'  # plot: the suite also draws fullshard plan's chart
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/fullshard train --nproc 2 --steps 300 --sample 200

test: install
	$(PY) -m pytest -q tests

# The inner loop: everything but the tests marked slow (CI runs `make test`, all of them).
test-fast: install
	$(PY) -m pytest -q -m "not slow" tests

bench: install
	$(PY) benchmarks/bench.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
