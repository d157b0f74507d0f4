# e4kv quick start. `make demo` and `make test` work on a fresh Debian machine (they install the
# packages they need first). Variables: BUILD (build dir), CUDA_ARCHS (";"-separated), JOBS.
BUILD ?= build
JOBS ?= $(shell nproc)
# The quick-start build compiles CUDA for 75 (software E4M3 path) and 90 only; a plain CMake build
# defaults to 75;80;86;89;90.
CUDA_ARCHS ?= 75;90
CMAKE_ARGS ?=

NVCC := $(shell command -v nvcc 2>/dev/null || ( [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc ))
ifneq ($(NVCC),)
  export CUDACXX ?= $(NVCC)
endif

.PHONY: all setup configure build demo test test-cpu fuzz fuzz-smoke format clean

all: build

setup:
	@scripts/setup.sh

$(BUILD)/build.ninja: CMakeLists.txt
	cmake -S . -B $(BUILD) -G Ninja -DE4KV_WERROR=ON "-DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCHS)" $(CMAKE_ARGS)

configure: setup $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# The main job on the embedded default (see README.md).
demo: build
	@scripts/demo.sh $(BUILD)

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)
	$(MAKE) --no-print-directory fuzz-smoke

# The safetensors header fuzzer (clang + libFuzzer + ASan/UBSan): a bounded run.
FUZZ_SECONDS ?= 20
fuzz-smoke: setup
	cmake -S fuzz -B $(BUILD)-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build $(BUILD)-fuzz -j $(JOBS)
	fuzz/run.sh $(BUILD)-fuzz $(FUZZ_SECONDS)

fuzz: FUZZ_SECONDS = 600
fuzz: fuzz-smoke

format:
	git ls-files '*.h' '*.cpp' '*.cu' '*.cuh' | xargs clang-format -i

clean:
	rm -rf $(BUILD) $(BUILD)-fuzz
