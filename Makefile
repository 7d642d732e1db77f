# The two commands the README promises: `make demo` and `make test`. Both create or refresh
# .venv and install what they need; the CPU torch pin lives in constraints/cpu.txt.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q -c constraints/cpu.txt
TEST_STAMP := $(VENV)/.stamp-test

.PHONY: test lint format clean venv

$(PY):
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "lorp needs Python >= 3.11"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

venv: $(PY)

# Reinstall only when the project's dependency declarations change.
$(TEST_STAMP): $(PY) pyproject.toml constraints/cpu.txt
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	@touch $@

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(VENV)/bin/pytest

format: $(TEST_STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
