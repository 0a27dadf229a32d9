#!/usr/bin/env bash
# benchmarks/gpu_check.sh: everything kvlab's CUDA backend needs checked on a machine with an
# NVIDIA GPU, in one command that fits a 10-minute limit with room to spare (its own time
# limits add up to 480 s: build 120, smoke 40, tests 120, one sanitizer rerun 40, kernel
# lab 90, bench 70):
#   0. what the machine is: nvidia-smi, nvcc --version, Python and setuptools versions;
#   1. builds kvlab in place with its CUDA extension for the GPU present (KVLAB_CUDA=1, in
#      parallel), and stops loudly if kvlab._cuda did not build or cannot see the GPU;
#   2. a smoke test (about 30 s, -x: one illegal address poisons every later test of the
#      process), then the CUDA tests (tests/cuda); a failing test is run again alone under
#      compute-sanitizer --tool memcheck with CUDA_LAUNCH_BLOCKING=1;
#   3. lab 14 on a GPU (kvlab/labs/decode_kernel_cuda), which has never run on one: its
#      kernels' shares of the copy bandwidth (benchmarks/bench_kernel_lab_cuda.py: the
#      reference's and the plain port's, each checked bit for bit first; its provisional
#      TARGET_SHARE is to be set to 80 % of the reference's), then the reference solution
#      graded with the hidden tests (every test but the bandwidth ones must pass). Its own
#      test file (the gradings of every mistake and cheat, minutes) is left out of step 2;
#      run it alone when there is time: pytest tests/cuda/test_decode_kernel_cuda_lab.py;
#   4. the GPU benchmarks (benchmarks/bench_gpu.py), whose JSON is rewritten after every
#      measurement, so a run cut short keeps what it measured.
# Every log and the JSON go to $OUT if it is set (the device tool's folder that comes back),
# else $KVLAB_RESULTS_DIR, else benchmarks/results, and are written as the run goes.
# stories260K is looked for in $KVLAB_SHARED (a `shared` folder holding models/, or the models
# folder itself), else ../shared/models.
#   bash benchmarks/gpu_check.sh            # PYTHON=python3.12 to choose the Python
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
RESULTS=${OUT:-${KVLAB_RESULTS_DIR:-benchmarks/results}}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
started=$(date +%s)
elapsed() { echo "$(( $(date +%s) - started )) s"; }
log() { echo "$*" | tee -a "$RESULTS/gpu_check.log"; }

log "== the machine"
{ nvidia-smi || echo "nvidia-smi failed"
  echo "nvcc on the PATH: $(command -v nvcc || echo none)"
} 2>&1 | tee -a "$RESULTS/gpu_check.log"
if ! command -v nvcc >/dev/null; then
    for home in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-* /opt/cuda; do
        if [ -n "$home" ] && [ -x "$home/bin/nvcc" ]; then
            export CUDA_HOME="$home"
            log "CUDA_HOME=$CUDA_HOME (nvcc was not on the PATH)"
            break
        fi
    done
fi
NVCC=$(command -v nvcc || echo "${CUDA_HOME:-/nonexistent}/bin/nvcc")
{ "$NVCC" --version || echo "no nvcc found: the CUDA backend cannot be built"
  $PYTHON --version
  $PYTHON -c "import setuptools, numpy; print('setuptools', setuptools.__version__, '/ numpy', numpy.__version__)"
} 2>&1 | tee -a "$RESULTS/gpu_check.log"

log "== build ($(elapsed))"
# KVLAB_CUDA=1: a build without the CUDA backend is a failure here, not a CPU-only install
if ! KVLAB_CUDA=1 timeout 120 $PYTHON setup.py build_ext --inplace --parallel "$(nproc)" \
        >"$RESULTS/gpu_build.log" 2>&1; then
    tail -n 40 "$RESULTS/gpu_build.log"
    log "== the build failed ($(elapsed)); see gpu_build.log"
    exit 1
fi
grep -iE "warning|error|kvlab:" "$RESULTS/gpu_build.log" | grep -v "^copying" | head -n 20
log "built in $(elapsed)"
if ! $PYTHON -c "import kvlab._cuda" 2>&1 | tee -a "$RESULTS/gpu_check.log"; then
    log "== kvlab._cuda did not build (see gpu_build.log): nothing more to check"
    exit 1
fi
if ! $PYTHON -c "import kvlab.cuda as c; assert c.is_available(), c.why_not(); print(c.device_info())" \
        2>&1 | tee -a "$RESULTS/gpu_check.log"; then
    log "== kvlab._cuda built but cannot use the GPU: nothing more to check"
    exit 1
fi

# One test again under compute-sanitizer, to name the kernel and the address at fault.
sanitize() {
    local test_id=$1 name
    name=$(echo "$test_id" | tr -c 'A-Za-z0-9_.-' '_' | cut -c1-80)
    if command -v compute-sanitizer >/dev/null || [ -x "${CUDA_HOME:-/nonexistent}/bin/compute-sanitizer" ]; then
        log "== compute-sanitizer memcheck: $test_id ($(elapsed))"
        CUDA_LAUNCH_BLOCKING=1 timeout 40 "$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")" \
            --tool memcheck $PYTHON -m pytest -q -p no:cacheprovider -x "$test_id" \
            >"$RESULTS/sanitizer_$name.log" 2>&1
        tail -n 30 "$RESULTS/sanitizer_$name.log"
    else
        log "(no compute-sanitizer: $test_id not rerun under memcheck)"
    fi
}

log "== smoke test ($(elapsed))"
timeout 40 $PYTHON -m pytest -q -p no:cacheprovider -x \
    "tests/cuda/test_gpu.py::test_the_device_is_there" \
    "tests/cuda/test_gpu.py::test_against_the_numpy_reference" \
    "tests/cuda/test_gpu.py::test_prefill_and_decode_match_the_cpu" -k "fp32 or reference or device" \
    2>&1 | tee "$RESULTS/gpu_smoke.log" | tail -n 15
smoke=${PIPESTATUS[0]}
if [ "$smoke" -ne 0 ]; then
    failed=$(grep -m1 -oE "^FAILED [^ ]+" "$RESULTS/gpu_smoke.log" | cut -d' ' -f2)
    [ -n "$failed" ] && sanitize "$failed"
    log "== the smoke test failed ($(elapsed)): the full suite would only repeat it"
fi

tests=$smoke
if [ "$smoke" -eq 0 ]; then
    log "== CUDA tests ($(elapsed))"
    timeout 120 $PYTHON -m pytest -q -p no:cacheprovider -ra tests/cuda \
        --ignore=tests/cuda/test_decode_kernel_cuda_lab.py 2>&1 \
        | tee "$RESULTS/gpu_tests.log" | tail -n 40
    tests=${PIPESTATUS[0]}
    failed=$(grep -m1 -oE "^FAILED [^ ]+" "$RESULTS/gpu_tests.log" | cut -d' ' -f2)
    [ -n "$failed" ] && sanitize "$failed"
fi

log "== lab 14 on a GPU: its kernels' shares, then the reference graded ($(elapsed))"
timeout 90 bash -c "$PYTHON benchmarks/bench_kernel_lab_cuda.py --json '$RESULTS/kernel_lab_cuda.json' \
    && $PYTHON -m kvlab grade decode_kernel_cuda instructor/solutions/decode_kernel_cuda.cu \
       --instructor instructor --seed 1 --results '$RESULTS/kernel_lab_cuda_results.json'" \
    2>&1 | tee "$RESULTS/gpu_kernel_lab.log" | tail -n 40
lab=${PIPESTATUS[0]}

log "== benchmarks ($(elapsed))"
timeout 70 $PYTHON benchmarks/bench_gpu.py --json "$RESULTS/gpu.json" 2>&1 | tee "$RESULTS/gpu_bench.log"
bench=${PIPESTATUS[0]}

log "== done in $(elapsed): tests exit $tests, kernel lab exit $lab, benchmarks exit $bench; results in $RESULTS"
[ "$tests" -eq 0 ] && [ "$lab" -eq 0 ] && [ "$bench" -eq 0 ]
