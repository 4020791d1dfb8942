# One entry point for humans and CI. `make test` on a fresh machine creates .venv,
# installs the pinned CPU torch and the project, then runs the fast suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
CHECKPOINT ?= checkpoints/shakespeare
# Offline GPT-2 ranks for tests where the team's shared cache exists (users' machines download them).
SHARED_TIKTOKEN := $(abspath ../shared/tiktoken)
ifneq ($(wildcard $(SHARED_TIKTOKEN)),)
export TIKTOKEN_CACHE_DIR ?= $(SHARED_TIKTOKEN)
endif

.PHONY: install test test-cpu-isa test-slow lint serve bench bench-peers gpu-check clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# pinned: an unpinned torch pulls the newest multi-GB CUDA build
	$(PY) -m pip install "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -e ".[dev]"
	# TGI's client for the compatibility tests; --no-deps: its huggingface_hub<1.0 pin conflicts with
	# transformers 5 and it only uses the hub for HF's hosted API (its deps: aiohttp, pydantic, in .[dev])
	$(PY) -m pip install --no-deps "text-generation==0.7.0"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -m "not slow" -q

# The kernel-choice tests (and a server start per --dtype / --quantize) as an AVX2-only CPU runs them, on any x86
# host: oneDNN and ATen capped at AVX2 (model/cpu_support.py). CI runs it after `make test`.
CPU_ISA_TESTS := tests/test_cpu_support.py tests/test_linear.py tests/test_quantize.py tests/test_sizing.py
test-cpu-isa: install
	ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q -m "slow or not slow" $(CPU_ISA_TESTS)
	# the compiled decode attention under the cap, in a fresh inductor cache: its on-disk cache does not key a kernel
	# by the capped ISA (an AVX-512 kernel made before would be reused)
	d=$$(mktemp -d) && TORCHINDUCTOR_CACHE_DIR=$$d ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \
		$(PY) -m pytest -q tests/test_decode_attention.py; rc=$$?; rm -rf $$d; exit $$rc

# Browser test: also needs Debian's chromium (apt-get install -y chromium); skipped with a reason without it.
test-slow: install
	$(PY) -m pip install -q -e ".[browser,conformance,eval]"
	$(PY) -m pytest -m slow -q

# CI's bounded slow tier (.ci/run): the playground in Debian's chromium and three replicas behind Debian's nginx
# (rolling restart, a SIGKILL). Installs both with apt when missing (CI runs as root), so neither is skipped.
.PHONY: test-ci-slow
CI_SLOW_TESTS := tests/test_browser.py tests/test_replicas.py
test-ci-slow: install
	command -v nginx >/dev/null && command -v chromium >/dev/null || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nginx chromium; }
	$(PY) -m pip install -q -e ".[browser]"
	$(PY) -m pytest -m slow -q -rs $(CI_SLOW_TESTS)

lint: install
	$(PY) -m ruff check .
	$(VENV)/bin/hadolint Dockerfile
	$(VENV)/bin/docker-compose -f docker-compose.yml config -q
	$(VENV)/bin/docker-compose -f docker-compose.yml --profile cpu config -q
	$(VENV)/bin/docker-compose -f docker-compose.yml --profile replicas config -q
	$(VENV)/bin/docker-compose -f docker-compose.yml --profile replicas-gpu config -q
	# Kubernetes manifests against the schemas kubernetes-validate ships (offline); strict: unknown fields fail
	$(VENV)/bin/kubernetes-validate --strict --quiet -k 1.33.0 deploy/k8s/*.yaml deploy/k8s/examples/*.yaml

serve: install
	$(PY) -m app --checkpoint $(CHECKPOINT)

bench: install
	$(PY) -m bench.decode
	$(PY) -m bench.train
	$(PY) -m bench.serve
	$(PY) -m bench.stack

# On a CUDA machine, the first-run verification: the CUDA tests, `python -m app` on the GPU with its defaults (graphs
# captured, /generate and /generate_stream), the engine core bf16 with CUDA graphs on and off (tokens compared by a
# tolerance on logprobs), a few steps of training and fine-tuning under bf16 autocast; one JSON report
# (bench/results/gpu-check.json). The first failure ends it with one line (exit 1), as does a missing CUDA.
# Install a CUDA build of torch first.
gpu-check: install
	$(PY) -m bench.gpu_check

# The same machine offline, in its first minutes (no install, no download; the image's python3 and torch):
# scripts/gpu-check.sh, fed by scripts/gpu-carry.sh here (docs/performance.md, "The first GPU run").
# OPTIONS, e.g. make gpu-check-offline OPTIONS="--device cpu" for the dry run.
.PHONY: gpu-check-offline
OPTIONS ?=
gpu-check-offline:
	scripts/gpu-check.sh $(OPTIONS)

# Our server vs vLLM (CPU) and llama.cpp's llama-server, same weights, one client (bench/README.md).
# Sets the peers up under ~/.cache/gpt-serve-bench/peers first (once: ~15 min on 2 cores, builds run under nice).
# Options go in PEERS_ARGS, e.g. make bench-peers PEERS_ARGS="--servers ours,llama-f32 --rounds 1 --new-tokens 16"
PEERS_ARGS ?=
bench-peers: install
	$(PY) -m bench.peers --torch-version $(TORCH_VERSION) $(PEERS_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
