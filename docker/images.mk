# Container image targets (included from the top-level Makefile: `include docker/images.mk`).
#
#   make image-v100 | image-a40         docker build of one family's image, tagged by docker/tags.py
#   make sif-v100   | sif-a40           Apptainer .sif from that Docker image (local daemon)
#   make image-tags                     print every family's tag
#   make locks                          re-resolve requirements/{cpu,v100,a40}.lock from their .in files and the
#                                       feature map (PyPI), derive trl19-cpu.lock (docker/lockgen.py)
#   make image-check                    what the tests check without Docker: hadolint + build scripts' test mode
#
# IMAGE=registry/ogrpo overrides the image name; DOCKER_BUILD_ARGS adds `docker build` options
# (e.g. --build-arg MAX_JOBS=8 for a builder with more memory: ~5 GB per nvcc thread).

IMAGE ?= ogrpo
DOCKER ?= docker
APPTAINER ?= apptainer
IMAGES_PYTHON ?= python3
DOCKER_BUILD_ARGS ?=
IMAGE_FAMILIES := v100 a40

image_ref = $(shell $(IMAGES_PYTHON) docker/tags.py ref $(1) --image $(IMAGE))
image_tag = $(shell $(IMAGES_PYTHON) docker/tags.py tag $(1))

.PHONY: $(addprefix image-,$(IMAGE_FAMILIES)) $(addprefix sif-,$(IMAGE_FAMILIES)) image-tags locks image-check

$(addprefix image-,$(IMAGE_FAMILIES)): image-%:
	DOCKER_BUILDKIT=1 $(DOCKER) build -f docker/Dockerfile.$* -t $(call image_ref,$*) \
	  --label org.opencontainers.image.version=$(call image_tag,$*) $(DOCKER_BUILD_ARGS) .

$(addprefix sif-,$(IMAGE_FAMILIES)): sif-%: image-%
	$(APPTAINER) build --force --build-arg IMAGE=$(call image_ref,$*) \
	  ogrpo-$(call image_tag,$*).sif docker/apptainer/ogrpo.def

image-tags:
	@for f in $(IMAGE_FAMILIES); do $(IMAGES_PYTHON) docker/tags.py ref $$f --image $(IMAGE); done

locks:
	$(IMAGES_PYTHON) docker/lockgen.py cpu $(IMAGE_FAMILIES) trl19-cpu

image-check:
	hadolint $(addprefix docker/Dockerfile.,$(IMAGE_FAMILIES))
	@for f in $(IMAGE_FAMILIES); do \
	  env $$($(IMAGES_PYTHON) docker/tags.py env $$f | tr '\n' ' ') docker/scripts/build-wheels.sh --check $$f requirements/$$f.lock /tmp/ogrpo-wheels-$$f || exit 1; \
	done
