# The two commands of the README. Both install what is missing first.
BUILD      ?= build
ASAN_BUILD ?= build-asan
VENV       ?= .venv
JOBS       ?= $(shell nproc)
# moekit_tests as this many ctest entries (CMakeLists.txt, MOEKIT_TEST_SHARDS); 0: one a test.
TEST_SHARDS ?= 8
# Ninja where it is (install-deps installs it). Chosen when a recipe runs, after deps, not when make
# reads this file (on a fresh machine that was before ninja existed); a build directory configured
# already keeps its generator, which CMake would refuse to change.
cmake_gen = $$(test -f $(1)/CMakeCache.txt || { command -v ninja >/dev/null && echo "-G Ninja"; })
# ccache where it is (install-deps installs it), as CMake's compiler launcher for C++ and CUDA: the
# package's build in `make python` then compiles nothing that `make build` compiled already (the
# same flags; the CUDA kernels alone are ~20 minutes on 2 cores), and a rebuild from a fresh clone
# compiles only what changed. Given as CMake's environment default, which a build directory
# configured already does not take: there, its own setting stays.
ccache_env = $$(command -v ccache >/dev/null && \
  echo "CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_CUDA_COMPILER_LAUNCHER=ccache")
# Paths under the checkout hashed as relative ones (to the compiler's working directory, the build
# directory): a clone elsewhere (CI's) hits the same cache, and so does the package's build
# (build-python, at build/'s depth: pyproject.toml).
export CCACHE_BASEDIR := $(CURDIR)
# The package's build takes $(BUILD)'s C++ compiler where that is configured: scikit-build-core
# would take Python's (g++ where CMake took c++, the same compiler by another name, which ccache
# tells apart).
python_cxx = $$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=/CXX=/p' $(BUILD)/CMakeCache.txt 2>/dev/null)

.PHONY: run test deps build test-cpp python test-python pip-from-archive sanitize format \
        format-check clean

run: build
	$(BUILD)/moekit bench layer --preset qwen3-30b-a3b --tokens 4096
	@echo
	@echo "Next: README.md 'Reading the benchmark'; every preset: $(BUILD)/moekit bench layer --preset all;"
	@echo "one op: $(BUILD)/moekit bench ragged_dot|router|permute --help; recorded runs: bench/results/"

test: build test-cpp test-python

deps:
	@scripts/install-deps

build: deps
	env $(ccache_env) cmake -S . -B $(BUILD) $(call cmake_gen,$(BUILD)) -DCMAKE_BUILD_TYPE=Release \
	  -DMOEKIT_TEST_SHARDS=$(TEST_SHARDS)
	cmake --build $(BUILD) -j $(JOBS)

test-cpp:
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)

# The Python package in $(VENV), built against the jax installed there (pyproject.toml).
python: deps
	scripts/python-env $(VENV)
	env $(ccache_env) $(python_cxx) $(VENV)/bin/pip install -q --no-build-isolation .

# The GPU tests of the other ops skip without a GPU; their comparisons also run CPU against CPU
# (MOEKIT_GPU_TEST_ON_CPU=1), which checks the tests' own code and traces every CUDA branch.
# Over $(JOBS) processes (pytest-xdist): the suite is mostly JAX's compiles, one core each.
test-python: python
	$(VENV)/bin/python -m pytest -q -n $(JOBS) tests/python
	MOEKIT_GPU_TEST_ON_CPU=1 $(VENV)/bin/python -m pytest -q tests/python/test_ops_gpu.py

# What a new JAX user does, away from this checkout's .deps/, build dirs and .venv/: `pip install .`
# from a `git archive` of HEAD into a fresh virtual environment, then a smoke test (CI runs it).
pip-from-archive: deps
	tests/install/pip_from_archive

# The C++ tests under AddressSanitizer and UndefinedBehaviorSanitizer (a build of its own).
sanitize: deps
	env $(ccache_env) cmake -S . -B $(ASAN_BUILD) $(call cmake_gen,$(ASAN_BUILD)) \
	  -DCMAKE_BUILD_TYPE=Debug -DMOEKIT_SANITIZE=ON -DMOEKIT_CUDA=OFF -DMOEKIT_TEST_SHARDS=$(TEST_SHARDS)
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --test-dir $(ASAN_BUILD) --output-on-failure -j $(JOBS)

FORMAT_FILES = $(shell git ls-files '*.h' '*.cpp' '*.cu' '*.cuh')
format:
	clang-format -i $(FORMAT_FILES)
format-check:
	clang-format --dry-run --Werror $(FORMAT_FILES)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) build-python
