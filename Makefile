# `make demo` and `make test` are the two commands the README opens with.
#
# Test selection: tests marked `slow` (multi-process or long) are skipped by `make test`
# unless they are also marked `ci` (the lean subset CI runs); `make test-all` runs all.
PYTHON ?= python3
PYTEST ?= $(PYTHON) -m pytest

.PHONY: setup demo test test-all docs docs-serve quickstart

setup:
	bash scripts/setup.sh

demo: setup
	$(PYTHON) examples/train_gpt.py

quickstart: setup
	$(PYTHON) examples/quickstart.py

test: setup
	$(PYTEST) -q -m "not slow or ci"

test-all: setup
	$(PYTEST) -q

docs: setup
	$(PYTHON) -m mkdocs build --strict

docs-serve: setup
	$(PYTHON) -m mkdocs serve
