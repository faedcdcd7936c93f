#!/usr/bin/env bash
# Set up, then run the whole test suite (multi-process tests use gloo on localhost).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
