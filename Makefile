# ztate: the two commands a fresh machine needs are `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PROTOS := $(wildcard proto/ztate/v1/*.proto)

.PHONY: run test test-unit test-citus dist proto proto-check lint typecheck-tree deploy-check bench clean demo

# the C extensions (services/*/_*.c) are built by the install: a changed one reinstalls
$(STAMP): pyproject.toml worker_sdk/pyproject.toml $(wildcard services/*/_*.c)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e './worker_sdk[langgraph]' -e '.[dev]'
	touch $(STAMP)

## run: start the control plane (dev certificates, keys and an embedded Postgres on first run)
run: $(STAMP)
	$(VENV)/bin/ztate run

## test: the whole test suite on real Postgres, real gRPC and real certificates, one pytest
## worker per core (at most 4), each with its own embedded Postgres and services; a file's
## tests stay on one worker (its module fixtures are set up once, its tests run in order)
TEST_WORKERS ?= auto
test: $(STAMP)
	$(PY) -m pytest --numprocesses=$(TEST_WORKERS) --maxprocesses=4 --dist=loadfile

## test-unit: the lane that needs no database (seconds): pure functions, vectors, configs
test-unit: $(STAMP)
	$(PY) -m pytest -m unit -q

## test-citus: the Citus lane: a coordinator and two workers started here (needs Citus:
## ../shared/citus/install.sh), the conformance suite, replicas, approvals, watches on it
test-citus: $(STAMP)
	$(PY) -m pytest -m citus

## dist: the wheels: ztate (the control plane) and ztate-worker (what a worker installs)
dist: $(STAMP)
	$(PY) -m pip wheel --quiet --no-deps -w dist ./worker_sdk .

## proto: regenerate the Python code from proto/ (never edit *_pb2*.py by hand), and the
## descriptor set with the protos' comments that server reflection serves
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I proto --python_out=proto --pyi_out=proto \
		--grpc_python_out=proto $(PROTOS)
	$(PY) -m grpc_tools.protoc -I proto --include_imports --include_source_info \
		-o proto/ztate/v1/descriptors.binpb $(PROTOS)

## proto-check: fail if the generated code is stale
proto-check: $(STAMP)
	@tmp=$$(mktemp -d) && \
	$(PY) -m grpc_tools.protoc -I proto --python_out=$$tmp --pyi_out=$$tmp \
		--grpc_python_out=$$tmp $(PROTOS) && \
	$(PY) -m grpc_tools.protoc -I proto --include_imports --include_source_info \
		-o $$tmp/ztate/v1/descriptors.binpb $(PROTOS) && \
	diff -r -x '__init__.py' -x '__pycache__' -x '*.proto' $$tmp/ztate/v1 proto/ztate/v1 \
		|| { echo "generated code is stale: run 'make proto' and commit"; rm -rf $$tmp; exit 1; }; \
	rm -rf $$tmp

## lint: ruff, mypy, import-linter (the layering of docs/architecture.md) and buf lint
lint: $(STAMP) typecheck-tree
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	cd proto && ../$(VENV)/bin/buf lint

# The folders as they install (ztate.services is services/, ...), for mypy, which cannot follow
# the build's package-dir mapping.
typecheck-tree:
	@mkdir -p .typecheck/ztate
	@for p in contract services transition_service approval_service worker_sdk testing; do \
		ln -sfn ../../$$p .typecheck/ztate/$$p; done
	@ln -sfn ../../ztate_langgraph .typecheck/ztate/langgraph

## deploy-check: lint the Dockerfiles, validate compose and the Kubernetes manifests (offline;
## images are not built here). secrets.yaml holds templates and is validated too.
K8S_MANIFESTS := $(filter-out deploy/k8s/kustomization.yaml,$(wildcard deploy/k8s/*.yaml))
deploy-check: $(STAMP)
	$(VENV)/bin/hadolint deploy/docker/transition.Dockerfile deploy/docker/approval.Dockerfile
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.compose-spec deploy/compose.yaml
	$(VENV)/bin/kubernetes-validate --strict --quiet $(K8S_MANIFESTS)

## demo: the four-node pipeline as separate processes, an injection refused, an approval
## verified; the ledger is kept in .ztate/demo to explore afterwards
demo: $(STAMP)
	$(PY) examples/demo/run.py --home .ztate/demo

## bench: the benchmarks (not part of the test suite; installs the LangGraph comparison)
bench: $(STAMP)
	$(PY) -m pip install --quiet -e './worker_sdk[langgraph]' -e '.[dev,bench]'
	$(PY) -m bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .typecheck
