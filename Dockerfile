# GPT text-generation service image (FastAPI + uvicorn, from-scratch PyTorch GPT).
#
#   docker build -t gpt-serve:latest .                               # CUDA build (default)
#   docker build --build-arg TORCH_VARIANT=cpu -t gpt-serve:cpu .    # CPU-only build (much smaller)
#   docker run --rm --gpus all -p 8000:8000 gpt-serve:latest         # serves checkpoints/shakespeare
#
# Build arguments:
#   TORCH_VERSION     torch version to install (default 2.13.0).
#   TORCH_VARIANT     PyTorch wheel index tag: cu128 (default; torch's CUDA 12.8 build, NVIDIA driver
#                     >= 570, and R525+ drivers through CUDA 12's minor-version compatibility), cu130
#                     (CUDA 13.0, driver >= 580), another CUDA tag the PyTorch index publishes for this
#                     version (e.g. cu126), or cpu. On a host whose driver is too old for the build,
#                     the server refuses to start with one line instead of serving on the CPU.
#   TORCH_INDEX_URL   index torch (and its dependencies) is installed from; default
#                     https://download.pytorch.org/whl/${TORCH_VARIANT}. Point it at a mirror if needed.
#   TORCH_FIND_LINKS  optional extra place (URL or directory listing) pip searches for the torch wheel,
#                     e.g. a local HTTP server holding a prebuilt wheel: scripts/docker-smoke.sh serves
#                     a local CPU wheel on 127.0.0.1, builds with --network host and passes
#                     TORCH_VERSION=2.13.0+cpu TORCH_INDEX_URL=https://pypi.org/simple
#                     TORCH_FIND_LINKS=http://127.0.0.1:PORT/ -- no wheel ever lands in the build
#                     context or in a layer.
#
# Only classic Dockerfile syntax is used (no "# syntax=" line, no RUN --mount, no heredocs), so the
# file builds with the legacy builder as well as with BuildKit/buildx.

############################ stage 1: virtualenv with the runtime dependencies ############################
FROM python:3.11-slim AS deps

# (No PYTHONDONTWRITEBYTECODE here: pip's precompiled .pyc files in the venv make every container
# start faster -- the runtime user cannot write bytecode caches into /opt/venv.)
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

SHELL ["/bin/sh", "-eu", "-c"]

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first and on its own layer: it is by far the largest dependency and changes least often.
# (ARGs declared here, not above, so changing them does not invalidate the venv layer.)
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cu128
ARG TORCH_INDEX_URL=
ARG TORCH_FIND_LINKS=
RUN index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/${TORCH_VARIANT}}"; \
    echo "installing torch==${TORCH_VERSION} from ${index}${TORCH_FIND_LINKS:+ (+ find-links ${TORCH_FIND_LINKS})}"; \
    if [ -n "${TORCH_FIND_LINKS}" ]; then export PIP_FIND_LINKS="${TORCH_FIND_LINKS}"; fi; \
    pip install "torch==${TORCH_VERSION}" --index-url "${index}"; \
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# The remaining runtime dependencies (tiktoken, safetensors, numpy, fastapi, uvicorn, pydantic,
# pydantic-settings, prometheus-client, ...) come from pyproject.toml's [project].dependencies, so the
# list lives in one place; torch is already satisfied by the layer above. The build backend from
# [build-system].requires is installed too, so the package itself installs later with
# --no-build-isolation, without network access and without re-fetching the backend on every code change.
WORKDIR /build
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); \
reqs = p['project'].get('dependencies', []) + p.get('build-system', {}).get('requires', ['setuptools>=61', 'wheel']); \
open('requirements.txt', 'w').write('\n'.join(reqs) + '\n')"; \
    cat requirements.txt; \
    pip install -r requirements.txt; \
    python -c "import torch; print('torch still', torch.__version__)"

############################ stage 2: application files ############################
# Collected in a throwaway stage so their permissions can be normalised without duplicating layers:
# files written by the training code may be 0600 (owner root only), and the runtime user must be
# able to read everything. The final stage copies the result with COPY --from (modes preserved).
FROM python:3.11-slim AS src
WORKDIR /src
# README.m[d]: copied when present (pyproject's `readme` points at it), no error when absent.
COPY pyproject.toml README.m[d] ./
COPY model/ ./model/
COPY engine/ ./engine/
COPY app/ ./app/
COPY training/ ./training/
COPY checkpoints/shakespeare/ ./checkpoints/shakespeare/
RUN chmod -R u=rwX,go=rX /src

############################ stage 3: runtime image ############################
FROM python:3.11-slim

# DL3064 is a false positive here: it flags TIKTOKEN_CACHE_DIR for containing "TOKEN" (it is a path).
# hadolint ignore=DL3064
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TIKTOKEN_CACHE_DIR=/cache/tiktoken \
    GPT_COMPILE_CACHE=/cache/compiled \
    GPT_CHECKPOINT=/app/checkpoints/shakespeare

SHELL ["/bin/sh", "-eu", "-c"]

# A C++ compiler at run time: inductor's CPU kernels (GPT_COMPILE=auto|on: the decode step and attention that
# engine/compiled_decode.py and engine/compiled_attention.py build in the background) are C++ compiled in the
# container, so without g++ `auto` stays eager. g++ brings gcc (with OpenMP's omp.h / libgomp) and libc6-dev.
# hadolint ignore=DL3008
RUN apt-get update; \
    apt-get install -y --no-install-recommends g++; \
    rm -rf /var/lib/apt/lists/*

# Unprivileged user; /cache/tiktoken (tokenizer ranks downloaded once), /cache/compiled (the compiled decode
# steps, GPT_COMPILE_CACHE: a new container loads them in seconds instead of compiling for minutes) and
# /checkpoints (mount point for user checkpoints) are owned by it, so fresh named volumes mounted there
# inherit that ownership.
RUN groupadd --system --gid 10001 app; \
    useradd --system --uid 10001 --gid app --home-dir /home/app --create-home --shell /usr/sbin/nologin app; \
    mkdir -p /cache/tiktoken /cache/compiled /checkpoints; \
    chown app:app /cache/tiktoken /cache/compiled /checkpoints

COPY --from=deps /opt/venv /opt/venv

WORKDIR /app
# model/ engine/ app/ training/ pyproject.toml (README.md) and the bundled checkpoints/shakespeare/.
COPY --from=src /src/ ./
# Dependencies are in the venv already: install only the package (metadata, entry points).
# The package's bytecode compiled here: the runtime user cannot write __pycache__ (and PYTHONDONTWRITEBYTECODE), so
# without it every start compiled ~150 modules from source, 0.15-0.5 s of GPT-2's start (docs/performance.md).
RUN pip install --no-deps --no-build-isolation . ; \
    rm -rf build ./*.egg-info; \
    python -m compileall -q model engine app training

# Numeric uid:gid, so runtimes that enforce runAsNonRoot can verify it without /etc/passwd.
USER 10001:10001
VOLUME ["/cache/tiktoken", "/cache/compiled"]
EXPOSE 8000

HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://localhost:8000/health', timeout=4).status == 200 else 1)"]

# Exec-form CMD: python -m app is PID 1 and receives SIGTERM itself (graceful shutdown, drains requests).
STOPSIGNAL SIGTERM
CMD ["python", "-m", "app", "--host", "0.0.0.0", "--port", "8000"]
