# Stagehand Workbench: the API/dashboard and the training worker in one image (CUDA torch).
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    STAGEHAND_WORKBENCH_DATA=/data

WORKDIR /app
COPY pyproject.toml README.md ./
COPY backend ./backend
COPY contract ./contract
COPY runtime ./runtime
COPY worker ./worker
COPY plan ./plan
COPY bench ./bench
COPY presets ./presets
COPY frontend ./frontend
# torch comes from the base image; pyproject's range keeps it.
# Editable: the server finds presets/ and frontend/ beside the backend package.
RUN pip install --upgrade pip && pip install -e .

VOLUME ["/data", "/models"]
EXPOSE 8000
# The token is required because the server binds 0.0.0.0 in the container.
CMD ["workbench", "serve", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/data", "--no-browser"]
