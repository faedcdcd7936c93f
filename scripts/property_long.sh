#!/usr/bin/env bash
# The long run of the property test (tests/test_property_chains.py): many more batches of random op chains
# on random layouts, new random draws each run (HP_PROPERTY_RANDOM). Prints each batch's tally
# (ok / loud / wrong) and every failing case. Usage: bash scripts/property_long.sh [batches per world size]
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 HP_PROPERTY_EXAMPLES="${1:-25}" HP_PROPERTY_BATCH="${HP_PROPERTY_BATCH:-60}" HP_PROPERTY_RANDOM=1
exec .venv/bin/python -m pytest -q -s -p no:cacheprovider tests/test_property_chains.py
