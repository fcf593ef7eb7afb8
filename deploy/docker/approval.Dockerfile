# syntax=docker/dockerfile:1
# The image of the approval service (ztate approval-serve).
# Build from the repository root:
#   docker build -f deploy/docker/approval.Dockerfile -t ztate-approval .
# No key, certificate, keyring or DSN is in the image: they are mounted at run
# time (compose secrets, Kubernetes Secrets). Only the source folders the package
# needs are copied, never the working tree (which may hold .ztate/).

# Reproducible as far as a build can be offline: every Python dependency at the
# exact version of deploy/requirements.lock (a pip constraints file). Pin the base
# image by digest for a fully repeatable build, e.g.
#   FROM python:3.11-slim@sha256:<digest>   (docker buildx imagetools inspect python:3.11-slim)
# (not done here: no registry was reachable to read the digest; see deploy/README.md).
FROM python:3.11-slim AS build
WORKDIR /src
COPY deploy/requirements.lock ./
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
COPY transition_service ./transition_service
COPY approval_service ./approval_service
COPY worker_sdk ./worker_sdk
COPY contract ./contract
COPY ztate_langgraph ./ztate_langgraph
COPY testing ./testing
RUN pip wheel --no-cache-dir --wheel-dir /wheels --constraint requirements.lock ./worker_sdk .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin ztate \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/ztate /var/lib/ztate/checkpoints
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index /wheels/*.whl && rm -rf /wheels
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    ZTATE_HOME=/var/lib/ztate \
    ZTATE_APPROVAL_LISTEN=0.0.0.0:7444
USER 10001:10001
EXPOSE 7444
# mTLS health check with the service's own certificate (see services/cli/health_probe.py);
# the certificate must name localhost, or override with --server-name.
# The image has no curl and the metrics endpoint is opt-in, so this stays an exec of
# `ztate health` (about 0.45 s of CPU each); Kubernetes probes GET /readyz and /livez on
# the metrics port instead (deploy/k8s, docs/operations.md "Health").
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["ztate", "health", "--approval"]
ENTRYPOINT ["ztate", "approval-serve"]
