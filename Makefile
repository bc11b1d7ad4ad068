# Gradient Lab. Every target sets itself up: the first one you run builds .venv from the pins.
# `make help` lists the targets.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with notebooks/nbval_sanitize.cfg -p no:cacheprovider
# TEST_WORKERS=2 runs the unit tests in two processes (pytest-xdist), whole files each, the files with slow
# tests first (tests/conftest.py); the default, 0, runs them in this process: on 2 cores two processes
# gained little (779 s against 836 s, benchmarks/results/suite_cost.md), so CI stays sequential.
TEST_WORKERS ?= 0
PARALLEL := -n $(TEST_WORKERS) --dist loadfile
UNIT_TESTS := tests -q --ignore=tests/browser
NB ?=
PREFER ?=
NAME ?= workbook
COURSE ?= course
ASSIGNMENT ?= gradientlab
CHROMIUM := /usr/bin/chromium
# make test-compat: the newest releases pyproject.toml admits (constraints-latest.txt, resolved for 3.12).
# It leaves out the `lock_only` tests (pyproject.toml): papermill runs of the notebooks at small sizes
# (a verdict driven both ways by tests/test_nbNN_*.py, the student editions run top to bottom), whose
# subject is the notebooks' own logic; its nbval runs every notebook at the defaults on the newest
# releases, which is where a release shows. They were half of the stage's unit-test time. The tests of
# repository text and of logic that fakes its stack (the GPU runner's dry run, the torch-range guard) are
# lock_only too.
# The first python3.12 that runs: on PATH, else one that pyenv installed (pyenv's shim fails where 3.12 is
# not the selected version).
COMPAT_PYTHON ?= $(firstword $(foreach candidate,$(shell command -v python3.12) $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),$(shell $(candidate) -c 'print("$(candidate)")' 2>/dev/null)))
COMPAT_VENV := .venv-compat
COMPAT_STAMP := $(COMPAT_VENV)/.installed-stamp
# PIP_CONFIG_FILE=/dev/null: pip reads no configuration file, so a machine-wide pin or cap (a course
# image's constraint file, a local mirror) cannot hold the newest releases back.
COMPAT_PIP := PIP_CONFIG_FILE=/dev/null $(COMPAT_VENV)/bin/python -m pip --isolated
# pip only installs uv (the one tests/test_uv_sync.py uses, tests/test_pins.py checks); uv installs the lock:
# the same packages, several times faster (30 s where pip took 2-3 min, downloads included). Like pip above it
# reads no configuration (--no-config, no UV_* variable) and no [tool.uv] source (--no-sources: PyPI's torch).
COMPAT_UV_REQUIREMENT := uv==0.13.8
COMPAT_UV := env $(foreach variable,$(filter UV_%,$(.VARIABLES)),-u $(variable)) $(COMPAT_VENV)/bin/uv --no-config
# The CUDA build of torch logs "No CUDA runtime is found" on stderr when it finds a CUDA toolkit (CUDA_HOME,
# nvcc on PATH, /usr/local/cuda) on a machine without a GPU; an extra stderr output fails nbval, and no
# sanitiser can remove a whole stream. CUDA_HOME and CUDA_PATH set but empty stop that search (torch then
# compiles no CUDA extension, which no notebook does), so nbval compares the outputs the notebooks wrote.
COMPAT_ENV := CUDA_HOME= CUDA_PATH=
# COMPAT_UNIT=all (the default) runs every unit test that is not lock_only; COMPAT_UNIT=instruments runs only
# INSTRUMENT_TESTS, the tests of the code that reaches into torch (its private APIs through _torch_compat, hooks,
# saved tensors, fake tensors, timers): what a newer torch changes first. CI runs the second on every landing; the
# first runs whole when the newest-release lock changes (make compat-verified; docs/MAINTAINERS.md, "CI").
COMPAT_UNIT ?= all
INSTRUMENT_TESTS := tests/test_torch_compat.py tests/test_tracers.py tests/test_memory.py tests/test_probes.py
COMPAT_UNIT_TESTS = $(if $(filter all,$(COMPAT_UNIT)),$(UNIT_TESTS),$(if $(filter instruments,$(COMPAT_UNIT)),$(INSTRUMENT_TESTS) -q,$(error COMPAT_UNIT=$(COMPAT_UNIT): use all or instruments)))

.DEFAULT_GOAL := help
.PHONY: help setup hooks lab lab-student notebooks workbook site test test-unit test-notebooks test-compat compat-verified test-colab test-uv test-browser test-gpu lint api student course workshop workshop-proxy workshop-learners workshop-password bench repro clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  make %-15s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "make setup installs constraints.txt, the lock resolved for Python 3.11, and found Python " + sys.version.split()[0] + ": install Python 3.11 or pass PYTHON=/path/to/python3.11 (README, Install)"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --constraint constraints.txt --editable '.[dev]'
	@touch $(STAMP)

setup: $(STAMP) hooks ## create .venv with the pinned packages and install the git hooks (idempotent)

# pre-commit install only writes .git/hooks/pre-commit (no download). Outside a git checkout, or where
# git refuses (core.hooksPath set), setup goes on without the hooks.
hooks: $(STAMP) ## install the git hooks of .pre-commit-config.yaml (skipped outside a git checkout)
	@if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then \
		$(VENV)/bin/pre-commit install >/dev/null 2>&1 && echo "git hooks installed: see .pre-commit-config.yaml" \
		|| echo "git hooks not installed: run $(VENV)/bin/pre-commit install to see why"; \
	fi

lab: $(STAMP) ## open the workbook with its solutions (notebooks/) in JupyterLab
	$(VENV)/bin/jupyter lab notebooks/00_start_here.ipynb

# A learner's start: the student edition, written first when there is none (make student never
# overwrites a notebook that holds a learner's answers).
# A learner's JupyterLab without nbgrader's instructor tools (its menu, Validate, Create Assignment), which the
# dev extras install: LEARNER_LAB_CONFIG is one more Jupyter config folder, whose labconfig disables them.
LEARNER_LAB_CONFIG := $(CURDIR)/labkit/data/learner_lab
lab-student: $(STAMP) ## open the student edition (student/, no solutions) in JupyterLab; writes it first if missing
	@test -f student/00_start_here.ipynb || $(MAKE) --no-print-directory student
	JUPYTER_CONFIG_PATH="$(LEARNER_LAB_CONFIG)$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH}" $(VENV)/bin/jupyter lab student/00_start_here.ipynb

# The course website from the stored outputs (nothing executes), warnings as errors; site/build.py.
site: $(STAMP) ## build the course website into site/_build/html (Sphinx, from the stored outputs, offline)
	$(PY) site/build.py

notebooks: $(STAMP) ## re-execute notebooks in place and sync their py/ twins (NB=05 for one; PREFER=py|ipynb)
	$(PY) -m labkit execute $(NB) $(if $(PREFER),--prefer $(PREFER))

workbook: $(STAMP) ## run every notebook with papermill into runs/$(NAME)/ and write summary.md/.html
	$(PY) -m labkit workbook $(NB) --out runs/$(NAME)

test: $(STAMP) ## lint, unit tests, nbval over every notebook, then the workbook in a real browser (what CI runs)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest $(UNIT_TESTS) $(PARALLEL)
	$(PY) -m pytest notebooks -q $(NBVAL)
	$(MAKE) --no-print-directory test-browser

test-unit: $(STAMP) ## only the unit tests
	$(PY) -m pytest $(UNIT_TESTS) $(PARALLEL)

# Not in make test (minutes, and a venv of its own): the issue-40 acceptance, benchmarks/results/colab_install.md.
test-colab: $(STAMP) ## a Colab-like venv (torch, numpy, pandas imported first): 00's first cell installs labkit beside them, then 00 runs
	LABKIT_COLAB_TEST=1 $(PY) -m pytest tests/test_install.py -q -s -p no:cacheprovider -m colab_like

# In CI after make test (.ci/run): a copy of the checkout, uv sync from pyproject's [tool.uv], the lock checked in
# the environment it made, then `uv run pytest tests/test_install.py` there; a minute with uv's cache cold (docs/INSTALL.md, uv).
test-uv: $(STAMP) ## uv sync then uv run pytest tests/test_install.py in a copy of the checkout: uv gives the lock
	LABKIT_UV_TEST=1 $(PY) -m pytest tests/test_uv_sync.py -q -s -p no:cacheprovider -m uv_sync

test-browser: $(STAMP) ## JupyterLab in headless Chromium: Run All, move a slider (installs Debian's chromium as root)
	@test -x $(CHROMIUM) || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || echo "Debian's chromium is missing and cannot be installed here: the browser tests skip (LABKIT_REQUIRE_BROWSER=1 makes that a failure)"
	$(PY) -m pytest tests/browser -q

test-notebooks: $(STAMP) ## only nbval over the notebooks (NB=05 for one)
	$(PY) -m pytest $(if $(NB),notebooks/$(NB)*.ipynb,notebooks) -q $(NBVAL)

$(COMPAT_STAMP): pyproject.toml constraints-latest.txt
	@test -n "$(COMPAT_PYTHON)" && $(COMPAT_PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null \
		|| { echo "make test-compat needs Python 3.12 (constraints-latest.txt is resolved for it) and found none at COMPAT_PYTHON='$(COMPAT_PYTHON)': install Python 3.12 (pyenv install 3.12, apt install python3.12, brew install python@3.12) or pass COMPAT_PYTHON=/path/to/python3.12"; exit 2; }
	rm -rf $(COMPAT_VENV)
	$(COMPAT_PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PIP) install --quiet $(COMPAT_UV_REQUIREMENT)
	$(COMPAT_UV) pip install --quiet --no-sources --python $(COMPAT_VENV)/bin/python --constraint constraints-latest.txt --editable '.[dev]'
	@touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP) ## unit tests and nbval on the newest releases (Python 3.12, constraints-latest.txt, ~3 GB; COMPAT_UNIT=instruments: the instruments' tests only)
	$(COMPAT_ENV) $(COMPAT_VENV)/bin/python -m pytest $(COMPAT_UNIT_TESTS) $(PARALLEL) -m "not lock_only"
	$(COMPAT_ENV) $(COMPAT_VENV)/bin/python -m pytest $(if $(NB),notebooks/$(NB)*.ipynb,notebooks) -q $(NBVAL)

compat-verified: ## after changing constraints-latest.txt: make test-compat whole, then record in .ci/compat-verified the lock it passed on
	$(MAKE) test-compat COMPAT_UNIT=all
	@{ echo "# make compat-verified wrote this: make test-compat passed whole on this constraints-latest.txt (tests/test_pins.py checks it)"; \
		sha256sum constraints-latest.txt; } > .ci/compat-verified
	@echo "recorded in .ci/compat-verified: commit it with constraints-latest.txt"

test-gpu: ## GPU-marked tests, nbval over the notebooks and the probe benchmark on a CUDA machine (skips with the reason elsewhere)
	bash .ci/gpu-runner

lint: $(STAMP) ## ruff over the Python outside notebooks/ (rules in pyproject.toml)
	$(VENV)/bin/ruff check .

api: $(STAMP) ## regenerate docs/API.md, the list of labkit's public API
	$(PY) docs/make_api.py --write

student: $(STAMP) ## write the student edition into student/ (solutions removed, outputs cleared)
	$(PY) -m labkit student notebooks student

course: $(STAMP) ## lay out an nbgrader course in $(COURSE)/ (NB="00 02 05" ASSIGNMENT=ps1; refuses handed-in work)
	$(PY) -m labkit course create $(NB) --assignment $(ASSIGNMENT) --dest $(COURSE)

# The workshop's JupyterHub (workshop/jupyterhub_config.py, docs/COURSE.md "Workshop on a JupyterHub"). Its proxy is
# the npm package configurable-http-proxy, installed from workshop/proxy/'s lock into that folder only.
PROXY := workshop/proxy/node_modules/.bin/configurable-http-proxy
WORKSHOP_PORT ?= 8000

$(PROXY): workshop/proxy/package.json workshop/proxy/package-lock.json
	@command -v npm >/dev/null || { echo "the workshop hub needs npm for its proxy (configurable-http-proxy): install Node.js 20 or newer with npm (apt-get install npm), then rerun"; exit 2; }
	npm ci --prefix workshop/proxy --no-audit --no-fund
	@touch $(PROXY)

workshop-proxy: $(PROXY) ## install the hub's proxy (configurable-http-proxy, locked in workshop/proxy/) with npm

workshop: $(STAMP) $(PROXY) ## as root: start the room's JupyterHub on 127.0.0.1:$(WORKSHOP_PORT) for the course in $(COURSE)/ (Ctrl-C stops it all)
	@test -d $(COURSE)/release || { echo "no course in $(COURSE)/: run make course NB=\"00 02 05\" ASSIGNMENT=ps1 first"; exit 2; }
	GRADIENTLAB_COURSE=$(abspath $(COURSE)) GRADIENTLAB_HUB_PORT=$(WORKSHOP_PORT) $(VENV)/bin/jupyterhub -f workshop/jupyterhub_config.py

workshop-learners: $(STAMP) ## as root: add the room's learners, an account and a password each (LEARNERS="ada bo"; prints the passwords)
	@test -n "$(LEARNERS)" || { echo 'usage: sudo make workshop-learners LEARNERS="ada bo"'; exit 2; }
	$(PY) -m labkit course learners $(LEARNERS)

workshop-password: $(STAMP) ## as root: set a learner's hub password (LEARNER=ada; NEW=1 makes a random one)
	@test -n "$(LEARNER)" || { echo 'usage: sudo make workshop-password LEARNER=ada [NEW=1]'; exit 2; }
	$(PY) -m labkit course password $(LEARNER) $(if $(NEW),--new)

# The bench extra (tensorboard, for tracer_overhead.py's TensorBoard recipe) is not in dev: only make bench
# installs it, from the same lock.
BENCH_STAMP := $(VENV)/.bench-stamp

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --constraint constraints.txt --editable '.[bench]'
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP) ## run the benchmarks in benchmarks/ (ratios measured in one run; installs the bench extra)
	@for script in benchmarks/*.py; do echo "== $$script"; $(PY) $$script || exit 1; done

repro: $(STAMP) ## rerun one notebook: make repro NB=00_start_here P="-p seed 3 -p steps 50"
	@test -n "$(NB)" || { echo 'usage: make repro NB=notebook P="-p name value ..."'; exit 2; }
	$(PY) -m labkit repro $(NB) $(P)

clean: ## remove .venv, runs/, student/ and caches (never course/: it holds the gradebook)
	rm -rf $(VENV) $(COMPAT_VENV) runs student .pytest_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
