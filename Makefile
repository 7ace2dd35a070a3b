# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv and install
# everything they need. torch is pinned to the local 2.13.0 CPU wheel.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

export OMP_NUM_THREADS := 1
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# LIBERO (MuJoCo) renders offscreen through EGL with Mesa's llvmpipe.
export MUJOCO_GL := egl

.PHONY: all setup test test-all demo bench clean images

all: test

$(STAMP): pyproject.toml Makefile deploy/setup/vulkan.sh deploy/setup/libero.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,maniskill,libero]'
	# System side of the simulators: EGL for LIBERO, Mesa 25 lavapipe (Vulkan) for ManiSkill.
	# Where these cannot be had (no root, no Debian mirror), their tests skip and say why.
	bash deploy/setup/libero.sh || echo "WARNING: LIBERO rendering libraries missing; LIBERO tests will skip"
	bash deploy/setup/vulkan.sh || echo "WARNING: no Vulkan device; ManiSkill tests will skip"
	touch $(STAMP)

setup: $(STAMP)

# The default suite: everything not marked slow, in two processes (pytest-xdist; a module's
# tests stay in one, so module-scoped deployments are shared). Most of a role-process test is
# waiting (leases, heartbeats, restarts), so two run side by side on 2 cores. TEST_WORKERS=0:
# one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS)

# Everything, slow tests included.
test-all: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The compose cluster's images, built without an image registry (deploy/compose/build-images.sh:
# a debootstrap base cached by tag, the role image, a FROM-scratch nats-server image).
images: $(STAMP)
	PYTHON=$(BIN)/python bash deploy/compose/build-images.sh

demo: $(STAMP)
	$(BIN)/python examples/demo.py

clean:
	rm -rf $(VENV) .nexus .pytest_cache
