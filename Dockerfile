# Stagehand Workbench: the API/dashboard and the training worker in one image (CUDA torch).
# The base image's torch is the one pyproject's range admits and the GPU checks ran on
# (torch 2.11 with CUDA 13.0, docs/perf-gpu.md); CUDA 13.0 needs an NVIDIA driver >= 580. For
# an older driver, build on the CUDA 12.8 image of the same torch:
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime .
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    STAGEHAND_WORKBENCH_DATA=/data

# The package is built from what it is made of and installed like a wheel (not editable): the
# two import packages (runtime/stagehand, backend/workbench), and the presets and the dashboard
# that backend/workbench/presets and backend/workbench/frontend link to (../../presets,
# ../../frontend), so both folders are copied beside backend/. The sources are removed after
# the install: the server and its workers import the installed package only.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY backend ./backend
COPY presets ./presets
COPY frontend ./frontend
# torch comes from the base image; pyproject's range keeps it.
RUN pip install --upgrade pip && pip install . && rm -rf /src

WORKDIR /app
VOLUME ["/data", "/models"]
EXPOSE 8000
# The token is required because the server binds 0.0.0.0 in the container.
CMD ["workbench", "serve", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/data", "--no-browser"]
