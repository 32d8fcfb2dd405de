# syntax=docker/dockerfile:1
# An SGLang worker (prefill or decode) on NVIDIA GPUs, with isogate's engine_patch plugin.
#
#   - SGLang 0.5.23, its normal CUDA install: it pins torch 2.14.1 and CUDA 13 kernels
#     (flashinfer-python[cu13], sglang-kernel), hence the CUDA 13 base image.
#   - Mooncake's CUDA wheel for that CUDA: mooncake-transfer-engine-cuda13. The plain
#     mooncake-transfer-engine wheel links libcudart.so.12, which a CUDA 13 image lacks.
#   - This repository installed (not editable, no deps) only so that its distribution
#     metadata registers the `sglang.srt.plugins` entry point `isogate = engine_patch:register`.
#   - NEVER engine/cpu (isogate-engine-cpu): its sgl_kernel stand-in would shadow the real
#     CUDA kernels. .dockerignore keeps it out of the build context altogether.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# python3-dev: Triton and FlashInfer compile kernels at run time. libibverbs1, rdma-core and
# ibverbs-providers: Mooncake's RDMA transport (and its library loads only with libibverbs).
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev build-essential \
        libibverbs1 ibverbs-providers rdma-core libnuma1 \
        curl ca-certificates \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir sglang==0.5.23 mooncake-transfer-engine-cuda13==0.3.14

WORKDIR /opt/isogate
COPY pyproject.toml README.md ./
COPY engine_patch ./engine_patch
# Check the image, not just the install: the production plugin is registered, the CPU shim is
# absent, and the SGLang version is the one engine_patch's compatibility check expects.
RUN pip install --no-cache-dir --no-deps . \
    && python - <<'PY'
from importlib.metadata import PackageNotFoundError, distribution, entry_points, version

plugins = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
assert plugins.get("isogate") == "engine_patch:register", plugins
assert "isogate_cpu" not in plugins, "the CPU-only shim must never be in the GPU image"
try:
    distribution("isogate-engine-cpu")
except PackageNotFoundError:
    pass
else:
    raise SystemExit("isogate-engine-cpu is installed in the GPU image")
assert version("sglang") == "0.5.23", version("sglang")
print("engine image: sglang", version("sglang"), "plugins", sorted(plugins))
PY

COPY docker/engine-entrypoint.sh /usr/local/bin/isogate-engine
RUN chmod 0755 /usr/local/bin/isogate-engine

ENV MOONCAKE_PROTOCOL=rdma \
    SGLANG_PORT=30000 \
    SGLANG_BOOTSTRAP_PORT=8998
EXPOSE 30000 8998
HEALTHCHECK --interval=10s --timeout=5s --start-period=600s --retries=3 \
    CMD ["sh", "-c", "curl -fsS http://127.0.0.1:${SGLANG_PORT}/health >/dev/null"]

ENTRYPOINT ["/usr/local/bin/isogate-engine"]
