#!/usr/bin/env bash
# Runs every GPU test, bench and CLI check of this bundle and writes
# report.md next to this script. Exits non-zero if anything failed or if
# no CUDA GPU is present. Usage: ./run.sh [--no-bench]
set -u
cd "$(dirname "$0")"
export BM_GPU_TESTS=1
report="$PWD/report.md"
status=0
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
  [ "$rc" -eq 0 ] || status=1
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
fi
if [ "$status" -eq 0 ]; then
  echo "result: PASS" >> "$report"
else
  echo "result: FAIL" >> "$report"
fi
echo "report: $report"
exit $status
