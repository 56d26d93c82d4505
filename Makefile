# make images REGISTRY=registry.example.com/team [TAG=0.1.0] [TORCH_CUDA_VARIANT=cu126]: build and push
# dfca and dfca-cuda (scripts/build_images.sh), printing the images: block of a site overlay.
REGISTRY ?=
TAG ?=

.PHONY: images
images:
	@test -n "$(REGISTRY)" || { echo "make images REGISTRY=registry.example.com/team [TAG=...]" >&2; exit 2; }
	bash scripts/build_images.sh "$(REGISTRY)" $(TAG)
