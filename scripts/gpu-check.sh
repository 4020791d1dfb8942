#!/usr/bin/env bash
# The offline first run of a GPU machine (bench/gpu_offline.py): the image's own python3 and torch, the wheels and
# GPT-2's ranks carried in .gpu-carry/ (scripts/gpu-carry.sh fills it here), nothing downloaded, every stage under
# one time budget; gpu-check.json and the server's log in $OUT (else out/gpu-check), a one-screen summary.
#   scripts/gpu-check.sh                       on the GPU (device tool: carry [".gpu-carry"])
#   scripts/gpu-check.sh --device cpu          the dry run, here (tests/test_gpu_offline.py)
# Options: --budget-s SECONDS (480), --out DIR, --only stage,stage. PYTHON picks another interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1
# GPT-2's ranks from the carried tree; without it (a fresh clone) a cache already set, else a byte-level tokenizer
if [[ -d .gpu-carry/tiktoken ]]; then export TIKTOKEN_CACHE_DIR="$PWD/.gpu-carry/tiktoken"; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" -m bench.gpu_offline "$@"
