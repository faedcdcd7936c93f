#!/usr/bin/env bash
# Set up, then run the main job: the operator census on built-in tiny models, a 2-process demo, and the
# transformers workflow: a saved tiny checkpoint -> hp.from_pretrained on 2 processes -> a few training
# steps -> hp.save_pretrained -> plain transformers loads it and gives the same parameters and tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1
.venv/bin/hyper-parallel census --model llama --model qwen3 --model qwen3_vl --mode all
.venv/bin/torchrun --standalone --nproc-per-node 2 examples/demo.py
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/python examples/tiny_checkpoint.py "$work/tiny"
.venv/bin/torchrun --standalone --nproc-per-node 2 examples/train.py --model "$work/tiny" --out "$work/trained" \
  --tp 2 --steps 3 --check
