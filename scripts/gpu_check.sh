#!/usr/bin/env bash
# The GPU check: run on a machine with an NVIDIA GPU (one card is enough) that reaches PyPI.
#
#   bash scripts/gpu_check.sh [OUT_DIR]          # about 5-8 minutes on one H100/H200, most of it the install
#
# 1. a virtual environment .venv-gpu with the CUDA wheel of torch 2.13.0 (PyPI's Linux x86-64 wheel is the
#    CUDA build; requirements-dev.txt pins the same version, which CI installs as the CPU wheel), the rest of
#    requirements-dev.txt, and this checkout (editable, C accelerator built);
# 2. the single-card tests on CUDA (tests/test_gpu.py: world-size-1 meshes, the census, bf16, fused AdamW,
#    sdpa), with HP_REQUIRE_CUDA=1 so that a torch without CUDA fails instead of skipping; then the
#    device-independent suite's fast single-process modules, on the CUDA build of torch;
# 3. the overhead benchmarks with CUDA as torch's default device (every tensor and model they build lands
#    on the GPU; host-side times, as the benchmarks measure them).
# Everything is logged to OUT_DIR (default: gpu_check_out/), and the script stops at the first failure.
# Environment: PYTHON (default python3), TORCH_INDEX_URL (a PyTorch wheel index for another CUDA build),
# GPU_VENV (default .venv-gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_check_out}
mkdir -p "$out"
exec > >(tee "$out/gpu_check.log") 2>&1

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L; then
  echo "gpu_check: no NVIDIA GPU is visible (nvidia-smi -L failed); run this where one is" >&2
  exit 2
fi

venv=${GPU_VENV:-.venv-gpu}
t0=$SECONDS
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
grep -v '^torch==' requirements-dev.txt > "$out/requirements-gpu.txt"
"${pip[@]}" -r "$out/requirements-gpu.txt"
"${pip[@]}" --no-deps --no-build-isolation -e .
py="$venv/bin/python"
"$py" - <<'EOF'
import torch
assert torch.version.cuda and torch.cuda.is_available(), (
    f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: set TORCH_INDEX_URL to a CUDA wheel index")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}, "
      f"{torch.cuda.device_count()} device(s)")
EOF
echo "== install: $((SECONDS - t0)) s"

export OMP_NUM_THREADS=4 HP_REQUIRE_CUDA=1 PYTHONUNBUFFERED=1
t0=$SECONDS
"$py" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py --junitxml "$out/test_gpu.xml"
echo "== CUDA tests: $((SECONDS - t0)) s"

# the device-independent single-process suite, on the CUDA build (ops rules, layouts, the dispatcher's fast
# paths, the census on CPU tensors): the same wheel a GPU user has, no gloo process pools
t0=$SECONDS
"$py" -m pytest -q -p no:cacheprovider -x tests/test_layout.py tests/test_fastpath.py tests/test_census.py \
  --junitxml "$out/test_cpu.xml"
echo "== device-independent tests: $((SECONDS - t0)) s"

# benchmarks with CUDA as the default device: a row that cannot run there prints its error and the run goes on
on_cuda() {  # on_cuda SCRIPT ARGS...: run a benchmark with torch's default device set to cuda
  "$py" - "$@" <<'EOF'
import runpy, sys
import torch
torch.set_default_device("cuda")
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
EOF
}
t0=$SECONDS
on_cuda bench/dispatch_overhead.py --iters 5000 | tee "$out/dispatch_overhead.txt"
on_cuda bench/model_overhead.py --models llama_ref,qwen3 --quick --clock wall | tee "$out/model_overhead.txt"
echo "== benchmarks: $((SECONDS - t0)) s"
echo "gpu_check: all passed; logs in $out/"
