#!/usr/bin/env bash
# The GPU path on a machine with a CUDA GPU (no network needed: the models are built here).
# 1. The GPU suites natively (Triton compiled for the GPU, not interpreted): the kernels against
#    torch and row-invariant (tests/test_gpu_kernels.py), the whole engine within 1e-4 of
#    transformers and bitwise under batching, chunking and the prefix cache, exact and bf16
#    (tests/test_gpu_path.py).
# 2. bench/gpu_bench.py: one stream and 64 streams at the Llama-3-8B shape (random weights),
#    transformers' generate in the same run, the HBM roofline; `name value unit` lines.
# Usage: scripts/gpu_check.sh [python]   (default .venv/bin/python; it needs torch with CUDA,
# triton, transformers, pytest and probserve installed)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
unset TRITON_INTERPRET
"$PY" - <<'PY'
import torch, triton
assert torch.cuda.is_available(), "gpu_check: torch sees no CUDA GPU"
print(f"== {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
PY
echo "== the GPU suites"
"$PY" -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py tests/test_gpu_path.py
echo "== the benchmark (bench/gpu_bench.py)"
"$PY" bench/gpu_bench.py "${@:2}"
