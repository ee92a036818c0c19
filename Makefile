# `make demo` and `make test` are the two commands the README opens with.
#
# Test selection: tests marked `slow` (multi-process or long) are skipped by `make test`
# unless they are also marked `ci` (the lean subset CI runs); `make test-all` runs all.
PYTHON ?= python3
PYTEST ?= $(PYTHON) -m pytest
# Crash isolation: the tests run in a pytest-xdist worker process, so a native crash
# (a segfault or SIGFPE inside torch or gloo) fails the one test it hit, by name, and a
# fresh worker runs the rest; the summary is still printed. TEST_WORKERS=2 runs two.
# The deadline plugin (tests/_deadline.py) makes the run always finish:
# pytest-timeout (pyproject's `timeout`) stays the inner limit; a test still running
# HARD_TIMEOUT seconds after its start (stuck in C, signals blocked, worker wedged) has
# every thread's stack dumped and its worker's whole process tree killed by the xdist
# controller, and fails as "crashed" with those stacks. Processes a test leaves behind
# (orphaned ranks included) are killed at its teardown.
TEST_WORKERS ?= 1
HARD_TIMEOUT ?= 600
ISOLATE ?= -p xdist -n $(TEST_WORKERS) -p tests._deadline --hard-timeout $(HARD_TIMEOUT)

.PHONY: setup demo test test-all notebooks docs docs-serve quickstart

setup:
	bash scripts/setup.sh

demo: setup
	$(PYTHON) examples/train_gpt.py

quickstart: setup
	$(PYTHON) examples/quickstart.py

test: setup
	$(PYTEST) -q $(ISOLATE) -m "not slow or ci"

test-all: setup
	$(PYTEST) -q $(ISOLATE)

# Every notebook under examples/notebooks, top to bottom, with nbclient (not saved back).
notebooks: setup
	$(PYTHON) -m jupyter execute --timeout=600 examples/notebooks/*.ipynb

docs: setup
	$(PYTHON) -m mkdocs build --strict

docs-serve: setup
	$(PYTHON) -m mkdocs serve
