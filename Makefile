# Two commands on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0

# `make check-torch`: the oldest and newest supported torch (pyproject's range), each
# in its own venv outside the repo (CUDA builds, about 6 GB each, that run on CPU),
# on the tests that cover the engine, both front ends, the NCCL path and checkpoints.
TORCH_VENVS    ?= $(HOME)/.cache/fullshard/torch-venvs
TORCH_VERSIONS ?= 2.8.0 2.14.1
CHECK_TORCH_TESTS ?= tests/test_fake_pg.py tests/test_fully_shard_training.py tests/test_wrapper.py \
	tests/test_state_dict_model.py tests/test_checkpoint.py tests/test_grad_scaler.py tests/test_compile.py \
	tests/test_torch_surface.py tests/test_fully_shard_comm_settings.py

.PHONY: install demo test test-fast test-exhaustive test-launch test-libraries test-system lint bench clean check-torch

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q $(TORCH)
	# plot: the suite also draws fullshard plan's chart; libraries: Lightning, accelerate, peft (tests/test_lib_*.py), torchao
	$(PY) -m pip install -q -e '.[test,plot,lint,libraries]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/fullshard train --nproc 2 --steps 300 --sample 200

# Every test but the exhaustive ones, the launches and the heavy libraries' (the tiers: tests/conftest.py).
test: install
	$(PY) -m pytest -q -m "not exhaustive and not libraries and not launch" tests

# What `make test` leaves out: the rest of the cross products and the whole conformance matrix, each
# with a sibling in `make test` that takes its path. CI runs it after `make test` (.ci/run).
test-exhaustive: install
	$(PY) -m pytest -q -m "exhaustive and not libraries and not launch" tests

# The inner loop: `make test` but the tests marked slow (tests/conftest.py lists them with the sibling
# that keeps their path here; also those that replace a rank pool or start fresh processes).
# Files whose every test is slow and whose imports (Lightning, peft, transformers) cost seconds: not collected.
INNER_LOOP_SKIPS := $(addprefix --ignore=tests/,test_lib_lightning.py test_lib_peft.py test_lib_accelerate.py test_hf_models.py)
test-fast: install
	$(PY) -m pytest -q -m "not slow and not libraries and not launch" $(INNER_LOOP_SKIPS) tests

# The tests that start the fullshard command or a benchmark script as a user does, in fresh processes
# that each import torch: torchrun, elastic restarts after a killed rank or machine, Ctrl-C, faults,
# closed pipes, the GPU script's dry run. CI runs them after `make test` (.ci/run).
test-launch: install
	$(PY) -m pytest -q -m "launch and not libraries" tests

# torchtitan's parallelize_llama over fullshard: torchtitan imports triton (about 1 GB), so it is
# installed only here (measured: triton 24 s from a local wheel, the test 46 s, on a loaded 2-core machine).
$(VENV)/.installed-torchtitan: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[torchtitan]'
	touch $@

test-libraries: $(VENV)/.installed-torchtitan
	$(PY) -m pytest -q tests/test_lib_*.py

# The suite on a Python that already has torch, pytest and tqdm (a GPU image's own torch, a machine
# with no registry): no venv, no download. `make test-system SYSTEM_PYTHON=/path/to/python`.
SYSTEM_PYTHON ?= python3
test-system:
	PYTHONPATH=$(CURDIR) $(SYSTEM_PYTHON) -m pytest -q tests

$(TORCH_VENVS)/torch-%/.installed: pyproject.toml
	$(PYTHON) -m venv $(@D)
	$(@D)/bin/python -m pip install -q --upgrade pip
	$(@D)/bin/python -m pip install -q torch==$*
	$(@D)/bin/python -m pip install -q -e '.[test]'
	touch $@

# Left out on torch 2.8 only: it has no Tensor.grad_dtype (keep_low_precision_grads raises
# NotImplementedError there), and its own FSDP2, the oracle of the bf16 test, differs from the exact
# emulation on the embedding gradient (fullshard matches the emulation on 2.8 too).
CHECK_TORCH_DESELECT_2.8.0 := --deselect tests/test_wrapper.py::test_keep_low_precision_grads_and_buffer_dtype \
	--deselect tests/test_fully_shard_training.py::test_parity_mixed_precision

check-torch: $(addprefix check-torch-,$(TORCH_VERSIONS))

# Kept between runs (make would delete it as an intermediate file and reinstall next time).
.PRECIOUS: $(TORCH_VENVS)/torch-%/.installed

check-torch-%: $(TORCH_VENVS)/torch-%/.installed
	PYTHONPATH=$(CURDIR) $(TORCH_VENVS)/torch-$*/bin/python -m pytest -q $(CHECK_TORCH_TESTS) $(CHECK_TORCH_DESELECT_$*)

# ruff (lint, import order, format) and mypy on the package; .ci/run runs it before the tests.
lint: install
	$(VENV)/bin/ruff check fullshard
	$(VENV)/bin/ruff format --check fullshard
	$(VENV)/bin/mypy

bench: install
	$(PY) benchmarks/bench.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
