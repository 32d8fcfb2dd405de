# syntax=docker/dockerfile:1
# The gateway: Python, the gateway's own dependencies (pyproject.toml) and its code. No torch,
# no SGLang, no engine_patch: those belong to the engine image (docker/engine.Dockerfile).
# The code runs from /app (python -m gateway), so gateway/config/settings.py's REPO_ROOT is /app and
# migrations/ and the default policies/ sit where the code expects them.
FROM python:3.11.14-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /app

# Dependencies first: this layer is reused while only the code changes.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt \
    && ! pip show torch sglang >/dev/null 2>&1

COPY gateway ./gateway
COPY migrations ./migrations
COPY policies ./policies

RUN useradd --system --uid 10001 --no-create-home --home-dir /app isogate \
    && mkdir -p /var/lib/isogate/audit-spool \
    && chown -R isogate /var/lib/isogate
USER 10001

ENV ISOGATE_HOST=0.0.0.0 \
    ISOGATE_PORT=8080 \
    ISOGATE_LOG_JSON=true \
    ISOGATE_AUDIT_SPOOL_DIR=/var/lib/isogate/audit-spool
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]

# `serve` by default; the same image runs `migrate`, `check-pools`, `tenant`, `key`, `audit`.
ENTRYPOINT ["python", "-m", "gateway"]
CMD ["serve"]
