#!/usr/bin/env bash
# bench/gpu_session.sh: the GPU work of a first GPU session, planned as three device calls.
#
#   bash bench/gpu_session.sh 1     # call 1: build + warm Triton's cache, the decisive benchmark, compute-sanitizer
#   bash bench/gpu_session.sh 2     # call 2: the GPU tests
#   bash bench/gpu_session.sh 3     # call 3: the rest of the headline benchmark, ncu, the kernel report
#   DRY_RUN=1 bash bench/gpu_session.sh all   # print the plan (steps, caps, commands) of every call; run nothing
#   python bench/save_results.py OUT1 OUT2 OUT3 --commit SHA   # here, afterwards: bench/results/<device>/, README
#
# THE PLAN. What a session may spend (bench/README.md, "On a lent GPU"): 600 s a call, 1800 s of device time a session,
# counting each machine start (~60-120 s: allowed 120 s a call, since a machine left idle 30 s is given back and the
# next call starts a bare one) and the 30 s a machine idles warm after a call. The GPU machine has no network, a cold
# Triton cache, no build of csrc/. Each call is one `run` of this script with timeout_s = budget + 30 s (the
# `timeout -k 15` grace of the last step, the last pack):
#
#   call  budget  timeout_s  steps, in order ([a | b]: a in the background while b runs)
#   1     420 s   450        env, install, [build | warm], decisive, sanitizer
#   2     480 s   510        env, install, [build | tests-triton], tests-backends
#   3     360 s   390        env, install, [build | warm], bench, ncu, inspect
#   worst case: 3 x (120 s start + 30 s idle) + 450 + 510 + 390 = 1800 s = the session's device time
#
# Steps (each capped with `timeout`, never past the call's budget; one with less time left than it needs is skipped
# and says so; `need` / `cap` in seconds):
#   env             5 / 15   nvidia-smi, clocks, versions, what the caches hold
#   install        20 / 45   pip install -e . without the extension (dorafp8.triton_kernels needs the install);
#                            skipped when dorafp8 already imports from this checkout (a warm machine)
#   build          60 / 240  background: the CUDA extension for this GPU's arch only, in $GPU_CACHE; reused when an
#                            earlier call on this machine built it from the same sources (a key of them)
#   warm           30 / 150  background, beside the build: the EXACT Triton compiles of the benchmark that follows,
#                            run.py --compile-only on the same preset (every case called once, untimed) in WARM_JOBS
#                            parallel shards, plus the sanitizer's Triton tests run plainly (call 1). Autotuning is
#                            not cached here (TRITON_CACHE_AUTOTUNING=0): processes sharing the GPU would pick configs
#                            on contended timings; the timed run autotunes alone, on compiled kernels. Its cap leaves
#                            the benchmark after it its whole cap (and, in call 1, the sanitizer its 30 s minimum).
#   decisive       60 / 150  run.py --preset decisive (bench/_cases.py: 24 cases at 4096x4096, r 16, bf16): after
#                            warm, and after the build unless waiting would cut the benchmark's cap (noted then)
#   sanitizer      30 / 60   each: memcheck then racecheck on the CUDA kernels' tests, then on the Triton kernels'
#   tests-triton   45 / 290  tests/kernels/test_triton_kernels.py (pytest-xdist), beside the build
#   tests-backends 30 / 165  after the build: test_cuda (DORAFP8_REQUIRE_CUDA_EXT=1), test_ops, test_cublas, test_w8a8,
#                            test_zero_rows, test_native_backend: the files whose cases change on a GPU
#   bench          60 / 165  run.py --preset headline --exclude-preset decisive: the headline cases call 1 did not run
#   ncu            60 / 150  NCU=1 (default): the slowest dorafp8 kernel of one call, profiled alone
#   inspect        30 / 120  python -m dorafp8.kernel_report --json (static: registers, spills, mma kind)
#
# Caches live in $GPU_CACHE (default bench_out/gpu_cache, git-ignored, inside the checkout: a warm machine keeps a
# checkout's ignored files between calls): Triton's (TRITON_CACHE_DIR), the extension's build. Nothing assumes they
# survive: a bare machine rebuilds, a warm one reuses.
#
# Saving as it goes: everything is written into a staging folder (STAGE); every 2 s the small files (summary.md,
# session.log, each benchmark's results.json / .md) are copied into $OUT when they changed, so a benchmark's
# results are there within seconds of run.py saving them (after every case); every 20 s and after each step the
# whole folder is packed into $OUT/session.tar.gz. $OUT (default bench_out/gpu_session) gets at most 7 files, within
# the device tool's 8: session.tar.gz, summary.md, session.log, {decisive,bench}_results.{json,md}.
set -u
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$SELF")/.." || exit 2
CALL=${1:-${CALL:-1}}
DRY=${DRY_RUN:-0}

# ----------------------------------------------------------------------------------------------------------- plan
PLAN_STEPS=([1]="env install build warm decisive sanitizer"
            [2]="env install build tests-triton tests-backends"
            [3]="env install build warm bench ncu inspect")
PLAN_BUDGET=([1]=420 [2]=480 [3]=360)
TIMEOUT_MARGIN_S=30    # the device call's timeout_s = budget + this
KILL_GRACE_S=15        # timeout -k: SIGINT first (pytest prints its summary), KILL this much later
CALL_LIMIT_S=600       # the device tool's limit on one command
SESSION_LIMIT_S=1800   # a session's device time
START_ALLOW_S=120      # a machine's start, allowed for every call
IDLE_ALLOW_S=30        # the idle time a warm machine is held after a call
declare -A NEED=([env]=5 [install]=20 [build]=60 [warm]=30 [decisive]=60 [sanitizer]=30 [tests-triton]=45
                 [tests-backends]=30 [bench]=60 [ncu]=60 [inspect]=30)
declare -A CAP=([env]=15 [install]=45 [build]=240 [warm]=150 [decisive]=150 [sanitizer]=60 [tests-triton]=290
                [tests-backends]=165 [bench]=165 [ncu]=150 [inspect]=120)
# PREDICTIONS (no GPU has run this yet): how long each step should take on an H100 with a cold Triton cache, from
# the build's ~70 s of CPU on this project's CPU machine, ~1-2 s per Triton compile and the case counts (bench/README.md).
# DRY_RUN=1 PREDICT=1 prints the plan with these instead of the caps; a real run never reads them.
declare -A PRED=([env]=5 [install]=15 [build]=100 [warm]=90 [decisive]=60 [sanitizer]=40 [tests-triton]=290
                 [tests-backends]=100 [bench]=150 [ncu]=90 [inspect]=100)
# Kept free after a benchmark step even in the worst case, so that the step after it gets its minimum: the
# sanitizer (call 1's other mandate); call 3's ncu and inspect only get what its benchmark leaves.
declare -A RESERVE=([decisive]=30 [bench]=0)

if [ "$CALL" = all ]; then
  [ "$DRY" = 1 ] || { echo "gpu_session.sh all: only with DRY_RUN=1 (a real session is one call at a time)" >&2; exit 2; }
  total=0
  for c in 1 2 3; do
    DRY_RUN=1 STEPS="" BUDGET_S="" PREDICT="${PREDICT:-0}" bash "$SELF" "$c" || exit 1
    total=$((total + PLAN_BUDGET[c] + TIMEOUT_MARGIN_S))
  done
  echo "session calls=3 sum_timeout_s=$total start_allowance_s=$START_ALLOW_S idle_allowance_s=$IDLE_ALLOW_S" \
       "worst_case_s=$((total + 3 * (START_ALLOW_S + IDLE_ALLOW_S))) device_budget_s=$SESSION_LIMIT_S" \
       "per_call_limit_s=$CALL_LIMIT_S"
  exit 0
fi
case "$CALL" in 1|2|3) ;; *) echo "gpu_session.sh: CALL must be 1, 2, 3 (or all with DRY_RUN=1), got '$CALL'" >&2
                              exit 2 ;; esac
BUDGET_S=${BUDGET_S:-${PLAN_BUDGET[$CALL]}}
STEPS=${STEPS:-${PLAN_STEPS[$CALL]}}
START=$(date +%s)
DEADLINE=$((START + BUDGET_S))

NCU=${NCU:-1}
PY=${PYTHON:-python3}
JOBS=${JOBS:-8}              # pytest-xdist workers
WARM_JOBS=${WARM_JOBS:-5}    # warm-up shards (the decisive preset has 5 dorafp8 (provider, dropout) pairs)
DECISIVE_WARMUP_MS=${DECISIVE_WARMUP_MS:-25}   # do_bench warm-up / repetition times (ms): run.py's defaults for
DECISIVE_REP_MS=${DECISIVE_REP_MS:-100}        # the 24 decisive cases, shorter for the 136 others
WARMUP_MS=${WARMUP_MS:-20}
REP_MS=${REP_MS:-60}
GPU_CACHE=${GPU_CACHE:-$PWD/bench_out/gpu_cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$GPU_CACHE/triton}
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg PY
SEL_CUDA=${SANITIZER_K_CUDA:-"M37-K50-N70-r3 and float16 and not bfloat16"}
SEL_TRITON=${SANITIZER_K_TRITON:-"cuda and M37-K50-N70-r3 and float16 and not bfloat16 and tensor and (not w8a8 or nodrop)"}
GPU_TEST_FILES="tests/kernels/test_cuda.py tests/ops/test_ops.py tests/kernels/test_cublas.py tests/kernels/test_w8a8.py
 tests/kernels/test_zero_rows.py tests/kernels/test_native_backend.py"
DECISIVE_ARGS=(--preset decisive)
BENCH_PRESET_ARGS=(--preset headline --exclude-preset decisive)

if [ "$DRY" = 1 ]; then
  OUT=${OUT:-bench_out/gpu_session}; STAGE=${STAGE:-/tmp/dorafp8_gpu_session.DRY/session-call$CALL}
  CC=${DRY_CC:-90}
else
  OUT=${OUT:-bench_out/gpu_session}
  mkdir -p "$OUT" "$GPU_CACHE" "$TRITON_CACHE_DIR"
  OUT=$(cd "$OUT" && pwd)
  STAGE=${STAGE:-$(mktemp -d /tmp/dorafp8_gpu_session.XXXXXX)/session-call$CALL}
  mkdir -p "$STAGE"
  CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')
fi
ARCH=${DORAFP8_CUDA_ARCHS:-$([ "${CC:0:1}" = "9" ] && echo "${CC}a" || echo "${CC:-90a}")}
BUILD_CMD=(env DORAFP8_FORCE_CUDA_BUILD=1 DORAFP8_CUDA_ARCHS="$ARCH" MAX_JOBS="${MAX_JOBS:-4}"
           CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" "$PY" setup.py build_ext --build-lib "$GPU_CACHE/buildlib"
           --build-temp "$GPU_CACHE/buildtmp")

# ------------------------------------------------------------------------------------------------------ machinery
VT=0                     # dry run: the worst-case clock, every step taking its whole cap (PREDICT=1: its prediction)
PREDICT=${PREDICT:-0}
took() {  # took BASE T: how long the dry run counts a step given T seconds: T, or with PREDICT=1 its prediction
  if [ "$PREDICT" = 1 ] && [ "${PRED[$1]}" -lt "$2" ]; then echo "${PRED[$1]}"; else echo "$2"; fi
}
now_s() { if [ "$DRY" = 1 ]; then echo $((START + VT)); else date +%s; fi; }
left() { echo $((DEADLINE - $(now_s))); }
# cap NEED MAX: the timeout of a step that needs at least NEED seconds and is worth at most MAX; 0 if not enough left
cap() { local l; l=$(left); if [ "$l" -lt "$1" ]; then echo 0; elif [ "$l" -lt "$2" ]; then echo "$l"; else echo "$2"; fi; }
log() { [ "$DRY" = 1 ] || echo "[$(date +%T) +$(( $(date +%s) - START ))s] $*" | tee -a "$STAGE/session.log"; }
# note STEP RC T0 TEXT: one row of summary.md
note() { [ "$DRY" = 1 ] && return; echo "| $1 | $2 | $(( $(date +%s) - $3 )) | $4 |" >> "$STAGE/summary.md"; log "$1: rc=$2 $4"; }
last_line() { grep -v '^\s*$' "$1" 2>/dev/null | tail -n 1 | cut -c1-200 | tr '|' '/'; }
has_step() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
shown() {  # the words of a command as one would type them: quoted where they hold anything but plain characters
  local w out=""
  for w in "$@"; do
    if [[ $w =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then out+="$w "; else out+="'$w' "; fi
  done
  echo "${out% }"
}
# plan NAME CAP_GOT MODE CMD...: the dry run's line for a step (what it would run, when, for how long at most)
plan() {
  local name=$1 got=$2 mode=$3 base=${1%%\[*}; shift 3
  echo "step call=$CALL name=$name start=$VT need=${NEED[$base]} cap=${CAP[$base]} gets=$got mode=$mode :: $*"
}
# run_to T LOG CMD...: CMD with a timeout (SIGINT first, KILL_GRACE_S later). While it runs, a file named by its pid
# sits in PIDDIR, for stopping it early (kill_pids) and for the exit trap; only running commands are listed, so that
# no pid the system has since given to another process is ever signalled.
PIDDIR=$STAGE/.pids/main
run_to() {
  local t=$1 f=$2 pid rc; shift 2
  timeout -s INT -k "$KILL_GRACE_S" "$t" "$@" > "$f" 2>&1 &
  pid=$!; touch "$PIDDIR/$pid"
  wait "$pid"; rc=$?
  rm -f "$PIDDIR/$pid"
  return $rc
}
# fg NAME LOG CMD...: the step in the foreground, capped; sets T (0: skipped) and RC
fg() {
  local name=$1 log=$2 base=${1%%\[*}; shift 2
  T=$(cap "${NEED[$base]}" "${CAP[$base]}")
  if [ "$DRY" = 1 ]; then plan "$name" "$T" fg "$(shown "$@")"; VT=$((VT + $(took "$base" "$T"))); RC=0; return 0; fi
  if [ "$T" -eq 0 ]; then RC=skip; return 0; fi
  run_to "$T" "$log" "$@"; RC=$?
}
declare -A BG_PID BG_END BG_T0
# bg NAME T DESCRIPTION FUNCTION ARGS...: FUNCTION ARGS in a background subshell (T: its cap, passed to it)
bg() {
  local name=$1 t=$2 what=$3; shift 3
  BG_T0[$name]=$(now_s)
  if [ "$DRY" = 1 ]; then plan "$name" "$t" background "$what"; BG_END[$name]=$((VT + $(took "$name" "$t"))); return 0; fi
  ( "$@" "$t" ) &
  BG_PID[$name]=$!
}
# join NAME UNTIL: wait for background step NAME, but not past epoch UNTIL; returns 0 if it has finished
join() {
  local name=$1 until=$2 pid
  if [ "$DRY" = 1 ]; then
    [ -n "${BG_END[$name]:-}" ] || return 0
    local end=${BG_END[$name]} lim=$((until - START))
    [ "$end" -gt "$lim" ] && end=$lim
    [ "$end" -gt "$VT" ] && VT=$end
    return 0
  fi
  pid=${BG_PID[$name]:-}
  [ -n "$pid" ] || return 0
  while kill -0 "$pid" 2>/dev/null && [ "$(date +%s)" -lt "$until" ]; do sleep 1; done
  if kill -0 "$pid" 2>/dev/null; then return 1; fi
  wait "$pid" 2>/dev/null
  return 0
}
kill_pids() {  # kill_pids FILE...: the running timeout processes these pid files name (timeout passes the signal on)
  local f
  for f in "$@"; do [ -f "$f" ] && kill "$(basename "$f")" 2>/dev/null; done
}

# ----------------------------------------------------------------------------------------------------------- pack
PACK_FILES="decisive bench"   # the benchmarks whose results.json / .md go into $OUT as <name>_results.*
# cp_new SRC DST [force]: copy when SRC is newer (or always, with force: a rewrite within the clock's resolution
# looks no newer), through a temporary name, so that whoever reads DST never sees half a file
cp_new() {
  [ -f "$1" ] || return 0
  [ -z "${3:-}" ] && [ -f "$2" ] && ! [ "$1" -nt "$2" ] && return 0
  cp -f "$1" "$2.tmp.$BASHPID" && mv -f "$2.tmp.$BASHPID" "$2"
}
quick_pack() {  # quick_pack [force]
  cp_new "$STAGE/summary.md" "$OUT/summary.md" "${1:-}"
  cp_new "$STAGE/session.log" "$OUT/session.log" "${1:-}"
  local r
  for r in $PACK_FILES; do
    cp_new "$STAGE/$r/results.json" "$OUT/${r}_results.json" "${1:-}"
    cp_new "$STAGE/$r/results.md" "$OUT/${r}_results.md" "${1:-}"
  done
}
pack() {
  [ "$DRY" = 1 ] && return 0
  quick_pack force
  local tmp="/tmp/.dorafp8_session_pack.$BASHPID.tar.gz"
  # tar exits 1 when a file changed while it was read (a log being written): the archive is still good
  tar czf "$tmp" --exclude='.pids' -C "$(dirname "$STAGE")" "$(basename "$STAGE")" 2>/dev/null
  [ -s "$tmp" ] && mv -f "$tmp" "$OUT/session.tar.gz"
}

if [ "$DRY" = 1 ]; then
  echo "plan call=$CALL budget=$BUDGET_S timeout_s=$((BUDGET_S + TIMEOUT_MARGIN_S)) kill_grace_s=$KILL_GRACE_S" \
       "clock=$([ "$PREDICT" = 1 ] && echo predicted || echo worst-case) steps=\"$STEPS\""
else
  { echo "| step | rc | seconds | outcome |"; echo "|---|---|---|---|"; } > "$STAGE/summary.md"
  mkdir -p "$STAGE/.pids/main" "$STAGE/.pids/warm"
  # this call's plan, with its own paths and settings, for the record
  DRY_RUN=1 STEPS="$STEPS" BUDGET_S="$BUDGET_S" STAGE="$STAGE" OUT="$OUT" GPU_CACHE="$GPU_CACHE" NCU="$NCU" \
    DORAFP8_CUDA_ARCHS="$ARCH" bash "$SELF" "$CALL" > "$STAGE/plan.txt" 2>&1
  ( n=0; while sleep 2; do quick_pack; n=$((n + 1)); [ $((n % 10)) -eq 0 ] && pack; done ) &
  PACKER=$!
  trap 'kill $PACKER 2>/dev/null; kill_pids "$STAGE"/.pids/*/*; pack' EXIT
fi
XDIST=""; PTIMEOUT=""
if [ "$DRY" != 1 ]; then
  # pytest plugins where installed: xdist spreads test files over workers (compile-bound, 16 cores), pytest-timeout
  # stops one hanging test
  $PY -c "import xdist" 2>/dev/null && XDIST="-n $JOBS"
  $PY -c "import pytest_timeout" 2>/dev/null && PTIMEOUT="--timeout"
fi
log "gpu_session call $CALL: steps [$STEPS], budget ${BUDGET_S}s, stage $STAGE, out $OUT, cache $GPU_CACHE"

# ---------------------------------------------------------------------------------------------------------- steps
env_report() {  # the machine, the versions, what the caches hold (exported: run by `bash -c` under timeout)
  nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,clocks.max.sm,clocks.max.mem,power.limit \
    --format=csv
  nvidia-smi -q -d CLOCK,PERFORMANCE 2>/dev/null | sed -n '1,80p'
  $PY -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  $PY -c "import peft, transformers; print('peft', peft.__version__, 'transformers', transformers.__version__)" 2>&1
  command -v nvcc >/dev/null && nvcc --version | tail -n 2
  command -v ncu >/dev/null && ncu --version | tail -n 1
  command -v compute-sanitizer >/dev/null && compute-sanitizer --version | tail -n 1
  echo "commit ${DORAFP8_COMMIT:-unknown (set DORAFP8_COMMIT)}"
  echo "triton cache $TRITON_CACHE_DIR: $(find "$TRITON_CACHE_DIR" -type f 2>/dev/null | wc -l) files from earlier calls"
}
export -f env_report
step_env() {
  local t0; t0=$(date +%s)
  fg env "$STAGE/device.txt" bash -c env_report
  [ "$DRY" = 1 ] || note env "$RC" "$t0" "$(sed -n 2p "$STAGE/device.txt" | tr '|' '/'); $(tail -n 1 "$STAGE/device.txt")"
}

step_install() {
  local t0 here; t0=$(date +%s)
  if [ "$DRY" != 1 ]; then
    # installed as dorafp8.triton_kernels from this checkout's triton_kernels/ (setup.py's package_dir)?
    here=$(cd /tmp && $PY -c "import os, dorafp8.triton_kernels as k; print(os.path.dirname(os.path.dirname(os.path.realpath(k.__file__))))" 2>/dev/null)
    if [ "$here" = "$(pwd -P)" ]; then note install 0 "$t0" "already installed from this checkout (a warm machine)"; return; fi
  fi
  fg install "$STAGE/install.log" env DORAFP8_SKIP_CUDA_BUILD=1 "$PY" -m pip install -e . --no-build-isolation --no-deps
  [ "$DRY" = 1 ] || note install "$RC" "$t0" "$(last_line "$STAGE/install.log")"
}

build_key() {  # what the extension is built from and for
  { cat setup.py; find csrc -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.cpp' -o -name '*.py' \) \
      -print0 | sort -z | xargs -0 cat; echo "$ARCH"
    $PY -c "import torch; print(torch.__version__, torch.version.cuda)"; nvcc --version 2>/dev/null | tail -n 1
  } | sha256sum | cut -c1-16
}
build_job() {  # build_job T: the extension into $GPU_CACHE/lib (or reused from there), then renamed into dorafp8/
  local T=$1 key so rc=0
  key=$(build_key)
  so=$(compgen -G "$GPU_CACHE/lib/_C*.so" | head -n 1)
  if [ -n "$so" ] && [ "$(cat "$GPU_CACHE/lib/build.key" 2>/dev/null)" = "$key" ]; then
    echo "reused $(basename "$so") (key $key): an earlier call on this machine built it from the same sources" \
      > "$STAGE/build.log"
  else
    rm -rf "${GPU_CACHE:?}/lib"
    run_to "$T" "$STAGE/build.log" "${BUILD_CMD[@]}"; rc=$?
    so=$(compgen -G "$GPU_CACHE/buildlib/dorafp8/_C*.so" | head -n 1)
    if [ $rc -eq 0 ] && [ -n "$so" ]; then
      mkdir -p "$GPU_CACHE/lib"
      cp -f "$so" "$GPU_CACHE/lib/" && cp -f "$GPU_CACHE/buildlib/dorafp8/_build_info.json" "$GPU_CACHE/lib/" 2>/dev/null
      echo "$key" > "$GPU_CACHE/lib/build.key"
      so="$GPU_CACHE/lib/$(basename "$so")"
    elif [ $rc -eq 0 ]; then rc=8; echo "build_ext made no _C*.so" >> "$STAGE/build.log"; fi
  fi
  if [ $rc -eq 0 ]; then
    # renamed into the package in one step: processes importing dorafp8 meanwhile never load a half-copied .so
    cp -f "$so" dorafp8/.incoming_C.so && mv -f dorafp8/.incoming_C.so "dorafp8/$(basename "$so")"
    cp -f "$GPU_CACHE/lib/_build_info.json" dorafp8/_build_info.json 2>/dev/null
    cp -f dorafp8/_build_info.json "$STAGE/build_info.json" 2>/dev/null
  fi
  echo $rc > "$STAGE/build.rc"
}
step_build() {
  local t; t=$(cap "${NEED[build]}" "${CAP[build]}")
  if [ "$t" -eq 0 ]; then [ "$DRY" = 1 ] && plan build 0 background "(not enough time left)"
                          note build skip "$(date +%s)" "not enough time left"; return; fi
  log "build: the CUDA extension for sm_$ARCH, in the background"
  bg build "$t" \
     "reuse $GPU_CACHE/lib/_C*.so if build.key matches, else ${BUILD_CMD[*]}; then renamed into dorafp8/" build_job
}
# build_done UNTIL: wait for the build until epoch UNTIL, then one summary row. Returns 0: the extension is in place;
# 1: the build failed; 2: it still runs; 3: no build was started in this call
build_done() {
  local t0=${BG_T0[build]:-}
  [ -n "$t0" ] || return 3
  if ! join build "$1"; then log "build: still running, going on without waiting"; return 2; fi
  [ "$DRY" = 1 ] && return 0
  if [ -z "${BUILD_NOTED:-}" ]; then
    BUILD_NOTED=1
    local rc ok
    rc=$(cat "$STAGE/build.rc" 2>/dev/null || echo "?")
    ok=$($PY -c "import dorafp8.backends.cuda as c, torch; print(c.unavailable_reason(torch.device('cuda')) or 'dorafp8._C imports and runs here')" 2>&1 | tail -n 1)
    note build "$rc" "$t0" "sm_$ARCH: $(last_line "$STAGE/build.log" | cut -c1-120); $ok"
  fi
  [ "$(cat "$STAGE/build.rc" 2>/dev/null)" = 0 ] || return 1
}

# warm_job T ARGS...: the compile-only shards of a benchmark (and the sanitizer's Triton tests) in parallel
warm_job() {
  local T=${!#} i pids=() rc=0
  local args=("${@:1:$#-1}")
  PIDDIR=$STAGE/.pids/warm
  mkdir -p "$STAGE/warm"
  for ((i = 0; i < WARM_JOBS; i++)); do
    run_to "$T" "$STAGE/warm/shard$i.log" env TRITON_CACHE_AUTOTUNING=0 "$PY" bench/run.py "${args[@]}" \
      --compile-only --shard "$i/$WARM_JOBS" --device cuda --out "$STAGE/warm/shard$i" &
    pids+=($!)
  done
  if has_step sanitizer; then
    run_to "$T" "$STAGE/warm/sanitizer_tests.log" env TRITON_CACHE_AUTOTUNING=0 "$PY" -m pytest -q -p no:cacheprovider \
      -rfE tests/kernels/test_triton_kernels.py -k "$SEL_TRITON" &
    pids+=($!)
  fi
  for i in "${pids[@]}"; do wait "$i" || rc=$?; done
  echo $rc > "$STAGE/warm.rc"
}
step_warm() {  # warms the compiles of the benchmark step that follows it in STEPS
  local args target
  if has_step decisive; then target=decisive; args=("${DECISIVE_ARGS[@]}")
  elif has_step bench; then target=bench; args=("${BENCH_PRESET_ARGS[@]}")
  else log "warm: no benchmark step in this call, nothing to warm"; return; fi
  local t
  # never into the time the benchmark after it is guaranteed: at most (time left - that step's cap - its reserve)
  t=$(( $(left) - CAP[$target] - RESERVE[$target] ))
  [ "$t" -gt "${CAP[warm]}" ] && t=${CAP[warm]}
  if [ "$t" -lt "${NEED[warm]}" ]; then
    [ "$DRY" = 1 ] && plan warm 0 background "(not enough time left)"
    note warm skip "$(date +%s)" "not enough time left"; return
  fi
  WARM_TARGET=$target
  local i
  if [ "$DRY" = 1 ]; then
    for ((i = 0; i < WARM_JOBS; i++)); do
      plan "warm[$i/$WARM_JOBS]" "$t" background "$(shown env TRITON_CACHE_AUTOTUNING=0 "$PY" bench/run.py "${args[@]}" \
        --compile-only --shard "$i/$WARM_JOBS" --device cuda --out "$STAGE/warm/shard$i")"
    done
    has_step sanitizer && plan "warm[sanitizer]" "$t" background "$(shown env TRITON_CACHE_AUTOTUNING=0 "$PY" -m pytest \
      -q -p no:cacheprovider -rfE tests/kernels/test_triton_kernels.py -k "$SEL_TRITON")"
    BG_END[warm]=$((VT + $(took warm "$t"))); BG_T0[warm]=$(now_s)
    return
  fi
  log "warm: $WARM_JOBS compile-only shards of run.py ${args[*]}$(has_step sanitizer && echo ' + the sanitizer Triton tests'), cap ${t}s"
  bg warm "$t" "" warm_job "${args[@]}"
}
warm_done() {  # warm_done UNTIL: wait for warm until epoch UNTIL, then stop what is left of it; one summary row
  [ -n "${BG_T0[warm]:-}" ] || return 0
  if ! join warm "$1"; then log "warm: past its time, stopping it"; kill_pids "$STAGE"/.pids/warm/*; sleep 1; fi
  [ "$DRY" = 1 ] && return 0
  local shards n
  shards=$(grep -h "cases compiled or skipped" "$STAGE"/warm/shard*.log 2>/dev/null | cut -d' ' -f1 | tr '\n' ' ')
  n=$(find "$TRITON_CACHE_DIR" -name '*.cubin' 2>/dev/null | wc -l)
  local tests=""
  [ -f "$STAGE/warm/sanitizer_tests.log" ] && tests="; the sanitizer's Triton tests, plainly: $(last_line "$STAGE/warm/sanitizer_tests.log" | cut -c1-80)"
  note warm "$(cat "$STAGE/warm.rc" 2>/dev/null || echo killed)" "${BG_T0[warm]}" \
    "shards compiled [${shards}] of ${WARM_TARGET}; $n cubins in the Triton cache$tests"
}

# bench_step NAME OUTDIR ARGS...: a timed run.py after warm and the build, packed the moment it ends
bench_step() {
  local name=$1 dir=$2 t0 until ran_beside=""; shift 2
  # wait no later than the point from which this step still gets its whole cap, and the step after it its reserve
  until=$((DEADLINE - CAP[$name] - RESERVE[$name]))
  warm_done "$until"
  build_done "$until"
  [ $? -eq 2 ] && ran_beside="; the build was still running beside it (CPU contention)"
  t0=$(date +%s)
  # autotuning cached on disk (on a quiet GPU): later processes (call 3's benchmark) reuse what this one picked
  # shellcheck disable=SC2086  # BENCH_ARGS: extra run.py options, a word list
  fg "$name" "$STAGE/$name.log" env TRITON_CACHE_AUTOTUNING=1 "$PY" bench/run.py "$@" --device cuda \
    --out "$STAGE/$dir" ${BENCH_ARGS:-}
  [ "$DRY" = 1 ] && return
  if [ "$RC" = skip ]; then note "$name" skip "$t0" "not enough time left"; return; fi
  local msg
  msg=$(grep -E 'cases measured' "$STAGE/$name.log" | tail -n 1 | sed 's/; wrote.*//' | cut -c1-160)
  if [ "$RC" -ne 0 ] && [ -f "$STAGE/$dir/results.json" ]; then  # cut short or failed: draw what was measured
    local count='import json, sys; r = json.load(open(sys.argv[1]))["records"]
print(sum(x["status"] == "ok" for x in r), "measured of", len(r), "recorded")'
    msg="stopped (rc $RC) after $($PY -c "$count" "$STAGE/$dir/results.json" 2>&1 | tail -n 1)"
    $PY bench/plot.py "$STAGE/$dir/results.json" >> "$STAGE/$name.log" 2>&1
  fi
  note "$name" "$RC" "$t0" "${msg:-$(last_line "$STAGE/$name.log")}$ran_beside"
  pack
}

step_sanitizer() {
  local tool what t0 sel file req
  if [ "$DRY" != 1 ] && ! command -v compute-sanitizer >/dev/null; then
    note sanitizer skip "$(date +%s)" "compute-sanitizer not found"; return
  fi
  build_done $((DEADLINE - NEED[sanitizer])) || log "sanitizer: no CUDA extension; its CUDA tests fail (DORAFP8_REQUIRE_CUDA_EXT=1)"
  # One small odd shape (ragged tiles, strided activations) in fp16. PYTORCH_NO_CUDA_MEMORY_CACHING=1: one cudaMalloc
  # per tensor, so that memcheck sees a write past a tensor's end (inside the caching allocator's pooled blocks it
  # would not). The CUDA kernels first (38 tests: every kernel, both scale kinds, every mode), then the Triton ones
  # (12: forward, dgrad, backward pass, norm; W8A16 per-tensor, W8A8 without dropout; compiled by `warm` in call 1).
  # DORAFP8_REQUIRE_CUDA_EXT=1: a missing extension fails the CUDA tests instead of skipping them (and passing).
  for what in cuda triton; do
    if [ $what = cuda ]; then file=tests/kernels/test_cuda.py; sel=$SEL_CUDA; req=DORAFP8_REQUIRE_CUDA_EXT=1
    else file=tests/kernels/test_triton_kernels.py; sel=$SEL_TRITON; req=TRITON_CACHE_AUTOTUNING=0; fi
    for tool in memcheck racecheck; do
      t0=$(date +%s)
      fg "sanitizer[$tool-$what]" "$STAGE/sanitizer_${tool}_$what.log" env DORAFP8_POISON=1 "$req" \
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool $tool --error-exitcode 9 \
        --print-limit 50 "$PY" -m pytest -q -p no:cacheprovider -rfE "$file" -k "$sel"
      [ "$DRY" = 1 ] && continue
      if [ "$RC" = skip ]; then note "sanitizer $tool $what" skip "$t0" "not enough time left"; continue; fi
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Program hit|passed|failed|error|no tests ran" \
        "$STAGE/sanitizer_${tool}_$what.log" | tail -n 4 > "$STAGE/sanitizer_${tool}_${what}_summary.txt"
      note "sanitizer $tool $what" "$RC" "$t0" \
        "$(tr '\n' ';' < "$STAGE/sanitizer_${tool}_${what}_summary.txt" | cut -c1-200 | tr '|' '/')"
    done
  done
  pack
}

tests_summary() {
  grep -hE "^(FAILED|ERROR) |passed|failed|left out" "$STAGE"/tests_*.log 2>/dev/null | cut -c1-300 \
    > "$STAGE/tests_summary.txt"
}
step_tests_triton() {  # beside the build: these need no extension
  local t0; t0=$(date +%s)
  # shellcheck disable=SC2086  # XDIST and PTIMEOUT are word lists
  fg tests-triton "$STAGE/tests_triton.log" env TRITON_CACHE_AUTOTUNING=0 "$PY" -m pytest \
    tests/kernels/test_triton_kernels.py -q -p no:cacheprovider $XDIST -rfE ${PTIMEOUT:+--timeout 180} \
    --junitxml "$STAGE/tests_triton.xml"
  [ "$DRY" = 1 ] && return
  note tests-triton "$RC" "$t0" "test_triton_kernels.py (cap ${T}s): $(last_line "$STAGE/tests_triton.log")"
  tests_summary; pack
}
step_tests_backends() {  # after the build: conftest lists the backends that run when pytest starts
  local t0
  build_done $((DEADLINE - NEED[tests-backends])) ||
    log "tests-backends: no CUDA extension; test_cuda fails (DORAFP8_REQUIRE_CUDA_EXT=1)"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  fg tests-backends "$STAGE/tests_backends.log" env TRITON_CACHE_AUTOTUNING=0 DORAFP8_REQUIRE_CUDA_EXT=1 "$PY" -m pytest \
    $GPU_TEST_FILES -q -p no:cacheprovider $XDIST -rfE ${PTIMEOUT:+--timeout 120} --junitxml "$STAGE/tests_backends.xml"
  [ "$DRY" = 1 ] && return
  note tests-backends "$RC" "$t0" "cuda, ops, cublas, w8a8, zero_rows, native: $(last_line "$STAGE/tests_backends.log")"
  tests_summary; pack
}

step_ncu() {
  local t0 kernel; t0=$(date +%s)
  if [ "$NCU" != 1 ]; then log "ncu: NCU=$NCU, not run"; return; fi
  if [ "$DRY" != 1 ] && ! command -v ncu >/dev/null; then note ncu skip "$t0" "ncu not found"; return; fi
  [ "$DRY" = 1 ] || mkdir -p "$STAGE/ncu"
  fg ncu "$STAGE/ncu/find.log" "$PY" bench/ncu_profile.py find --json "$STAGE/ncu/kernels.json"
  [ "$DRY" = 1 ] && { plan "ncu[profile]" "$T" part "ncu --profile-from-start off --clock-control none --kernel-name" \
    "regex:^SLOWEST\$ --launch-count 1 --set full -o $STAGE/ncu/profile $PY bench/ncu_profile.py run (what find left)"; return; }
  [ "$RC" = skip ] && { note ncu skip "$t0" "not enough time left"; return; }
  kernel=${NCU_KERNEL:-$($PY -c "import json; print(json.load(open('$STAGE/ncu/kernels.json'))['slowest'] or '')" 2>/dev/null)}
  if [ -z "$kernel" ]; then note ncu 1 "$t0" "no dorafp8 kernel found (see ncu/find.log)"; return; fi
  local t; t=$(cap 30 $(( CAP[ncu] - ($(date +%s) - t0) )))
  [ "$t" -gt 0 ] || { note ncu skip "$t0" "found $kernel; no time left to profile it"; return; }
  # --clock-control none: the card as it runs (its clocks untouched); --set full: every section
  run_to "$t" "$STAGE/ncu/ncu.log" ncu --profile-from-start off --clock-control none --kernel-name "regex:^${kernel}\$" \
    --launch-count 1 --set full -f -o "$STAGE/ncu/profile" "$PY" bench/ncu_profile.py run
  RC=$?
  if [ -f "$STAGE/ncu/profile.ncu-rep" ]; then
    ncu -i "$STAGE/ncu/profile.ncu-rep" --page details > "$STAGE/ncu/details.txt" 2>&1
    ncu -i "$STAGE/ncu/profile.ncu-rep" --page raw --csv > "$STAGE/ncu/raw.csv" 2>&1
    $PY bench/ncu_profile.py summarize "$STAGE/ncu/raw.csv" > "$STAGE/ncu/summary.txt" 2>&1
  fi
  note ncu "$RC" "$t0" "kernel $kernel: $(grep -m1 'gpu__time_duration' "$STAGE/ncu/summary.txt" 2>/dev/null | tr -s ' ' | tr '|' '/')"
  pack
}

step_inspect() {
  local t0; t0=$(date +%s)
  fg inspect "$STAGE/inspect.json" "$PY" -m dorafp8.kernel_report --json --arch "sm_$ARCH" --jobs 12
  [ "$DRY" = 1 ] && return
  if [ "$RC" = skip ]; then note inspect skip "$t0" "not enough time left"; return; fi
  note inspect "$RC" "$t0" "python -m dorafp8.kernel_report --arch sm_$ARCH -> inspect.json ($(wc -c < "$STAGE/inspect.json") bytes)"
  pack
}

# ------------------------------------------------------------------------------------------------------------ run
for step in $STEPS; do
  case $step in
    env) step_env ;;
    install) step_install ;;
    build) step_build ;;
    warm) step_warm ;;
    decisive) bench_step decisive decisive "${DECISIVE_ARGS[@]}" --warmup "$DECISIVE_WARMUP_MS" --rep "$DECISIVE_REP_MS" ;;
    sanitizer) step_sanitizer ;;
    tests-triton) step_tests_triton ;;
    tests-backends) step_tests_backends ;;
    bench) bench_step bench bench "${BENCH_PRESET_ARGS[@]}" --warmup "$WARMUP_MS" --rep "$REP_MS" ;;
    ncu) step_ncu ;;
    inspect) step_inspect ;;
    *) echo "gpu_session.sh: unknown step '$step' in STEPS" >&2; exit 2 ;;
  esac
done
[ -n "${BG_T0[build]:-}" ] && build_done "$DEADLINE" >/dev/null   # a build nothing waited for still gets its row
if [ "$DRY" = 1 ]; then
  echo "end call=$CALL $([ "$PREDICT" = 1 ] && echo predicted_s || echo worst_case_s)=$VT budget=$BUDGET_S"
  exit 0
fi
log "gpu_session call $CALL done in $(( $(date +%s) - START ))s; results in $OUT (session.tar.gz: everything)"
cat "$STAGE/summary.md"
