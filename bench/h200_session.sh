#!/usr/bin/env bash
# One device call on a single H200: build, planner smoke test (with a backtrace if it crashes),
# re-measure the profile, validate it on >= 21 plans. Results land in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/zellige-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-build-isolation --no-deps . 2>&1 | tail -3
cd /tmp  # import the installed package, not the source tree
python3 "$OLDPWD/bench/planner_smoke.py" >"$OUT/planner_smoke.txt" 2>&1
rc=$?; echo "planner smoke rc=$rc"; tail -2 "$OUT/planner_smoke.txt"
if [ $rc -ne 0 ]; then
  cuda-gdb -batch -ex run -ex bt --args python3 "$OLDPWD/bench/planner_smoke.py" \
    >"$OUT/planner_backtrace.txt" 2>&1
  grep -A25 "SIGSEGV" "$OUT/planner_backtrace.txt" | head -40
fi
timeout 150 zellige profile --out "$OUT/h200.json" --details "$OUT/profile_details.json" \
  2>&1 | tail -5
timeout 230 zellige validate-profile --profile "$OUT/h200.json" --plans 21 --repeats 1 \
  --time-budget 200 --json "$OUT/validate.json" --results-jsonl "$OUT/validate.jsonl" \
  2>&1 | tail -25
