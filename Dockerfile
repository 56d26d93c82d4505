# syntax=docker/dockerfile:1
# One image for every dfca service; the command picks the service:
#   docker run dfca:0.1.0 topology | metrics | worker | aggregator
# Both images, built and pushed to a registry: make images REGISTRY=registry.example.com/team TAG=0.1.0
# CPU build (default):  docker build -t dfca:0.1.0 .
# CUDA build:           docker build --build-arg TORCH_VARIANT=cu130 -t dfca-cuda:0.1.0 .
# TORCH_VARIANT names a PyTorch wheel index (cpu, cu126, cu128, cu130, ...); pick one that
# publishes torch ${TORCH_VERSION}. CUDA wheels bring their own CUDA runtime, so the same slim base
# runs on GPU nodes; the node brings the driver. Pick the CUDA build by the GPU nodes' driver:
# cu130 needs an R580 driver or newer, cu126 runs on R525 and later (most managed pools' default).

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/dfca/bin:$PATH
RUN python -m venv /opt/dfca
# torch first, from the variant's index: the project's `torch>=2.3` is then already satisfied and
# pip never pulls the (much larger) CUDA build from PyPI into a CPU image.
RUN pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared/ shared/
COPY services/ services/
RUN pip install . && dfca --help >/dev/null

FROM ${PYTHON_IMAGE} AS runtime
ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.title="dfca" \
      org.opencontainers.image.description="Decentralized clustered federated learning services" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.dfca.torch-variant="${TORCH_VARIANT}"
# The NVIDIA driver's libraries: the NVIDIA Container Toolkit (Docker, EKS, the GPU Operator) puts them on
# the loader's path itself; GKE mounts them at /usr/local/nvidia instead, where pip's torch finds them only
# through LD_LIBRARY_PATH. NVIDIA_* tell the toolkit what the container needs. Harmless in the CPU image.
ENV PATH=/opt/dfca/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    DFCA_HOST=0.0.0.0 \
    DFCA_CHECKPOINT_DIR=/var/lib/dfca/checkpoints \
    DFCA_DATA_DIR=/var/lib/dfca/data \
    LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/nvidia/lib \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
# A fixed non-root uid/gid (10001) that the Kubernetes securityContext and fsGroup name too.
# Every folder a deployment mounts exists in the image and belongs to dfca, so fresh Docker named volumes
# mounted there inherit that ownership (a service refuses a state folder it cannot write).
RUN groupadd --system --gid 10001 dfca \
 && useradd --system --uid 10001 --gid dfca --home-dir /home/dfca --create-home \
      --shell /usr/sbin/nologin dfca \
 && mkdir -p /var/lib/dfca/checkpoints /var/lib/dfca/state /var/lib/dfca/metrics /var/lib/dfca/data \
 && chown -R dfca:dfca /var/lib/dfca
COPY --from=build /opt/dfca /opt/dfca
USER 10001:10001
WORKDIR /home/dfca
# topology, metrics, worker health, aggregator
EXPOSE 8080 8081 8082 8083
ENTRYPOINT ["dfca"]
CMD ["--help"]
