# Shoal: `make run` (set-up + build + the main job), `make test` (set-up + build + every test).
BUILD_DIR  ?= build
BUILD_TYPE ?= Release
JOBS       ?= $(shell nproc)
CTEST_JOBS ?= 2
SHOAL      := $(BUILD_DIR)/apps/shoal/shoal

.PHONY: all setup configure build run test bench clean

all: build

setup:
	@bash scripts/setup.sh

$(BUILD_DIR)/build.ninja: | setup
	@cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) >/dev/null

configure: setup $(BUILD_DIR)/build.ninja

build: configure
	@cmake --build $(BUILD_DIR) -j $(JOBS)

# The main job: distributed training of a CNN on the real Fashion-MNIST data.
run: build
	@$(SHOAL) train --model cnn $(RUN_ARGS)

test: build
	@cd $(BUILD_DIR) && ctest --output-on-failure -j $(CTEST_JOBS) $(CTEST_ARGS)

bench: build
	@$(SHOAL) bench allreduce

clean:
	rm -rf $(BUILD_DIR)
