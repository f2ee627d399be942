# Set-up commands (see README):  make quickstart   |   make test
# MCORE=X (a megatron-core release, e.g. 0.19.2): use a separate venv .venv-mcore-X holding exactly that release.
MCORE ?=
ifeq ($(strip $(MCORE)),)
VENV ?= .venv
else
VENV ?= .venv-mcore-$(MCORE)
endif
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install quickstart test test-all test-quick test-mcore test-slurm lint clean-runs wheelhouse

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	MCORE=$(MCORE) bash scripts/install.sh $(VENV)

## Preprocess the embedded corpus, train tiny_llama on 2 CPU processes, export to HF, generate.
quickstart: install
	$(PY) scripts/quickstart.py

## The test suite, tier 1: every capability proven at least once (CPU; GPU tests skip without CUDA; Slurm
## tests start a local cluster as root). What CI runs. tests/README.md lists capability -> test -> tier.
test: install
	$(PY) -m pytest $(PYTEST_ARGS)

## Every tier: tier 1 plus the exhaustive matrices (tests marked `full`: world-4 layouts, every reshard pair,
## every family at every layout). Run it before calling a change to one of those areas done.
test-all: install
	TEST_TIER=all $(PY) -m pytest $(PYTEST_ARGS)

## The tests that exercise Megatron-Core (layouts, resume, resharding, distributed optimizer, HF bridge,
## Megatron fixes, cross-version checkpoints, a small MoE/EP subset, validation rules quoting
## Megatron-Core): run on a second release with MCORE=X.
test-mcore: install
	$(PY) -m pytest -m mcore $(PYTEST_ARGS)

## Fast subset: no multi-process or Slurm tests.
test-quick: install
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

## Only the real-Slurm tests (root: installs Debian's slurm packages and starts a local 2-node cluster).
test-slurm: install
	$(PY) -m pytest -m slurm tests/launch -v --durations=0

## Every wheel the project needs beyond torch, for an offline (air-gapped) install: README "Offline install".
##   make wheelhouse PYTHON_VERSION=3.12 PLATFORM=manylinux_2_28_x86_64   (defaults: this machine's)
PYTHON_VERSION ?=
PLATFORM ?=
wheelhouse:
	python3 scripts/wheelhouse.py --dest wheelhouse $(if $(PYTHON_VERSION),--python-version $(PYTHON_VERSION)) \
		$(if $(PLATFORM),--platform $(PLATFORM))

lint: install
	$(PY) -m ruff check .
	shellcheck -x launch/*.sh tests/launch/local_slurm.sh
