#!/usr/bin/env bash
# Runs every GPU test, bench and CLI check of this bundle, then the
# benchmark report (./xtask bench --prebuilt . --quick), and writes
# report.md next to this script, with bench-report.md and .json beside it.
# Exits non-zero if anything failed or if no CUDA GPU is present.
# Usage: ./run.sh [--no-bench]
set -u
cd "$(dirname "$0")"
export BM_GPU_TESTS=1
report="$PWD/report.md"
status=0
failed=""
bench=1
[ "${1:-}" = "--no-bench" ] && bench=0
# GPU compute loads libnvrtc and libcublas by name at run time: put the
# toolkit's library folders on the search path when the machine has them.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done

{
  echo "# bigmodel GPU bundle report"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "- host: $(uname -srm)"
  echo "- built from commit: $(cat commit 2>/dev/null || echo unknown)"
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "- GPUs: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | paste -sd ';' -)"
  fi
} > "$report"

# step NAME CMD...: runs CMD, appends its output and exit status to the report.
step() {
  local name=$1; shift
  echo "== $name"
  {
    echo
    echo "## $name"
    echo
    echo '```'
  } >> "$report"
  "$@" 2>&1 | tee -a "$report"
  local rc=${PIPESTATUS[0]}
  {
    echo '```'
    echo
    echo "exit status: $rc"
  } >> "$report"
  [ "$rc" -eq 0 ] || fail "$name"
}

# fail NAME: records that step NAME failed.
fail() {
  status=1
  failed="${failed:+$failed, }$1"
}

# bench_report: the benchmark report of the bundled xtask, appended to
# report.md (headings one level down) and kept beside it; when it fails,
# its exit status and the end of its log are recorded instead. Runs last,
# so the test results above stand whatever happens here.
bench_report() {
  local args=(bench --prebuilt . --quick)
  if python3 -c "import torch, accelerate, transformers" >/dev/null 2>&1; then
    export BM_BENCH_PYTHON=python3
    args+=(--with-accelerate)
  fi
  echo "== bench report: ./xtask ${args[*]}"
  rm -f bench-report.md bench-report.json target/bench-report.md target/bench-report.json
  ./xtask "${args[@]}" 2>&1 | tee bench-report.log
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ] && [ -f target/bench-report.md ] && [ -f target/bench-report.json ]; then
    cp target/bench-report.md target/bench-report.json .
    {
      echo
      sed 's/^#/##/' bench-report.md
      echo
      echo "bench report: \`./xtask ${args[*]}\`, exit status 0 (bench-report.md, bench-report.json, log in bench-report.log)"
    } >> "$report"
  else
    {
      echo
      echo "## bench report"
      echo
      echo "\`./xtask ${args[*]}\` wrote no report; the end of bench-report.log:"
      echo
      echo '```'
      tail -n 40 bench-report.log
      echo '```'
      echo
      echo "exit status: $rc"
    } >> "$report"
    fail "bench report"
  fi
}

step "bigmodel devices" bin/bigmodel devices
if ! bin/bigmodel devices --json | grep -q '"kind": "cuda"'; then
  echo "no CUDA GPU present" | tee -a "$report"
  echo "result: FAIL (no GPU)" >> "$report"
  exit 1
fi
for t in tests/*; do
  step "test $(basename "$t")" "$t" --test-threads=1
done
if [ "$bench" -eq 1 ]; then
  for b in benches/*; do
    step "bench $(basename "$b")" "$b" --bench
  done
  bench_report
fi
if [ "$status" -eq 0 ]; then
  echo "result: PASS" >> "$report"
else
  echo "result: FAIL ($failed)" >> "$report"
fi
echo "report: $report"
exit $status
