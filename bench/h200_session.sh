#!/usr/bin/env bash
# The device-side commands of the H200 reports, each phase under one device call's 10 minutes;
# results land in $OUT (default /tmp/zellige-out), with the tree's commit and machine first.
#   bash bench/h200_session.sh profile            # build, `zellige profile`, planner smoke test
#                                                 # on its batches (about 6 min)
#   bash bench/h200_session.sh memory PROFILE     # build, `zellige profile --memory-only` on
#                                                 # PROFILE, then validate the result (about 8 min)
#   bash bench/h200_session.sh validate PROFILE [ARGS]  # build, validate-profile on >= 21
#                                                 # plans (about 6 min); ARGS go to it
#   bash bench/h200_session.sh mmdit [PROFILE] [ARGS]   # build, MMDiT training at the mmdit-11b
#                                                 # width, then validate-profile --model mmdit-11b
#                                                 # (ARGS, e.g. --plan-range 1-11, go to it)
#   bash bench/h200_session.sh train              # build, training throughput (about 7 min)
#   bash bench/h200_session.sh attention          # the attention engine's packs (about 2 min)
#   bash bench/h200_session.sh trace              # build, one traced MMDiT stage-1 step: where
#                                                 # the time outside the blocks goes (about 4 min)
#   bash bench/h200_session.sh global             # build, a global batch of 60 samples as
#                                                 # micro-batches: each step's predicted and
#                                                 # measured peak (about 3 min)
# Reports: bench/results/profile_h200_202611.md, mmdit_h200_202612.md,
# train_throughput_h200_202612.md, attention_engine_h200_202612.md.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/zellige-out}; mkdir -p "$OUT"
phase=${1:?usage: h200_session.sh profile | memory PROFILE.json | validate PROFILE.json | mmdit [PROFILE.json] | train | attention | trace | global}
profile=$(realpath "${2:-src/zellige/profiles/h200.json}")
{ echo "command: bash bench/h200_session.sh $*"; echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null; } | tee "$OUT/session.txt"
python3 -m pip install -q --no-build-isolation --no-deps . 2>&1 | tail -3
python3 -c "import platform, torch; print(f'torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, python {platform.python_version()}')" | tee -a "$OUT/session.txt"
source_tree=$PWD
cd /tmp  # import the installed package, not the source tree
case $phase in
  profile)
    timeout 450 zellige profile --repeats 3 --out "$OUT/h200.json" \
      --details "$OUT/profile_details.json" >"$OUT/profile.log" 2>&1
    echo "profile rc=$?"; grep -E "calls L=|host issue|in-step|layout:|wrote|Error" "$OUT/profile.log"
    # the planners on validate-profile's batches (wan-14b on every recipe, the fresh profile)
    python3 -X faulthandler "$source_tree/bench/planner_smoke.py" --model wan-14b \
      --profile "$OUT/h200.json" >"$OUT/planner_smoke_wan14b.txt" 2>&1
    rc=$?; echo "planner smoke (wan-14b, fresh profile) rc=$rc"
    tail -4 "$OUT/planner_smoke_wan14b.txt"
    if [ $rc -ne 0 ]; then
      timeout 60 cuda-gdb -batch -ex run -ex bt --args python3 \
        "$source_tree/bench/planner_smoke.py" --model wan-14b --profile "$OUT/h200.json" \
        >"$OUT/planner_backtrace.txt" 2>&1
      grep -A30 "SIGSEGV" "$OUT/planner_backtrace.txt" | head -40
    fi
    ;;
  train)
    (cd "$source_tree/bench" && timeout 420 python3 train_throughput.py --steps 6 --warmup 2 \
      --sync-check --runs wan14b-width-h200:wan-stage2,wan1p3b-h200:wan-stage2 \
      --json "$OUT/train_throughput.json") >"$OUT/train.log" 2>&1
    echo "train rc=$?"; tail -8 "$OUT/train.log"
    ;;
  validate)
    timeout 560 zellige validate-profile --profile "$profile" --plans 21 --repeats 3 "${@:3}" \
      --json "$OUT/validate.json" --results-jsonl "$OUT/validate.jsonl" >"$OUT/validate.log" 2>&1
    echo "validate rc=$?"; tail -30 "$OUT/validate.log"
    ;;
  memory)
    # about 40 s, then validate-profile about 430 s (the budget stops drawing plans in time)
    timeout 80 zellige profile --memory-only --base "$profile" --out "$OUT/h200.json" \
      --details "$OUT/memory_details.json" >"$OUT/memory.log" 2>&1
    echo "memory-only profile rc=$?"; grep -E "memory|launch|reserve|wrote|Error" "$OUT/memory.log"
    timeout 490 zellige validate-profile --profile "$OUT/h200.json" --plans 21 --repeats 3 \
      --time-budget 440 --json "$OUT/validate.json" --results-jsonl "$OUT/validate.jsonl" \
      >"$OUT/validate.log" 2>&1
    echo "validate rc=$?"; tail -12 "$OUT/validate.log"
    # a run cut short still has its ranks: zellige validate-profile --summarise validate.jsonl
    ;;
  mmdit)
    # about 3 min: training at the mmdit-11b width (2 double + 4 single blocks of width 3072) on
    # Open-Sora 2.0 stage-2 micro-batches, bf16, per-token layers compiled
    (cd "$source_tree/bench" && timeout 200 python3 train_throughput.py --steps 4 --warmup 1 \
      --profile "$profile" --runs mmdit11b-width-h200:opensora2-stage2 \
      --json "$OUT/train_throughput_mmdit.json") >"$OUT/train_mmdit.log" 2>&1
    echo "train rc=$?"; tail -6 "$OUT/train_mmdit.log"
    # the rest of the call: half of the 21 plans (--plan-range), each rank timed >= 4 s
    timeout 330 zellige validate-profile --model mmdit-11b --profile "$profile" --plans 21 \
      --repeats 3 --min-timed-s 4 "${@:3}" --results-jsonl "$OUT/validate_mmdit.jsonl" \
      >"$OUT/validate_mmdit.log" 2>&1
    echo "validate rc=$?"; tail -12 "$OUT/validate_mmdit.log"
    # join the calls' files on any machine: zellige validate-profile --summarise A.jsonl B.jsonl
    ;;
  attention)
    (cd "$source_tree/bench" && timeout 150 python3 attention_engine.py --ragged --dense-alt \
      --methods dense-cudnn dense-cudnn-alt coalesced-auto coalesced-ragged fa2-varlen --rounds 2 \
      --flex-packs 0 --no-length-table --time-budget-s 100 --out "$OUT/attention_engine.json") \
      >"$OUT/attention.log" 2>&1
    echo "attention rc=$?"; tail -14 "$OUT/attention.log"
    ;;
  trace)
    # the Chrome trace and bench/step_trace.py's summary of the step outside the blocks
    (cd "$source_tree/bench" && timeout 300 python3 train_throughput.py --steps 4 --warmup 2 \
      --sync-check --runs mmdit11b-width-h200:opensora2-stage1 --trace "$OUT/trace" \
      --json "$OUT/train_trace.json") >"$OUT/train_trace.log" 2>&1
    echo "trace rc=$?"; tail -30 "$OUT/train_trace.log"
    ;;
  global)
    # a global batch of 60 samples (3-5 micro-batches on an H100); the plans price each
    # micro-batch after the first holding the earlier ones' gradients (docs/global-batch.md)
    timeout 240 python3 -m zellige.train --config mmdit11b-width-h200 --recipe opensora2-stage1 \
      --seed 1 --global-batch 60 --steps 5 --metrics "$OUT/global.jsonl" >"$OUT/global.log" 2>&1
    echo "global rc=$?"; grep -E "step [0-9]|memory|Error" "$OUT/global.log" | tail -8
    python3 -c "import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r['step'], 'micro-batches', r['micro_batches'], 'peak GiB', round(r['peak_gib'], 2),
          'predicted', round(r['predicted_peak_gib'], 2), 'step s', round(r['step_s'], 3),
          'predicted', round(r['predicted_makespan_s'], 3))" "$OUT/global.jsonl"
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
