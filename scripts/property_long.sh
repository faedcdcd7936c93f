#!/usr/bin/env bash
# The long run of the property test (tests/test_property_chains.py): many more batches of random op chains
# on random layouts, new random draws each run (HP_PROPERTY_RANDOM). Prints each batch's tally
# (correct / clear error / wrong / hang), every failing case, and each world size's total; it goes on past a
# failing batch and fails at the end. A collective that waits past HP_COMM_TIMEOUT seconds (default here 30) is
# a hang. Usage: bash scripts/property_long.sh [batches per world size] (cases = batches x HP_PROPERTY_BATCH)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 HP_PROPERTY_EXAMPLES="${1:-25}" HP_PROPERTY_BATCH="${HP_PROPERTY_BATCH:-60}" HP_PROPERTY_RANDOM=1 \
    HP_PROPERTY_KEEP_GOING=1 HP_COMM_TIMEOUT="${HP_COMM_TIMEOUT:-30}"
exec .venv/bin/python -m pytest -q -s -p no:cacheprovider tests/test_property_chains.py
