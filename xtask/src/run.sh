#!/usr/bin/env bash
# The GPU bundle's runner (see docs/gpu.md). By default, inside 8 minutes
# on one H100:
#   1. environment: GPUs, driver, PCIe link (nvidia-smi), the CUDA libraries
#      bigmodel loads (bin/bigmodel devices --json);
#   2. bm-device GPU tests, then the compute tests (bm-device, bm-compute);
#   3. the model GPU tests (bm-models) and any other GPU test binary;
#   4. the bench rows: host-to-device bandwidth by size (h2d), then the
#      data path (data_path: loading a 2.2 GB bf16 checkpoint, decoding with
#      most layers streamed from CPU RAM and from disk, cold-disk streaming
#      against a direct read of the disk, each next to pinned H2D).
#   5. the compute tests again under compute-sanitizer memcheck when it is
#      installed (last, so a slow sanitizer cannot cost the bench numbers).
# With --full it then runs every other bench and the benchmark report
# against PyTorch + Accelerate (./xtask bench --prebuilt .).
#
# Every step has its own time limit, and the whole run a deadline, so one
# hung step cannot eat the machine's command limit: a step that runs out
# of time is killed and reported as TIMEOUT, later steps that no longer fit
# are SKIPPED. report.md (next to this script) gets each step's output and
# status and ends with a summary table and "result: PASS" or
# "result: FAIL (the steps that failed)"; the exit status is 0 only on PASS.
#
# Usage: ./run.sh [--full] [--no-sanitizer]
#   BM_RUN_DEADLINE  seconds for the whole run (default 470, or 1800 with --full)
#   OUT              when set (the device tool's result folder), report.md and
#                    the data-path summary are copied there at the end
set -u
cd "$(dirname "$0")"
export BM_GPU_TESTS=1
report="$PWD/report.md"
full=0
sanitizer=1
for arg in "$@"; do
  case "$arg" in
    --full) full=1 ;;
    --no-sanitizer) sanitizer=0 ;;
    --no-bench) echo "--no-bench is gone: the default run is the quick one; see --full" >&2; exit 2 ;;
    *) echo "usage: $0 [--full] [--no-sanitizer]" >&2; exit 2 ;;
  esac
done
if [ "$full" -eq 1 ]; then
  deadline=${BM_RUN_DEADLINE:-1800}
else
  deadline=${BM_RUN_DEADLINE:-470}
fi
start=$SECONDS
failed=""
summary=""

{
  echo "# bigmodel GPU bundle report"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "- host: $(uname -srm), $(nproc) CPUs"
  echo "- built from commit: $(cat commit 2>/dev/null || echo unknown)"
  echo "- run: $0 $*, deadline ${deadline}s"
} > "$report"

# note STATUS NAME SECONDS: one line of the summary table.
note() {
  summary="${summary}| $2 | $1 | $3 s |"$'\n'
  case "$1" in
    PASS|SKIPPED) ;;
    *) failed="${failed:+$failed, }$2 ($1)" ;;
  esac
}

# step NAME LIMIT CMD...: runs CMD under a limit of LIMIT seconds (less if
# the deadline is nearer), appends its output and status to the report.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$(( deadline - (SECONDS - start) ))
  if [ "$left" -lt 15 ]; then
    echo "== $name: skipped, ${left}s left of the ${deadline}s deadline"
    printf '\n## %s\n\nskipped: the run deadline (%ss) was reached\n' "$name" "$deadline" >> "$report"
    note SKIPPED "$name" 0
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s)"
  printf '\n## %s\n\n```\n' "$name" >> "$report"
  local t0=$SECONDS
  if [ "$(type -t "$1")" = function ]; then
    # timeout runs programs: a function of this script runs in a bash of its own.
    timeout --kill-after=10 "$limit" bash -c "$(declare -f "$1"); $*" 2>&1 | tee -a "$report"
  else
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$report"
  fi
  local rc=${PIPESTATUS[0]}
  local took=$(( SECONDS - t0 ))
  printf '```\n\n' >> "$report"
  if [ "$rc" -eq 0 ]; then
    echo "exit status 0 after ${took}s" >> "$report"
    note PASS "$name" "$took"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "TIMEOUT: killed after ${limit}s" >> "$report"
    note TIMEOUT "$name" "$took"
  else
    echo "FAILED: exit status $rc after ${took}s" >> "$report"
    note FAIL "$name" "$took"
  fi
}

finish() {
  {
    echo
    echo "## Summary"
    echo
    echo "| step | status | time |"
    echo "| --- | --- | --- |"
    printf '%s' "$summary"
    echo
    echo "total: $(( SECONDS - start ))s"
    echo
    if [ -z "$failed" ]; then echo "result: PASS"; else echo "result: FAIL ($failed)"; fi
  } >> "$report"
  echo "report: $report"
  if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    cp "$report" "$OUT/"
    [ -f target/data-path-summary.json ] && cp target/data-path-summary.json "$OUT/"
    [ -f bench-report.json ] && cp bench-report.md bench-report.json "$OUT/"
  fi
  [ -z "$failed" ]
  exit $?
}

# 1. Environment.
environment() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max --format=csv
    echo "(a PCIe link below its maximum generation at idle is normal: it trains up under load)"
  else
    echo "nvidia-smi: not installed"
  fi
  command -v nvcc >/dev/null 2>&1 && nvcc --version | tail -n 2
  python3 -c 'import torch; print("python3 torch", torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null || true
  echo
  bin/bigmodel devices --json
}
step "environment" 90 environment
if ! timeout 60 bin/bigmodel devices --json 2>/dev/null | grep -q '"kind": "cuda"'; then
  echo "no CUDA GPU present" | tee -a "$report"
  note FAIL "a CUDA GPU" 0
  finish
fi

# 2. and 3. Tests: devices first, then compute, then models, then the rest.
ordered=()
for t in tests/bm-device-gpu tests/bm-device-gpu_compute tests/bm-compute-gpu tests/bm-models-gpu; do
  [ -x "$t" ] && ordered+=("$t")
done
for t in tests/*; do
  case " ${ordered[*]} " in *" $t "*) ;; *) ordered+=("$t") ;; esac
done
memcheck=()
for t in "${ordered[@]}"; do
  name=$(basename "$t")
  step "test $name" 150 "$t" --test-threads=1
  case "$name" in
    *gpu_compute|bm-compute-gpu) memcheck+=("$t") ;;
  esac
done

# 4. Bench rows (issue 12, acceptance 6): h2d is bm-device's, data_path the
# dispatcher's. The data path's model is written once under target/ (on the
# bundle's disk, so O_DIRECT works) and its figures go to
# target/data-path-summary.json.
mkdir -p target
export CRITERION_HOME="$PWD/target/criterion"
default_benches="h2d data_path"
[ -x benches/h2d ] && step "bench h2d" 150 benches/h2d --bench
[ -x benches/data_path ] && step "bench data_path" 240 env \
  BM_BENCH_DATA_DIR="$PWD/target/data-path-model" \
  BM_BENCH_SUMMARY="$PWD/target/data-path-summary.json" \
  benches/data_path --bench

# The compute tests again under compute-sanitizer memcheck, after the bench
# rows so that a slow sanitizer cannot cost the run its numbers.
if [ "$sanitizer" -eq 1 ] && command -v compute-sanitizer >/dev/null 2>&1; then
  for t in "${memcheck[@]}"; do
    # The kernel cache test starts child processes; memcheck follows the
    # kernels of this process only.
    step "memcheck $(basename "$t")" 240 compute-sanitizer --tool memcheck --error-exitcode 1 \
      "$t" --test-threads=1 --skip kernels_are_cubin_compiled_once
  done
fi

if [ "$full" -eq 1 ]; then
  for b in benches/*; do
    case " $default_benches " in *" $(basename "$b") "*) continue ;; esac
    step "bench $(basename "$b")" 600 "$b" --bench
  done
  bench_report() {
    local args=(bench --prebuilt . --quick)
    if python3 -c "import torch, accelerate, transformers" >/dev/null 2>&1; then
      export BM_BENCH_PYTHON=python3
      args+=(--with-accelerate)
    fi
    rm -f bench-report.md bench-report.json target/bench-report.md target/bench-report.json
    ./xtask "${args[@]}" || return $?
    cp target/bench-report.md target/bench-report.json .
  }
  step "bench report (./xtask bench --prebuilt .)" 900 bench_report
  [ -f bench-report.md ] && { echo; sed 's/^#/##/' bench-report.md; } >> "$report"
fi

finish
