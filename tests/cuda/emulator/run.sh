#!/usr/bin/env bash
# Runs GPU tests on the CPU emulator (cuda_runtime.h): the real kernel source, one fiber per
# CUDA thread. Slow (minutes for a few tests), for checking kernels where no GPU is lent:
#   bash tests/cuda/emulator/run.sh [pytest arguments, e.g. -k "hd16 and fp32"]
set -euo pipefail
repo="$(cd "$(dirname "$0")/../../.." && pwd)"
out="${KVLAB_EMULATOR_DIR:-/tmp/kvlab-emulated}"
python "$repo/tests/cuda/emulator/build.py" "$out"
cd "$out"
python -m pytest -p no:cacheprovider -q "$repo/tests/cuda/test_gpu.py" "$@"
