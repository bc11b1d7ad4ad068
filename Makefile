# Gradient Lab. Every target sets itself up: the first one you run builds .venv from the pins.
# `make help` lists the targets.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with notebooks/nbval_sanitize.cfg -p no:cacheprovider
NB ?=
PREFER ?=
NAME ?= workbook
CHROMIUM := /usr/bin/chromium

.DEFAULT_GOAL := help
.PHONY: help setup hooks lab notebooks workbook test test-unit test-notebooks test-browser test-gpu lint api student bench repro clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  make %-15s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "Gradient Lab needs Python 3.11, found " + sys.version.split()[0]'
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

lab: $(STAMP) ## open the workbook in JupyterLab
	$(VENV)/bin/jupyter lab notebooks/00_start_here.ipynb

notebooks: $(STAMP) ## re-execute notebooks in place and sync their py/ twins (NB=05 for one; PREFER=py|ipynb)
	$(PY) -m labkit execute $(NB) $(if $(PREFER),--prefer $(PREFER))

workbook: $(STAMP) ## run every notebook with papermill into runs/$(NAME)/ and write summary.md/.html
	$(PY) -m labkit workbook $(NB) --out runs/$(NAME)

test: $(STAMP) ## lint, unit tests, nbval over every notebook, then the workbook in a real browser (what CI runs)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest tests -q --ignore=tests/browser
	$(PY) -m pytest notebooks -q $(NBVAL)
	$(MAKE) --no-print-directory test-browser

test-unit: $(STAMP) ## only the unit tests
	$(PY) -m pytest tests -q --ignore=tests/browser

test-browser: $(STAMP) ## JupyterLab in headless Chromium: Run All, move a slider (installs Debian's chromium as root)
	@test -x $(CHROMIUM) || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || echo "Debian's chromium is missing and cannot be installed here: the browser tests skip (LABKIT_REQUIRE_BROWSER=1 makes that a failure)"
	$(PY) -m pytest tests/browser -q

test-notebooks: $(STAMP) ## only nbval over the notebooks (NB=05 for one)
	$(PY) -m pytest $(if $(NB),notebooks/$(NB)*.ipynb,notebooks) -q $(NBVAL)

test-gpu: ## GPU-marked tests, nbval over the notebooks and the probe benchmark on a CUDA machine (skips with the reason elsewhere)
	bash .ci/gpu-runner

lint: $(STAMP) ## ruff over the Python outside notebooks/ (rules in pyproject.toml)
	$(VENV)/bin/ruff check .

api: $(STAMP) ## regenerate docs/API.md, the list of labkit's public API
	$(PY) docs/make_api.py --write

student: $(STAMP) ## write the student edition into student/ (solutions removed, outputs cleared)
	$(PY) -m labkit student notebooks student

bench: $(STAMP) ## run the benchmarks in benchmarks/ (ratios measured in one run)
	@for script in benchmarks/*.py; do echo "== $$script"; $(PY) $$script || exit 1; done

repro: $(STAMP) ## rerun one notebook: make repro NB=00_start_here P="-p seed 3 -p steps 50"
	@test -n "$(NB)" || { echo 'usage: make repro NB=notebook P="-p name value ..."'; exit 2; }
	$(PY) -m labkit repro $(NB) $(P)

clean: ## remove .venv, runs/, student/ and caches
	rm -rf $(VENV) runs student .pytest_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
