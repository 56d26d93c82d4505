#!/usr/bin/env bash
# Build dfca's two images and push them to a registry, then print the `images:` block of a site overlay
# (k8s-config/site-example) that makes the manifests pull them:
#   REGISTRY/dfca:TAG        CPU torch: topology, metrics, aggregator, CPU workers
#   REGISTRY/dfca-cuda:TAG   CUDA torch (TORCH_CUDA_VARIANT, default cu130; cu126 for drivers older than R580)
# Usage: scripts/build_images.sh REGISTRY [TAG]        (or: make images REGISTRY=... [TAG=...])
#   REGISTRY            e.g. registry.example.com/team, 123456789012.dkr.ecr.eu-west-1.amazonaws.com,
#                       europe-west4-docker.pkg.dev/PROJECT/REPO; "local" builds without pushing
#   TAG                 default: the project's version (pyproject.toml)
# Environment: DOCKER (default docker; podman works), PLATFORM (default linux/amd64), TORCH_CUDA_VARIANT,
# PUSH=0 to build only. Log in to the registry first (docker login / gcloud auth configure-docker / aws ecr ...).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0" >&2; exit 2; }
REGISTRY="${1%/}"
TAG="${2:-$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)}"
DOCKER="${DOCKER:-docker}"
PLATFORM="${PLATFORM:-linux/amd64}"
CUDA_VARIANT="${TORCH_CUDA_VARIANT:-cu130}"
PUSH="${PUSH:-1}"
[ -n "$TAG" ] || { echo "build_images: no TAG given and none found in pyproject.toml" >&2; exit 2; }
case "$CUDA_VARIANT" in cu1[0-9][0-9]) ;; *) echo "TORCH_CUDA_VARIANT must look like cu126 or cu130" >&2; exit 2 ;; esac
if [ "$REGISTRY" = local ]; then prefix=""; PUSH=0; else prefix="$REGISTRY/"; fi
cpu="${prefix}dfca:$TAG"
cuda="${prefix}dfca-cuda:$TAG"
run() { printf '+ %s\n' "$*" >&2; "$@"; }
run "$DOCKER" build --platform "$PLATFORM" --build-arg TORCH_VARIANT=cpu -t "$cpu" .
run "$DOCKER" build --platform "$PLATFORM" --build-arg TORCH_VARIANT="$CUDA_VARIANT" -t "$cuda" .
if [ "$PUSH" = 1 ]; then
  run "$DOCKER" push "$cpu"
  run "$DOCKER" push "$cuda"
fi
cat <<BLOCK
# the images: block of your site overlay (k8s-config/site-example/kustomization.yaml):
images:
  - name: dfca
    newName: ${prefix}dfca
    newTag: "$TAG"
  - name: dfca-cuda
    newName: ${prefix}dfca-cuda
    newTag: "$TAG"
BLOCK
