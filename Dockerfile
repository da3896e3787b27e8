# score-worker image: the worker, its lag exporter, the sample producer, the submit client and the tiny-model
# generator, on CPU torch by default.
#   docker build -t score-worker:local .
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t score-worker:cuda .
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
# The CPU wheel index keeps the image small (the default index would pull a multi-GB CUDA build).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# The versions the suite was run with (./dev.sh lock writes them); pyproject.toml keeps the ranges.
COPY constraints.txt ./
# torch first, in its own layer: it is by far the largest dependency and changes least often.
# The torch index is an extra one: its build (2.13.0+cpu) ranks above PyPI's 2.13.0, and the pinned
# dependencies come from PyPI.
RUN pip install -c constraints.txt --extra-index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"

# LICENSE is named by pyproject's license-files, so the build needs it.
COPY pyproject.toml README.md LICENSE ./
COPY schemas ./schemas
COPY models ./models
COPY worker ./worker
RUN pip install -c constraints.txt ".[worker]"

# An unprivileged user. /models/generated belongs to it so that a named volume mounted there is writable
# (Docker copies the directory's ownership into a new volume); /models/real is where a host directory with
# a real model is bind-mounted, read-only, beside it rather than inside the volume.
RUN useradd --create-home --uid 10001 scorer \
    && mkdir -p /models/generated /models/real \
    && chown -R scorer:scorer /models
USER scorer

# 9464: the worker's /metrics, /healthz and /readyz; 9465: the lag exporter's.
EXPOSE 9464 9465

# Liveness of `score-worker run`: /healthz answers while its event loop does (readiness is /readyz).
# Other commands of this image (lag-exporter, produce-samples) get their own checks in docker-compose.yml.
# A worker whose metrics port is 0 serves no HTTP at all, so there is nothing to ask.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD test "${SCORE_WORKER_METRICS_PORT:-9464}" = 0 \
        || python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:${SCORE_WORKER_METRICS_PORT:-9464}/healthz', timeout=4)"

ENTRYPOINT ["score-worker"]
CMD ["run"]
