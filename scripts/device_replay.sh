#!/usr/bin/env bash
# The H200 runs behind docs/REPLAY.md (issue 11 items 4 and 5), one script so the
# device command stays short. Usage, from the repository root on the GPU machine:
#   scripts/device_replay.sh check   # a couple of minutes: every part once, CI-sized
#   scripts/device_replay.sh train     # trains the tiny model; fidelity on random weights; planner overhead
#   scripts/device_replay.sh measure   # fidelity on the trained weights (.replay-weights/tiny.pt, carried
#                                      # back from the train run's tarball) and on reduced_v41; speed
#   scripts/device_replay.sh speed     # speed again (with GPU kernel times), then reduced_v41 fidelity
#   scripts/device_replay.sh replay    # bounded vs exact replay, fused step against the reference step, in one
#                                      # process (kvstore.bench.replay_speed.compare_paths); the model's GPU tests
# Writes JSON and logs into $OUT/MODE.tar.gz (default ./out). Wheels in .whl/ are installed first.
# Fidelity runs in three shards of cases at once (the tiny model is launch-bound: processes overlap).
set -uo pipefail
MODE=${1:-check}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 setup.py build_ext --inplace -q >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())'
nproc
bench="python3 -m kvstore.cli bench replay --json"

if [ "$MODE" = check ]; then
  t=$SECONDS
  timeout 100 python3 scripts/train_tiny.py --out "$OUT/tiny-check.pt" --steps 40 --log-every 10 2>&1 \
    | tee "$OUT/train-check.log"; echo "train: $((SECONDS - t)) s"; t=$SECONDS
  for inv in on off; do
    timeout 100 $bench --parts fidelity --prompts 4 --steps 32 --cases random --batch-invariant $inv \
      --weights "$OUT/tiny-check.pt" >"$OUT/fidelity-check-$inv.json" 2>"$OUT/fidelity-check.err"
    echo "fidelity invariant=$inv rc=$? $((SECONDS - t)) s"; t=$SECONDS
  done
  tail -3 "$OUT/fidelity-check.err"
  timeout 150 $bench --quick --parts speed,overhead >"$OUT/speed-check.json" 2>"$OUT/speed-check.err"
  echo "speed rc=$? $((SECONDS - t)) s"; tail -5 "$OUT/speed-check.err"
  cat "$OUT/speed-check.json"
  rm -f "$OUT"/*.pt
  exit 0
fi

if [ "$MODE" = replay ]; then
  timeout "${REPLAY_S:-150}" python3 -m kvstore.bench.replay_speed "${REPLAY_AT:-8192}" | tee "$OUT/replay-paths.json"
  echo "replay rc=${PIPESTATUS[0]}"
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/replay/model/test_gpu.py tests/replay/model/test_graphs_gpu.py tests/replay/model/test_fast.py \
    2>&1 | tail -5
  exit 0
fi

W=$OUT/work
mkdir -p "$W"
PROMPTS=${PROMPTS:-20}
t=$SECONDS
shards() {  # fidelity in three shards of cases; $1 names them, the rest are extra flags
  local name=$1; shift
  local i=0
  for cases in "random,block boundary" "inside a block,even T,odd T" \
               "T just above the window,short turn after long ones,after a long tool output"; do
    i=$((i + 1)); tail=0; [ $i = 1 ] && tail=$PROMPTS
    (timeout "${SHARD_S:-280}" $bench --parts fidelity --device cuda --prompts "$PROMPTS" --cases "$cases" \
       --tail-prompts $tail "$@" >"$W/fidelity-$name-$i.json" 2>>"$W/errors.log"
     echo "fidelity $name shard $i rc=$? at $((SECONDS - t)) s") &
  done
}

if [ "$MODE" = train ]; then
  shards random
  timeout 260 python3 scripts/train_tiny.py --out "$W/tiny.pt" --steps "${STEPS:-3000}" \
    --max-minutes "${TRAIN_MINUTES:-3.5}" >"$W/train.log" 2>&1
  echo "train rc=$? at $((SECONDS - t)) s"; grep -E "step +[0-9]*000 |held-out" "$W/train.log"
  wait  # the overhead part alone on the machine: its figure is a CPU timing
  timeout 150 $bench --parts overhead >"$W/overhead.json" 2>>"$W/errors.log"
  echo "overhead rc=$? at $((SECONDS - t)) s"
elif [ "$MODE" = measure ]; then
  SHARD_S=${SHARD_S:-240} shards trained --weights .replay-weights/tiny.pt
  (timeout 240 $bench --parts fidelity --model reduced --batch-invariant off --device cuda --cases random \
     --prompts "${REDUCED_PROMPTS:-6}" --tail-prompts "${REDUCED_PROMPTS:-6}" >"$W/fidelity-reduced.json" \
     2>>"$W/errors.log"; echo "fidelity reduced rc=$? at $((SECONDS - t)) s") &
  wait
  timeout 200 $bench --parts speed --prefill-sizes 8192,16384,32768,65536 >"$W/speed.json" 2>>"$W/errors.log"
  echo "speed rc=$? at $((SECONDS - t)) s"
  timeout 60 python3 - >"$W/profile.txt" 2>&1 <<'PY'
import torch
from replay.model import ReferenceModel, reduced_v41
from replay.model.cache_io import restore_state, state_blocks
m = ReferenceModel(reduced_v41(), device="cuda"); g = m.config.geometry; h = 8192
toks = torch.randint(0, 1024, (h,)).tolist(); st = m.new_state(); m.extend(st, toks)
blocks = state_blocks(g, st, 64)
rows = lambda: restore_state(g, blocks, None, position=h, resume=h, device="cuda")
m.replay(toks, rows(), span=128); r = rows(); torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
    m.replay(toks, r, span=128); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
PY
  echo "profile rc=$? at $((SECONDS - t)) s"
elif [ "$MODE" = speed ]; then
  timeout 150 $bench --parts speed --prefill-sizes 8192,16384,32768,65536 >"$W/speed.json" 2>>"$W/errors.log"
  echo "speed rc=$? at $((SECONDS - t)) s"
  timeout 280 $bench --parts fidelity --model reduced --batch-invariant off --device cuda --cases random \
     --prompts "${REDUCED_PROMPTS:-16}" --tail-prompts "${REDUCED_PROMPTS:-16}" >"$W/fidelity-reduced.json" \
     2>>"$W/errors.log"; echo "fidelity reduced rc=$? at $((SECONDS - t)) s"
fi
wait
tail -20 "$W/errors.log" 2>/dev/null
tar czf "$OUT/$MODE.tar.gz" -C "$W" . && rm -rf "$W"
ls -la "$OUT"
