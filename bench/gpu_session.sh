#!/usr/bin/env bash
# Everything that needs a GPU, in one command, for a session lent one (the device tool runs this in the repo root;
# results land in $OUT, default bench_out/gpu_session). Order: build -> GPU tests -> compute-sanitizer -> benchmark,
# each step logged and timed, so that one call of at most ~10 minutes does it all and a failure in one step does not
# hide the others. Commit what it measured under bench/results/<device>/ (with device, versions and date).
#
#   bash bench/gpu_session.sh            # all steps
#   STEPS="build tests" bash bench/gpu_session.sh
set -u
OUT=${OUT:-bench_out/gpu_session}
mkdir -p "$OUT"
STEPS=${STEPS:-"build tests sanitizer bench"}
export PYTHONUNBUFFERED=1
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/session.log"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"

for step in $STEPS; do
  t0=$(date +%s)
  case $step in
    build)
      log "build: dorafp8 with the CUDA extension"
      CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} pip install -q -e . --no-build-isolation --no-deps \
        > "$OUT/build.log" 2>&1 || log "build FAILED (see build.log)" ;;
    tests)
      log "tests: GPU kernels (triton, cuda), ops, PEFT parity, compile"
      python -m pytest tests -q -x -p no:cacheprovider --ignore=tests/test_bench_smoke.py \
        > "$OUT/tests.log" 2>&1; log "tests rc=$? ($(tail -n 1 "$OUT/tests.log"))" ;;
    sanitizer)
      if command -v compute-sanitizer >/dev/null; then
        for tool in memcheck racecheck; do
          log "compute-sanitizer $tool over the CUDA kernel tests (one shape per op)"
          compute-sanitizer --tool $tool --error-exitcode 9 python -m pytest tests/test_cuda.py -q -x \
            -p no:cacheprovider -k "M37-K50-N70-r3 and float16" > "$OUT/sanitizer_$tool.log" 2>&1
          log "$tool rc=$?"
        done
      else
        log "compute-sanitizer not found: skipped"
      fi ;;
    bench)
      log "bench: quick preset (LLaMA-3-8B shapes)"
      python bench/run.py --preset quick --out "$OUT" > "$OUT/bench.log" 2>&1; log "bench rc=$?" ;;
  esac
  log "$step took $(( $(date +%s) - t0 ))s"
done
