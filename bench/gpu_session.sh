#!/usr/bin/env bash
# Everything the GPU issue (#14) needs from one lent GPU, in ONE command of at most ~8 minutes:
#
#   bash bench/gpu_session.sh                      # all steps, in order of value, within BUDGET_S (default 470 s)
#   NCU=1 bash bench/gpu_session.sh                # also a Nsight Compute profile of the slowest dorafp8 kernel
#   STEPS="install build tests" BUDGET_S=560 bash bench/gpu_session.sh   # a second call: the full GPU test suite
#   python bench/save_results.py $OUT              # then: copy the results into bench/results/<device>/, commit
#
# Steps (each logged, timed and capped with `timeout`, so one hang cannot eat the budget; a step that has less time
# left than it needs is skipped and says so):
#   env        nvidia-smi, clocks, versions                                                         ~5 s
#   install    pip install -e . without the CUDA extension (dorafp8.triton_kernels needs the install)  ~15 s
#   build      the CUDA extension, for this GPU's arch only, in the BACKGROUND while `gate` runs   ~60-100 s
#   gate       tests/ops/test_ops.py on cuda: every backend end to end against fp64 (cap 100 s)
#   bench      the headline grid: bench/run.py --preset headline, 156 cases (cap 250 s)
#   sanitizer  compute-sanitizer memcheck, then racecheck, on a few CUDA and Triton kernel tests (cap 60 s each)
#   ncu        only with NCU=1: find the slowest dorafp8 kernel of one headline call, profile it alone (cap 150 s)
#   tests      the GPU tests, pytest-xdist: cuda, cublas, ops, peft, compile, memory, then the Triton kernels
#              (the longest: every variant compiles and autotunes) with what is left; distributed/newcomer skipped
#   inspect    python -m dorafp8.kernel_report --json, if this checkout has it (static: registers, spills, mma kind)
#
# Everything is written as it happens into a staging folder (STAGE, default a fresh folder under /tmp), and packed
# into $OUT every 20 s and at the end, so that a call killed at its time limit still returns what was done. $OUT
# (default bench_out/gpu_session) receives at most 5 files, within the device tool's 8-file limit:
#   session.tar.gz   the whole staging folder: logs, bench results (results.json/.md, PNGs), test and sanitizer
#                    summaries, ncu report and summary
#   summary.md       one line per step: rc, seconds, outcome        session.log   the step log
#   results.md       results.json                                   (the headline benchmark, once it has run)
set -u
START=$(date +%s)
BUDGET_S=${BUDGET_S:-470}
DEADLINE=$((START + BUDGET_S))
OUT=${OUT:-bench_out/gpu_session}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STAGE=${STAGE:-$(mktemp -d /tmp/dorafp8_gpu_session.XXXXXX)/session}
mkdir -p "$STAGE"
STEPS=${STEPS:-"env install build gate bench sanitizer ncu tests inspect"}
NCU=${NCU:-0}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export MPLBACKEND=Agg
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}  # autotune results on disk: later processes reuse them
WARMUP_MS=${WARMUP_MS:-20}   # do_bench warm-up and repetition times for the benchmark (ms); see bench/README.md
REP_MS=${REP_MS:-60}
JOBS=${JOBS:-8}              # pytest-xdist workers for the test steps
cd "$(dirname "$0")/.."
: > "$STAGE/summary.md"
echo "| step | rc | seconds | outcome |" >> "$STAGE/summary.md"
echo "|---|---|---|---|" >> "$STAGE/summary.md"

log() { echo "[$(date +%T) +$(( $(date +%s) - START ))s] $*" | tee -a "$STAGE/session.log"; }
left() { echo $(( DEADLINE - $(date +%s) )); }
# cap NEED MAX: the timeout for a step that needs at least NEED seconds and is worth at most MAX; 0 if not enough.
cap() { local l; l=$(left); if [ "$l" -lt "$1" ]; then echo 0; elif [ "$l" -lt "$2" ]; then echo "$l"; else echo "$2"; fi; }
# note STEP RC T0 TEXT: one line of summary.md
note() { echo "| $1 | $2 | $(( $(date +%s) - $3 )) | $4 |" >> "$STAGE/summary.md"; log "$1: rc=$2 $4"; }
# run_to T LOG CMD...: the command with a timeout (SIGINT first, so pytest prints its summary; KILL 15 s later)
run_to() { local t=$1 f=$2; shift 2; timeout -s INT -k 15 "$t" "$@" > "$f" 2>&1; }
last_line() { grep -v '^\s*$' "$1" 2>/dev/null | tail -n 1 | cut -c1-200 | tr '|' '/'; }

pack() {  # called by the main script and by the packer loop: temporary names per process
  local tmp="/tmp/.dorafp8_session_pack.$BASHPID.tar.gz"
  cp -f "$STAGE/summary.md" "$STAGE/session.log" "$OUT/" 2>/dev/null
  [ -f "$STAGE/bench/results.json" ] && cp -f "$STAGE/bench/results.json" "$OUT/.results.json.$BASHPID" \
    && mv -f "$OUT/.results.json.$BASHPID" "$OUT/results.json"
  [ -f "$STAGE/bench/results.md" ] && cp -f "$STAGE/bench/results.md" "$OUT/.results.md.$BASHPID" \
    && mv -f "$OUT/.results.md.$BASHPID" "$OUT/results.md"
  # tar exits 1 when a file changed while it was read (a log being written): the archive is still good
  tar czf "$tmp" --exclude='.build*' -C "$(dirname "$STAGE")" "$(basename "$STAGE")" 2>/dev/null
  [ -s "$tmp" ] && mv -f "$tmp" "$OUT/session.tar.gz"
}
( while sleep 20; do pack; done ) &
PACKER=$!
BUILD_PID=""
trap 'kill $PACKER 2>/dev/null; [ -n "$BUILD_PID" ] && kill $BUILD_PID 2>/dev/null; pack' EXIT

has_step() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
# pytest plugins, where installed (the device image has both): xdist runs test files in parallel workers (the
# Triton tests are compile-bound, 16 cores), pytest-timeout stops one hanging test.
XDIST=""; PTIMEOUT=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n $JOBS"
$PY -c "import pytest_timeout" 2>/dev/null && PTIMEOUT="--timeout"
log "gpu_session: steps [$STEPS], budget ${BUDGET_S}s, stage $STAGE, out $OUT, NCU=$NCU"

# ------------------------------------------------------------------------------------------------------------ env
if has_step env; then
  t0=$(date +%s)
  {
    nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,clocks.max.sm,clocks.max.mem,power.limit \
      --format=csv
    nvidia-smi -q -d CLOCK,PERFORMANCE 2>/dev/null | sed -n '1,80p'
    $PY -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    $PY -c "import peft, transformers; print('peft', peft.__version__, 'transformers', transformers.__version__)" 2>&1
    command -v nvcc >/dev/null && nvcc --version | tail -n 2
    command -v ncu >/dev/null && ncu --version | tail -n 1
    command -v compute-sanitizer >/dev/null && compute-sanitizer --version | tail -n 1
    git log -1 --format='commit %H %cd' 2>/dev/null; git status --porcelain --untracked-files=no 2>/dev/null | head
  } > "$STAGE/device.txt" 2>&1
  note env 0 "$t0" "$(head -n 2 "$STAGE/device.txt" | tail -n 1 | tr '|' '/')"
fi
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')
ARCH=${DORAFP8_CUDA_ARCHS:-$([ "${CC:0:1}" = "9" ] && echo "${CC}a" || echo "${CC:-90a}")}

# -------------------------------------------------------------------------------------------------------- install
if has_step install; then
  t0=$(date +%s)
  T=$(cap 20 120)
  DORAFP8_SKIP_CUDA_BUILD=1 run_to "$T" "$STAGE/install.log" $PY -m pip install -e . --no-build-isolation --no-deps
  rc=$?
  note install $rc "$t0" "$(last_line "$STAGE/install.log")"
fi

# ---------------------------------------------------------------------------------- build (background) while gate
if has_step build; then
  log "build: the CUDA extension for sm_$ARCH, in the background"
  BUILD_T0=$(date +%s)
  # Built outside the package, then renamed into it in one step: the gate's test processes import dorafp8 while
  # this runs, and must never load a half-copied dorafp8/_C*.so.
  ( T=$(cap 60 240); DORAFP8_FORCE_CUDA_BUILD=1 DORAFP8_CUDA_ARCHS="$ARCH" MAX_JOBS=${MAX_JOBS:-4} \
      CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} run_to "$T" "$STAGE/build.log" $PY setup.py build_ext \
      --build-lib "$STAGE/.buildlib" --build-temp "$STAGE/.buildtmp"
    rc=$?
    so=$(ls "$STAGE"/.buildlib/dorafp8/_C*.so 2>/dev/null | head -n 1)
    if [ $rc -eq 0 ] && [ -n "$so" ]; then
      cp -f "$so" dorafp8/.incoming_C.so && mv -f dorafp8/.incoming_C.so "dorafp8/$(basename "$so")"
      # build_ext's note of what it built, next to the .so (python -m dorafp8 and the cuda backend's errors read it)
      cp -f "$STAGE/.buildlib/dorafp8/_build_info.json" dorafp8/_build_info.json 2>/dev/null
    elif [ $rc -eq 0 ]; then rc=8; echo "build_ext made no _C*.so" >> "$STAGE/build.log"; fi
    rm -rf "$STAGE/.buildlib" "$STAGE/.buildtmp"
    echo $rc > "$STAGE/build.rc" ) &
  BUILD_PID=$!
fi

if has_step gate; then
  t0=$(date +%s)
  T=$(cap 40 100)
  if [ "$T" -gt 0 ]; then
    run_to "$T" "$STAGE/gate.log" $PY -m pytest tests/ops/test_ops.py -q -p no:cacheprovider ${XDIST:+-n 4} -k cuda \
      -rfE ${PTIMEOUT:+--timeout 90}
    note gate $? "$t0" "test_ops.py on cuda (backends built by then): $(last_line "$STAGE/gate.log")"
  else
    note gate skip "$t0" "not enough time left"
  fi
fi

if [ -n "$BUILD_PID" ]; then
  t0=$(date +%s)
  wait "$BUILD_PID"
  BUILD_PID=""
  rc=$(cat "$STAGE/build.rc" 2>/dev/null || echo "?")
  cp -f dorafp8/_build_info.json "$STAGE/build_info.json" 2>/dev/null
  ok=$($PY -c "import dorafp8.backends.cuda as c, torch; print(c.unavailable_reason(torch.device('cuda')) or 'dorafp8._C imports and runs here')" 2>&1 | tail -n 1)
  note build "$rc" "$BUILD_T0" "sm_$ARCH: $(last_line "$STAGE/build.log" | cut -c1-80); $ok"
fi

# ---------------------------------------------------------------------------------------------------------- bench
if has_step bench; then
  t0=$(date +%s)
  T=$(cap 90 250)
  if [ "$T" -gt 0 ]; then
    # BENCH_ARGS: extra run.py options, appended (argparse keeps the last), e.g. to narrow the grid
    run_to "$T" "$STAGE/bench.log" $PY bench/run.py --preset headline --device cuda --out "$STAGE/bench" \
      --warmup "$WARMUP_MS" --rep "$REP_MS" ${BENCH_ARGS:-}
    rc=$?
    msg=$(grep -E 'cases measured' "$STAGE/bench.log" | tail -n 1 | sed 's/; wrote.*//' | cut -c1-160)
    if [ $rc -ne 0 ] && [ -f "$STAGE/bench/results.json" ]; then  # cut short or failed: draw what was measured
      msg="stopped (rc $rc; see bench.log) after $($PY -c "import json; r = json.load(open('$STAGE/bench/results.json'))['records']; print(sum(x['status'] == 'ok' for x in r), 'measured of', len(r), 'recorded')" 2>&1 | tail -n 1); $(last_line "$STAGE/bench.log" | cut -c1-80)"
      $PY bench/plot.py "$STAGE/bench/results.json" >> "$STAGE/bench.log" 2>&1
    fi
    note bench $rc "$t0" "headline: ${msg:-$(last_line "$STAGE/bench.log")}"
  else
    note bench skip "$t0" "not enough time left"
  fi
  pack
fi

# ------------------------------------------------------------------------------------------------------ sanitizer
if has_step sanitizer; then
  if ! command -v compute-sanitizer >/dev/null; then
    note sanitizer skip "$(date +%s)" "compute-sanitizer not found"
  else
    # One small odd shape (ragged tiles, strided activations) in fp16: every CUDA kernel test of it (20 tests; they
    # skip if dorafp8._C is not built), and the Triton kernels' W8A16 tests with a per-tensor scale plus the W8A8
    # no-dropout ones (12). PYTORCH_NO_CUDA_MEMORY_CACHING=1: one cudaMalloc per tensor, so that memcheck sees a write
    # past a tensor's end (inside the caching allocator's pooled blocks it would not). Triton's autotuner launches each
    # config a few times under the tool: slow, hence the small selection.
    SEL_CUDA=${SANITIZER_K_CUDA:-"M37-K50-N70-r3 and float16 and not bfloat16"}
    SEL_TRITON=${SANITIZER_K_TRITON:-"cuda and M37-K50-N70-r3 and float16 and not bfloat16 and tensor and (not w8a8 or nodrop)"}
    for tool in memcheck racecheck; do
      t0=$(date +%s)
      T=$(cap 30 60)
      if [ "$T" -gt 0 ]; then
        DORAFP8_POISON=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 run_to "$T" "$STAGE/sanitizer_$tool.log" \
          compute-sanitizer --tool $tool --error-exitcode 9 --print-limit 50 \
          $PY -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_cuda.py tests/kernels/test_triton_kernels.py \
          -k "(test_cuda and $SEL_CUDA) or (test_triton_kernels and $SEL_TRITON)"
        rc=$?
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Program hit|passed|failed|error|no tests ran" \
          "$STAGE/sanitizer_$tool.log" | tail -n 4 > "$STAGE/sanitizer_${tool}_summary.txt"
        note "sanitizer $tool" $rc "$t0" "$(tr '\n' ';' < "$STAGE/sanitizer_${tool}_summary.txt" | cut -c1-200 | tr '|' '/')"
      else
        note "sanitizer $tool" skip "$t0" "not enough time left"
      fi
    done
  fi
  pack
fi

# ------------------------------------------------------------------------------------------------------------ ncu
if has_step ncu && [ "$NCU" = "1" ]; then
  t0=$(date +%s)
  T=$(cap 60 150)
  if ! command -v ncu >/dev/null; then
    note ncu skip "$t0" "ncu not found"
  elif [ "$T" -gt 0 ]; then
    mkdir -p "$STAGE/ncu"
    run_to $((T / 3)) "$STAGE/ncu/find.log" $PY bench/ncu_profile.py find --json "$STAGE/ncu/kernels.json"
    KERNEL=${NCU_KERNEL:-$($PY -c "import json; print(json.load(open('$STAGE/ncu/kernels.json'))['slowest'] or '')" 2>/dev/null)}
    if [ -n "$KERNEL" ]; then
      T=$(cap 30 $((T - ($(date +%s) - t0))))
      # --clock-control none: measure the card as it runs (and never touch its clocks); --set full: every section
      # (SpeedOfLight, ComputeWorkloadAnalysis: pipe utilization incl. tensor and conversion pipes, WarpStateStats:
      # stall reasons, MemoryWorkloadAnalysis, Occupancy, SourceCounters).
      run_to "$T" "$STAGE/ncu/ncu.log" ncu --profile-from-start off --clock-control none --kernel-name "regex:^${KERNEL}\$" \
        --launch-count 1 --set full -f -o "$STAGE/ncu/profile" $PY bench/ncu_profile.py run
      rc=$?
      if [ -f "$STAGE/ncu/profile.ncu-rep" ]; then
        ncu -i "$STAGE/ncu/profile.ncu-rep" --page details > "$STAGE/ncu/details.txt" 2>&1
        ncu -i "$STAGE/ncu/profile.ncu-rep" --page raw --csv > "$STAGE/ncu/raw.csv" 2>&1
        $PY bench/ncu_profile.py summarize "$STAGE/ncu/raw.csv" > "$STAGE/ncu/summary.txt" 2>&1
      fi
      note ncu $rc "$t0" "kernel $KERNEL: $(grep -m1 'gpu__time_duration' "$STAGE/ncu/summary.txt" 2>/dev/null | tr -s ' ' | tr '|' '/')"
    else
      note ncu 1 "$t0" "no dorafp8 kernel found (see ncu/find.log)"
    fi
  else
    note ncu skip "$t0" "not enough time left"
  fi
  pack
fi

# ---------------------------------------------------------------------------------------------------------- tests
if has_step tests; then
  # The quick files first (CUDA kernels, cuBLAS strategy, ops, PEFT parity, torch.compile, memory), then the Triton
  # kernel tests, which compile and autotune every variant (minutes): they get what is left. Slow CPU-only suites
  # (test_distributed, test_newcomer, test_bench_smoke, test_cuda_emulated) are not GPU tests and are skipped.
  t0=$(date +%s)
  T=$(cap 30 200)
  if [ "$T" -gt 0 ]; then
    run_to "$T" "$STAGE/tests_quick.log" $PY -m pytest tests/kernels/test_cuda.py tests/kernels/test_cublas.py \
      tests/ops/test_ops.py tests/peft/test_peft.py tests/integration/test_compile.py tests/integration/test_memory.py \
      -q -p no:cacheprovider $XDIST -rfE ${PTIMEOUT:+--timeout 120} --junitxml "$STAGE/tests_quick.xml"
    note "tests quick" $? "$t0" "cuda, cublas, ops, peft, compile, memory: $(last_line "$STAGE/tests_quick.log")"
  else
    note "tests quick" skip "$t0" "not enough time left"
  fi
  t0=$(date +%s)
  T=$(cap 45 400)
  if [ "$T" -gt 0 ]; then
    run_to "$T" "$STAGE/tests_triton.log" $PY -m pytest tests/kernels/test_triton_kernels.py -q -p no:cacheprovider \
      $XDIST -rfE ${PTIMEOUT:+--timeout 180} --junitxml "$STAGE/tests_triton.xml"
    note "tests triton" $? "$t0" "test_triton_kernels.py ($T s cap): $(last_line "$STAGE/tests_triton.log")"
  else
    note "tests triton" skip "$t0" "not enough time left"
  fi
  grep -hE "^(FAILED|ERROR) |passed|failed" "$STAGE"/tests_*.log "$STAGE/gate.log" 2>/dev/null | cut -c1-300 \
    > "$STAGE/tests_summary.txt"
  pack
fi

# -------------------------------------------------------------------------------------------------------- inspect
if has_step inspect; then
  t0=$(date +%s)
  # dorafp8.kernel_report; dorafp8.inspect in checkouts from before it was renamed
  INSPECT_MOD=$($PY -c "import importlib.util as u; print(next((m for m in ('dorafp8.kernel_report', 'dorafp8.inspect') if u.find_spec(m)), ''))" 2>/dev/null)
  if [ -z "$INSPECT_MOD" ]; then
    note inspect skip "$t0" "python -m dorafp8.kernel_report is not in this checkout"
  else
    T=$(cap 30 120)
    if [ "$T" -gt 0 ]; then
      ARGS="--json"
      HELP=$($PY -m $INSPECT_MOD --help 2>&1)
      case "$HELP" in *--arch*) ARGS="$ARGS --arch sm_${ARCH}" ;; esac
      case "$HELP" in *--jobs*) ARGS="$ARGS --jobs 12" ;; esac
      run_to "$T" "$STAGE/inspect.json" $PY -m $INSPECT_MOD $ARGS
      note inspect $? "$t0" "python -m $INSPECT_MOD $ARGS -> inspect.json ($(wc -c < "$STAGE/inspect.json") bytes)"
    else
      note inspect skip "$t0" "not enough time left"
    fi
  fi
fi

log "gpu_session done in $(( $(date +%s) - START ))s; results in $OUT (session.tar.gz: everything)"
cat "$STAGE/summary.md"
