#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Everything to run on the GPU machine, from the repository root:
#
#   source .device/env.sh && bench/run_gpu.sh
#
# 1. configure (preset cuda, sm_90a) and build everything;
# 2. the GPU tests (ctest -L gpu), then the host tests (ctest -LE gpu);
# 3. compute-sanitizer memcheck and racecheck on each GPU test executable, one rank (skipped when
#    compute-sanitizer is missing);
# 4. every bench_* binary, JSON into the results folder;
# 5. the PyTorch peers (bench/peers/*.py) when python3 can import torch;
# 6. bench/plot.py over the results (PNG files; skipped without matplotlib), and
#    bench/mla_table.py: the MLA decode table and floor check (mla_decode_table.md).
# Results and one log per step go to "${OUT:-bench/results}" (run_gpu.log has everything). Every
# step runs even after an earlier one failed; the exit status is non-zero if any step failed.
# A summary table is printed last.
#
# Knobs (environment):
#   RUN_GPU_STEPS      stages to run, default "configure build test sanitize bench peers plot"; e.g.
#                      split one long session in two commands: "configure build test", then
#                      "sanitize bench peers plot" (the build folder stays between them)
#   SANITIZE_FILTER    regex on the GPU test executable names to sanitize (default: all)
#   SANITIZER_TIMEOUT  seconds per compute-sanitizer run (default 300)
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1

RESULTS="${OUT:-bench/results}"
BUILD=build/cuda
JOBS=$(nproc 2>/dev/null || echo 8)
SANITIZER_TIMEOUT=${SANITIZER_TIMEOUT:-300}
SANITIZE_FILTER=${SANITIZE_FILTER:-.}
RUN_GPU_STEPS=${RUN_GPU_STEPS:-configure build test sanitize bench peers plot}
enabled() { [[ " $RUN_GPU_STEPS " == *" $1 "* ]]; }
mkdir -p "$RESULTS"
LOG="$RESULTS/run_gpu.log"  # appended to: a session split over several commands keeps one log

names=()
states=()
seconds=()

# step <name> <command...>: runs the command, its output to the terminal, $RESULTS/<name>.log and
# run_gpu.log. Exit 0 is PASS, 77 (a test's "no GPU") SKIP, anything else FAIL.
step() {
  local name=$1
  shift
  local start rc state
  start=$(date +%s)
  echo "=== [$name] $*" | tee -a "$LOG"
  "$@" 2>&1 | tee "$RESULTS/$name.log" | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) state=PASS ;;
    77) state=SKIP ;;
    *) state="FAIL($rc)" ;;
  esac
  echo "=== [$name] $state" | tee -a "$LOG"
  names+=("$name")
  states+=("$state")
  seconds+=($(($(date +%s) - start)))
  return 0
}
# skip <name> <reason>
skip() {
  echo "=== [$1] SKIP: $2" | tee -a "$LOG"
  names+=("$1")
  states+=("SKIP")
  seconds+=(0)
}

{
  echo "===== run_gpu.sh $(date -u +%FT%TZ) on $(hostname), steps: $RUN_GPU_STEPS"
  git log -1 --oneline 2>/dev/null || true
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>/dev/null || true
  nvcc --version 2>/dev/null | tail -1 || true
} | tee -a "$LOG"

# ---- 1. build ----
if enabled configure; then step configure cmake --preset cuda -DCMAKE_CUDA_ARCHITECTURES=90a; fi
if enabled build; then step build cmake --build --preset cuda -j "$JOBS"; fi

# ---- 2. tests ----
if enabled test; then
  step ctest_gpu ctest --preset cuda -L gpu --output-on-failure
  step ctest_host ctest --preset cuda -LE gpu --output-on-failure -j "$JOBS"
fi

# ---- 3. compute-sanitizer on each GPU test executable (one rank) ----
gpu_test_executables() {
  # The executables of the single-rank gpu-labelled tests, from ctest's own listing.
  ctest --test-dir "$BUILD" -L gpu -N --show-only=json-v1 2>/dev/null | python3 -c '
import json, os, sys
seen = []
for t in json.load(sys.stdin).get("tests", []):
    if not t.get("name", "").endswith(".np1"):
        continue
    for arg in t.get("command", []):
        base = os.path.basename(arg)
        if base.startswith("test_") and os.access(arg, os.X_OK) and arg not in seen:
            seen.append(arg)
print("\n".join(seen))
' 2>/dev/null
}
if ! enabled sanitize; then
  :
elif ! command -v compute-sanitizer >/dev/null 2>&1; then
  skip sanitizers "compute-sanitizer not found"
else
  mapfile -t gpu_tests < <(gpu_test_executables)
  if [ ${#gpu_tests[@]} -eq 0 ]; then
    mapfile -t gpu_tests < <(find "$BUILD/tests" -type f -perm -u+x -name 'test_*cuda*' 2>/dev/null | sort)
  fi
  if [ ${#gpu_tests[@]} -eq 0 ]; then
    skip sanitizers "no GPU test executables found under $BUILD"
  fi
  for exe in "${gpu_tests[@]}"; do
    base=$(basename "$exe")
    [[ "$base" =~ $SANITIZE_FILTER ]] || continue
    for tool in memcheck racecheck; do
      step "${tool}_${base}" timeout "$SANITIZER_TIMEOUT" compute-sanitizer --tool "$tool" \
        --error-exitcode 1 "$exe"
    done
  done
fi

# ---- 4. benchmarks ----
benches=()
if enabled bench; then
  mapfile -t benches < <(find "$BUILD/bench" -maxdepth 1 -type f -perm -u+x -name 'bench_*' 2>/dev/null | sort)
  if [ ${#benches[@]} -eq 0 ]; then
    skip benchmarks "no bench_* binaries under $BUILD/bench"
  fi
fi
for exe in "${benches[@]}"; do
  name=$(basename "$exe")
  step "$name" "$exe" "$RESULTS/${name#bench_}.json"
done

# bench_comm and bench_step over NCCL need one MPI process per GPU: bench_comm again at the
# machine's GPU count, bench_step (the scaling figure) at every power of two up to it (its N = 1
# run is the loop above).
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if enabled bench && [ -x "$BUILD/bench/bench_comm" ] && [ "${gpus:-0}" -ge 2 ]; then
  step "bench_comm_np$gpus" mpirun -np "$gpus" "$BUILD/bench/bench_comm" "$RESULTS/comm_np$gpus.json"
fi
if enabled bench && [ -x "$BUILD/bench/bench_step" ]; then
  for ((np = 2; np <= ${gpus:-0}; np *= 2)); do
    step "bench_step_np$np" mpirun -np "$np" "$BUILD/bench/bench_step" "$RESULTS/step_np$np.json"
  done
fi

# ---- 5. PyTorch peers ----
if ! enabled peers; then
  :
elif command -v python3 >/dev/null 2>&1 && python3 -c 'import torch' >/dev/null 2>&1; then
  for peer in bench/peers/*.py; do
    [ -e "$peer" ] || continue
    name=$(basename "$peer" .py)
    step "peer_$name" python3 "$peer" "$RESULTS/$name.json"
  done
else
  skip peers "python3 with torch not available"
fi

# ---- 6. plots, and the MLA decode table with its floor check ----
if ! enabled plot; then
  :
elif command -v python3 >/dev/null 2>&1; then
  step plot python3 bench/plot.py "$RESULTS"
  if [ -f "$RESULTS/mla_decode.json" ]; then
    flash="$RESULTS/flashmla_peer.json"
    [ -f "$flash" ] || flash=/dev/null
    peer="$RESULTS/mla_decode_peer.json"
    [ -f "$peer" ] || peer=/dev/null
    step mla_table sh -c 'python3 bench/mla_table.py "$1" "$2" "$3" > "$4"' sh \
      "$RESULTS/mla_decode.json" "$flash" "$peer" "$RESULTS/mla_decode_table.md"
  fi
else
  skip plot "python3 not available"
fi

# ---- summary ----
failed=0
for state in "${states[@]}"; do
  case $state in FAIL*) failed=1 ;; esac
done
{
  echo
  echo "summary ($RESULTS)"
  printf '%-44s %-10s %7s\n' step result seconds
  for i in "${!names[@]}"; do
    printf '%-44s %-10s %7s\n' "${names[$i]}" "${states[$i]}" "${seconds[$i]}"
  done
  if [ $failed -ne 0 ]; then
    echo "run_gpu.sh: FAILED (see the step logs in $RESULTS)"
  else
    echo "run_gpu.sh: all steps passed or skipped"
  fi
} | tee -a "$LOG"
exit $failed
