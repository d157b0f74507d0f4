# e4kv quick start. `make demo` and `make test` work on a fresh Debian machine (they install the
# packages they need first). Variables: BUILD (build dir), CUDA_ARCHS (";"-separated), JOBS.
BUILD ?= build
JOBS ?= $(shell nproc)
# The quick-start build compiles CUDA for 75 (software E4M3 path) and 90 only; a plain CMake build
# defaults to 75;80;86;89;90.
CUDA_ARCHS ?= 75;90
# -O2 without debug information: the quick-start build is for running and testing (CI compiles
# everything twice on 2 cores, and -g costs a third of the compile time); for a debugger, pass
# BUILD_TYPE=RelWithDebInfo.
BUILD_TYPE ?= Release
RELEASE_FLAGS = -O2 -DNDEBUG
CMAKE_ARGS ?=

NVCC := $(shell command -v nvcc 2>/dev/null || ( [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc ))
ifneq ($(NVCC),)
  export CUDACXX ?= $(NVCC)
endif

.PHONY: all setup configure build demo test test-cpu test-sanitize fuzz fuzz-smoke format clean

all: build

setup:
	@scripts/setup.sh

$(BUILD)/build.ninja: CMakeLists.txt
	cmake -S . -B $(BUILD) -G Ninja -DE4KV_WERROR=ON "-DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCHS)" \
	  -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) "-DCMAKE_CXX_FLAGS_RELEASE=$(RELEASE_FLAGS)" $(CMAKE_ARGS)

configure: setup $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# The main job on the embedded default (see README.md): only the program it runs is built (the
# test targets take most of a full build's time).
demo: configure
	cmake --build $(BUILD) -j $(JOBS) --target e4kv
	@scripts/demo.sh $(BUILD)

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)
	$(MAKE) --no-print-directory fuzz-smoke

# The CPU library, the CLI and every CPU test under AddressSanitizer + UndefinedBehaviorSanitizer
# (-DE4KV_SANITIZE=ON: -fno-sanitize-recover=all, so the first report fails the test), CUDA and
# benchmarks off, in a build directory of its own. -O1 -g1 (line tables, enough for file:line in a
# report) compiles in half the time of -O2 -g, which is most of this target's time on 2 cores. A
# sanitizer report in an e4kv process that a CLI test runs aborts it (abort_on_error), and
# tests/testing/cli.h fails the test on the report.
SANITIZE_BUILD ?= $(BUILD)-sanitize
SANITIZER_ENV = ASAN_OPTIONS=detect_leaks=1:check_initialization_order=1:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:abort_on_error=1
test-sanitize: setup
	cmake -S . -B $(SANITIZE_BUILD) -G Ninja -DE4KV_WERROR=ON -DE4KV_SANITIZE=ON \
	  -DE4KV_ENABLE_CUDA=OFF -DE4KV_BUILD_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG"
	cmake --build $(SANITIZE_BUILD) -j $(JOBS)
	$(SANITIZER_ENV) ctest --test-dir $(SANITIZE_BUILD) --output-on-failure -j $(JOBS) -LE quality

# The fuzzers (clang + libFuzzer + ASan/UBSan): a bounded run, FUZZ_SECONDS split between the
# safetensors header target, the config.json target and the other JSON readers.
FUZZ_SECONDS ?= 40
fuzz-smoke: setup
	cmake -S fuzz -B $(BUILD)-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build $(BUILD)-fuzz -j $(JOBS)
	fuzz/run.sh $(BUILD)-fuzz $(FUZZ_SECONDS)

fuzz: FUZZ_SECONDS = 600
fuzz: fuzz-smoke

format:
	git ls-files '*.h' '*.cpp' '*.cu' '*.cuh' | xargs clang-format -i

clean:
	rm -rf $(BUILD) $(BUILD)-fuzz $(SANITIZE_BUILD)
