#!/usr/bin/env bash
# The device check for a CUDA machine with PyTorch but no vLLM and no network:
# the page-movement tests marked `gpu` and their copy bandwidth. Results go to one folder.
#   bash bench/gpu_check.sh OUT_DIR
set -uo pipefail
out=${1:-gpu_check}
mkdir -p "$out"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/nvidia-smi.csv" 2>&1
PYTHONUNBUFFERED=1 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/unit/test_kv_move.py \
  2>&1 | tee "$out/pytest.log"
tests=${PIPESTATUS[0]}
PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --out "$out" 2>&1 | tee "$out/bandwidth.log"
bench=${PIPESTATUS[0]}
echo "pytest rc=$tests bench rc=$bench"
exit $(( tests || bench ))
