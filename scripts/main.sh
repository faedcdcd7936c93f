#!/usr/bin/env bash
# Set up, then run the main job: the operator census on built-in tiny models and a 2-process demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
.venv/bin/hyper-parallel census --model llama --model qwen3 --model qwen3_vl --mode all
.venv/bin/torchrun --standalone --nproc-per-node 2 examples/demo.py
