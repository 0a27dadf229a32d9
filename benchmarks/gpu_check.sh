#!/usr/bin/env bash
# benchmarks/gpu_check.sh: everything kvlab's CUDA backend needs checked on a machine with an
# NVIDIA GPU, in one command (about 5 minutes on an H200, well under 8):
#   1. builds kvlab in place with its CUDA extension (nvcc from CUDA_HOME or the PATH),
#   2. runs the CUDA tests (tests/cuda: GPU against CPU on random models and stories260K,
#      cached against uncached, paged against contiguous, every cache format),
#   3. runs the GPU benchmarks (benchmarks/bench_gpu.py): decode attention against a
#      device-to-device copy, paged against contiguous, kvlab against transformers eager.
# It goes on to the benchmarks when a test fails, and exits non-zero if anything failed.
# Results go to $KVLAB_RESULTS_DIR (default benchmarks/results): gpu.json, gpu_build.log,
# gpu_tests.log, gpu_bench.log. stories260K is looked for in $KVLAB_SHARED (a `shared` folder
# holding models/, or the models folder itself), else ../shared/models.
#   bash benchmarks/gpu_check.sh                      # PYTHON=python3.12 to choose the Python
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
RESULTS=${KVLAB_RESULTS_DIR:-benchmarks/results}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
started=$(date +%s)
elapsed() { echo "$(( $(date +%s) - started )) s"; }

echo "== build ($(command -v nvcc || echo 'no nvcc on the PATH'); $($PYTHON --version 2>&1))"
if ! timeout 300 $PYTHON setup.py build_ext --inplace >"$RESULTS/gpu_build.log" 2>&1; then
    tail -n 40 "$RESULTS/gpu_build.log"
    echo "== the build failed ($(elapsed)); see $RESULTS/gpu_build.log"
    exit 1
fi
grep -iE "warning|error" "$RESULTS/gpu_build.log" | grep -v "^copying" | head -n 20
echo "built in $(elapsed)"
if ! $PYTHON -c "import kvlab.cuda as c; assert c.is_available(), c.why_not(); print(c.device_info())"; then
    echo "== no usable GPU: nothing more to check"
    exit 1
fi

echo "== CUDA tests ($(elapsed))"
timeout 240 $PYTHON -m pytest -q -p no:cacheprovider -ra tests/cuda 2>&1 | tee "$RESULTS/gpu_tests.log" | tail -n 40
tests=${PIPESTATUS[0]}

echo "== benchmarks ($(elapsed))"
timeout 300 $PYTHON benchmarks/bench_gpu.py --json "$RESULTS/gpu.json" 2>&1 | tee "$RESULTS/gpu_bench.log"
bench=${PIPESTATUS[0]}

echo "== done in $(elapsed): tests exit $tests, benchmarks exit $bench; results in $RESULTS"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
