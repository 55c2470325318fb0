# syntax=docker/dockerfile:1
# Two images from one file; the build context is the repository root and .dockerignore lets in
# only what the stages below COPY.
#
#   docker build -t llm-extproc .                        # the sidecar (last stage, the default)
#   docker build --target sim -t llm-extproc-sim .       # the vLLM simulator (compose `cpu`)
#
# Checked without a Docker daemon by tests/deploy/test_docker.py (stages, entrypoints, the health
# check command run against a real sidecar, the context building a wheel); see docs/deploy.md.

ARG PYTHON_IMAGE=python:3.12-slim

# --- runtime: the package with its dependencies, and a non-root user -------------------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
# pyproject.toml names README.md as the readme, so the build needs it.
COPY pyproject.toml README.md requirements.lock ./
COPY extproc ./extproc
# A regular install: the code, the embedded default policy and the generated policy stubs go
# to site-packages, so the source tree is not needed at run time. The dependencies at the
# versions the tests ran on: the lock (make lock) as constraints, kept for the sim stage.
RUN pip install -c requirements.lock . \
 && mkdir -p /opt/llm-extproc && mv requirements.lock /opt/llm-extproc/ && rm -rf /src
# A fixed numeric uid, so Kubernetes' runAsNonRoot can check it without /etc/passwd.
RUN groupadd --system --gid 10001 llm \
 && useradd --system --uid 10001 --gid llm --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin llm
WORKDIR /app
USER 10001:10001

# --- sim: bench/sim/, a vLLM stand-in for running the stack without a GPU ----------------------
FROM runtime AS sim
USER root
# Only what the simulator imports beyond the sidecar's dependencies (prometheus-client): the
# `bench` extra, aiohttp. Same requirement as the extra in pyproject.toml
# (tests/deploy/test_docker.py compares them).
RUN pip install -c /opt/llm-extproc/requirements.lock "aiohttp>=3.9"
COPY bench/__init__.py ./bench/
COPY bench/sim ./bench/sim
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["python", "-m", "bench.sim"]
CMD ["--host", "0.0.0.0", "--port", "8000"]

# --- sidecar: `llm-extproc serve` (the default target) ----------------------------------------
FROM runtime AS sidecar
# gRPC (ext_proc and grpc.health.v1) and Prometheus /metrics.
EXPOSE 50051 9464
# The gRPC health service is what Envoy's traffic depends on: SERVING once the server is up,
# NOT_SERVING while it drains on SIGTERM. LLM_EXTPROC_HEALTH_ADDR only matters if you move
# --listen off port 50051.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; ch = grpc.insecure_channel(os.environ.get('LLM_EXTPROC_HEALTH_ADDR', '127.0.0.1:50051')); r = g.HealthStub(ch).Check(h.HealthCheckRequest(), timeout=3); sys.exit(0 if r.status == h.HealthCheckResponse.SERVING else 1)"]
ENTRYPOINT ["llm-extproc", "serve"]
# The CLI's defaults listen on 127.0.0.1, which nothing outside the container can reach.
# Anything given to `docker run IMAGE ...` (or compose `command:`) replaces these args whole.
CMD ["--listen", "0.0.0.0:50051", "--metrics", "0.0.0.0:9464"]
