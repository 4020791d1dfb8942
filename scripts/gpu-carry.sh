#!/usr/bin/env bash
# Fill .gpu-carry/ (git-ignored) with what scripts/gpu-check.sh needs on an offline GPU machine and its image
# lacks: the wheels of our serving dependencies for Python 3.12 / manylinux x86_64 (glibc >= 2.31: llguidance
# 1.9 has no older wheel; at the versions this
# project's venv runs, so the GPU runs what the CPU tests ran) and GPT-2's tiktoken ranks. The device tool
# carries the folder with the working tree (64 MiB in all): run with carry [".gpu-carry"].
#   scripts/gpu-carry.sh            (needs PyPI once, here; nothing at run time there)
# The image has torch, numpy, transformers, tiktoken, safetensors, jinja2, httpx (anyio, h11, idna),
# prometheus-client, uvloop, pytest, tqdm; what is listed in DISTS is what it lacks, with their own
# dependencies that httpx/torch do not bring.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CARRY=${CARRY:-.gpu-carry}
LIMIT_MIB=${LIMIT_MIB:-64}
DISTS=(fastapi fastapi-offline starlette annotated-doc uvicorn click httptools pydantic pydantic-core
       pydantic-settings python-dotenv typing-inspection annotated-types pyzmq msgspec llguidance)

rm -rf "$CARRY/wheels" "$CARRY/tiktoken"
mkdir -p "$CARRY/wheels" "$CARRY/tiktoken"
pins=()
for d in "${DISTS[@]}"; do
  v=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$d") || {
    echo "gpu-carry: $d is not installed in $PY's environment (make install first)" >&2; exit 1; }
  pins+=("$d==$v")
done
printf '%s\n' "${pins[@]}" > "$CARRY/requirements.txt"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$CARRY/wheels" "${pins[@]}"

# GPT-2's ranks (r50k_base) under the name tiktoken caches them by (the sha1 of their URL), checked by loading
# them from the carried folder alone: the checkpoints gpu-check makes use GPT-2's tokenizer
src=${TIKTOKEN_CACHE_DIR:-../shared/tiktoken}
ranks=$(printf '%s' "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken" | sha1sum | cut -d' ' -f1)
[[ -f "$src/$ranks" ]] || { echo "gpu-carry: GPT-2's ranks ($ranks) are not in $src (set TIKTOKEN_CACHE_DIR)" >&2; exit 1; }
cp "$src/$ranks" "$CARRY/tiktoken/"
TIKTOKEN_CACHE_DIR=$(realpath "$CARRY/tiktoken") "$PY" -c "import tiktoken; tiktoken.get_encoding('r50k_base')"

carry=$(du -sb "$CARRY" | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "gpu-carry: $(ls "$CARRY/wheels" | wc -l) wheels, $((carry / 1024)) KiB in $CARRY; with the tree $(((carry + tree) / 1048576)) MiB of $LIMIT_MIB"
if (((carry + tree) > LIMIT_MIB * 1048576)); then
  echo "gpu-carry: the tree and $CARRY exceed the ${LIMIT_MIB} MiB the device tool carries" >&2; exit 1
fi
