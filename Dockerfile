# score-worker image: the worker, the submit client and the tiny-model generator, on CPU torch by default.
#   docker build -t score-worker .
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t score-worker:cuda .
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
# The CPU wheel index keeps the image small (the default index would pull a multi-GB CUDA build).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, in its own layer: it is by far the largest dependency and changes least often.
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY models ./models
COPY worker ./worker
RUN pip install .

# An unprivileged user; /models belongs to it so a named volume mounted there is writable
# (Docker copies the directory's ownership into a new volume).
RUN useradd --create-home --uid 10001 scorer \
    && mkdir /models \
    && chown scorer:scorer /models
USER scorer

ENTRYPOINT ["score-worker"]
CMD ["run"]
