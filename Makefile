# scalelab: `make hub` and `make test` set everything up themselves, then do their job (README.md says more).
#
# The set-up is four idempotent steps, tools/ensure_*.sh: each checks first and acts only when needed, so a
# second `make test` spends a few seconds on checks before pytest starts. `make help` lists every target.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV ?= .venv
PYTHON ?= python3
SCALELAB_CONSTRAINTS ?= constraints/cpu.txt
PYTEST_ARGS ?=
# Test processes side by side (pytest-xdist); tests that share a cluster, a hub or the labs' one grading keep to one
# worker each (tests/conftest.py: xdist_group_of). 0 runs everything in one process, in file order.
PYTEST_WORKERS ?= 2
HUB_ARGS ?=
DOCTOR_ARGS ?=
export VENV PYTHON SCALELAB_CONSTRAINTS

PY := $(VENV)/bin/python
# What tests, hub and benchmarks run with: the venv's bin first on PATH, as if activated, so that
# configurable-http-proxy, horovodrun and scalelab are found there (by JupyterHub and the launchers too).
IN_VENV := PATH="$(abspath $(VENV))/bin:$$PATH" VIRTUAL_ENV="$(abspath $(VENV))"
# --durations: every run (CI included) ends with its slowest tests, then the time per test file (tests/conftest.py),
# where the suite's time goes
PYTEST_CMD := $(IN_VENV) $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS) --durations=30
# make test-quick: what an edit-test loop needs (units and the engine), no labs, clusters, hubs or browser
QUICK_MARKS := not slow and not slurm and not netns and not hub and not browser

# $(call phase,TITLE,COMMAND): COMMAND between two banners; the closing one says ok/FAILED and how long it took.
define phase
@t0=$$(date +%s%N); echo "==> $(1)"; \
$(2); rc=$$?; ms=$$(( ($$(date +%s%N) - t0) / 1000000 )); \
if [ $$rc -eq 0 ]; then s=ok; else s="FAILED (exit $$rc)"; fi; \
printf '<== %s: %s in %d.%ds\n' "$(1)" "$$s" $$((ms / 1000)) $$((ms % 1000 / 100)); exit $$rc
endef

.PHONY: help setup venv test test-quick hub bench site doctor clean

help: ## this list
	@echo "scalelab: 'make hub' and 'make test' set everything up first (Debian packages as root, .venv, proxy, Horovod)"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'
	@echo "variables: VENV=$(VENV) PYTHON=$(PYTHON) SCALELAB_CONSTRAINTS=$(SCALELAB_CONSTRAINTS)"
	@echo "           PYTEST_ARGS='...' PYTEST_WORKERS=2 (make test)  HUB_ARGS='...' (make hub)  DOCTOR_ARGS=--json (make doctor)"

setup: ## set everything up; only checks what is already done
	$(call phase,setup 1/4: Debian packages,bash tools/ensure_debian.sh)
	$(call phase,setup 2/4: Python venv $(VENV),bash tools/ensure_venv.sh)
	$(call phase,setup 3/4: configurable-http-proxy,bash tools/ensure_chp.sh)
	$(call phase,setup 4/4: Horovod,bash tools/ensure_horovod.sh)

venv: ## only the Python venv step of the set-up
	$(call phase,setup: Python venv $(VENV),bash tools/ensure_venv.sh)

test: setup ## set up, then run every test, PYTEST_WORKERS side by side (PYTEST_ARGS='tests/test_x.py -k y')
	$(call phase,tests: pytest,$(PYTEST_CMD) || (rc=$$?; [ $$rc -ne 5 ] || echo "make test: pytest collected no tests (exit 5); that is a failure: check PYTEST_ARGS" >&2; exit $$rc))

test-quick: setup ## units and the engine only, side by side (no labs, clusters, hubs or browser; a few minutes)
	$(call phase,tests: pytest (quick),$(PYTEST_CMD) -m "$(QUICK_MARKS)")

hub: setup ## set up, then start JupyterHub with the course (HUB_ARGS='...' goes to `scalelab hub`)
	@echo "==> hub: $(VENV)/bin/scalelab hub $(HUB_ARGS)"
	$(IN_VENV) $(VENV)/bin/scalelab hub $(HUB_ARGS)

bench: setup ## set up, then run every bench/bench_*.py; each writes JSON to bench/results/
	@mkdir -p bench/results; shopt -s nullglob; files=(bench/bench_*.py); \
	[ $${#files[@]} -gt 0 ] || { echo "make bench: no bench/bench_*.py found" >&2; exit 1; }; \
	failed=(); for f in "$${files[@]}"; do \
	  echo "==> bench: $$f"; t0=$$(date +%s); \
	  $(IN_VENV) $(PY) "$$f" || failed+=("$$f"); \
	  echo "<== bench: $$f in $$(( $$(date +%s) - t0 ))s"; \
	done; \
	[ $${#failed[@]} -eq 0 ] || { echo "make bench: failed: $${failed[*]}" >&2; exit 1; }; \
	echo "make bench: results in bench/results/"

site: setup ## set up, then build the course website (scalelab site build)
	$(call phase,site: scalelab site build,$(IN_VENV) $(VENV)/bin/scalelab site build)

doctor: venv ## say what this machine has and how to fix what is missing (DOCTOR_ARGS=--json)
	@$(IN_VENV) $(VENV)/bin/scalelab doctor $(DOCTOR_ARGS)

clean: ## remove the venv and its set-up stamps (the Horovod wheel cache in ~/.cache/scalelab stays)
	@if [ -e "$(VENV)" ] && [ ! -f "$(VENV)/pyvenv.cfg" ]; then \
	  echo "make clean: $(VENV) is not a venv (no pyvenv.cfg); not removing it" >&2; exit 1; fi
	rm -rf "$(VENV)"
