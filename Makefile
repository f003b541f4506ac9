# Two commands on a fresh machine, each doing its own set-up:
#   make demo   -- a GPT-style model trains on real text, params + optimizer on NVMe, and prints losses + memory
#   make test   -- the test suite, then its parity tests again on ATen's portable kernels (what .ci/run calls)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-all test-slow test-parity-default test-torch211 bench bench-setup clean

setup: $(VENV)/.zinf-setup

# torch is pinned: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 resolves to the CPU build here.
# transformers/accelerate: the Hugging Face Trainer test; lightning: the Lightning Trainer test.
# google-crc32c: the swap engine's hardware checksum.
$(VENV)/.zinf-setup: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0 triton==3.9.0 numpy pytest matplotlib transformers==5.24.0 accelerate==1.15.0 lightning==2.6.6 tqdm safetensors==0.8.0 google-crc32c==1.9.0
	$(BIN)/pip install -q --no-deps -e .
	touch $@

# The peers of benchmarks/compare.py; not part of setup or test (CI does not install them). Idempotent:
# libaio-dev only when missing (DeepSpeed's NVMe offload builds its async_io op against it), DeepSpeed
# pinned and installed with --no-deps --no-build-isolation so it can never pull a CUDA torch, its light
# dependencies by name, then its CPU ops built once (JIT, g++ + ninja) into .venv/torch_extensions
# (not the per-user cache that other checkouts share) so that no benchmark row pays the build.
DEEPSPEED := deepspeed==0.19.8
bench-setup: $(VENV)/.zinf-bench-setup

$(VENV)/.zinf-bench-setup: $(VENV)/.zinf-setup
	@if ! dpkg -s libaio-dev >/dev/null 2>&1; then apt-get update && apt-get install -y libaio-dev; fi
	$(BIN)/pip install -q einops hjson msgpack ninja 'packaging>=20.0' psutil py-cpuinfo 'pydantic>=2.0.0'
	$(BIN)/pip install -q --no-deps --no-build-isolation $(DEEPSPEED)
	DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(abspath $(VENV))/torch_extensions PATH=$(abspath $(BIN)):$$PATH \
		$(BIN)/python benchmarks/_ds_ops.py
	touch $@

demo: setup
	$(BIN)/python examples/train_gpt.py

PYTEST := $(BIN)/python -m pytest -p no:cacheprovider -rfEs --durations=30

# Both runs always run; the target fails if either failed. The second run repeats the parity tests
# (marked `parity`) with ATEN_CPU_CAPABILITY=default: other kernels, other rounding, same verdicts.
# It gets a fresh Inductor cache of its own, so no kernel compiled for the first run's ISA is reused.
test: setup
	@status=0; \
	$(MAKE) --no-print-directory test-all || status=1; \
	$(MAKE) --no-print-directory test-parity-default || status=1; \
	if [ $$status -ne 0 ]; then echo "make test: FAILED (see the summaries above)"; fi; \
	exit $$status

test-all: setup
	$(PYTEST) -m "not slow"

# The tests marked `slow` (multi-process variants of features the main run covers at least once):
# not in CI's 30 minutes on 2 cores, so run them before a release or a stop.
test-slow: setup
	$(PYTEST) -m slow

test-parity-default: setup
	@cache=$$(mktemp -d -t zinf-inductor-default.XXXXXX); \
	echo "== parity tests again: ATEN_CPU_CAPABILITY=default TORCHINDUCTOR_CACHE_DIR=$$cache"; \
	ATEN_CPU_CAPABILITY=default TORCHINDUCTOR_CACHE_DIR=$$cache $(PYTEST) -m "parity and not slow" tests; \
	status=$$?; rm -rf "$$cache"; exit $$status

# The suite under the oldest torch we support, the lent GPU's: torch 2.11 + Triton 3.6. Not in CI (its
# only wheel on PyPI is the CUDA build, about 5 GB with its libraries, which also runs on the CPU). It
# found three incompatibilities the 2.13 suite could not (Adagrad's state, TORCH_LOGS, the interpreter's fma).
VENV211 := .venv-torch211
$(VENV211)/.zinf-setup: pyproject.toml Makefile
	$(PY) -m venv $(VENV211)
	$(VENV211)/bin/pip install -q torch==2.11.0 triton==3.6.0 numpy pytest matplotlib transformers==5.24.0 accelerate==1.15.0 lightning==2.6.6 tqdm safetensors==0.8.0 google-crc32c==1.9.0
	$(VENV211)/bin/pip install -q --no-deps -e .
	touch $@

test-torch211: $(VENV211)/.zinf-setup
	@cache=$$(mktemp -d -t zinf-inductor-211.XXXXXX); \
	TORCHINDUCTOR_CACHE_DIR=$$cache $(VENV211)/bin/python -m pytest -p no:cacheprovider -rfEs -m "not slow"; \
	status=$$?; rm -rf "$$cache"; exit $$status

clean:
	rm -rf $(VENV) $(VENV211) *.egg-info
