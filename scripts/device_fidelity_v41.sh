#!/usr/bin/env bash
# The V4.1-shaped fidelity table (issue 30 item 3, docs/REPLAY.md "The V4.1-shaped table") in one device
# command on one H200, under 9 minutes of wall time:
#   1. trains replay.model.config.REDUCED_V41_D256 (40 layers, V4.1-Flash's layer pattern and 128-token
#      window, hidden width 256) with scripts/train_tiny.py at training seeds 0 and 1, in parallel, each
#      capped at TRAIN_MINUTES (the cosine schedule ends at the cap: --time-schedule);
#   2. measures bounded against exact replay on both ("random" and "block boundary" resumes, spans
#      SPANS windows) in one shard per (training seed, prompt seed), all at once, each stopping after
#      FIDELITY_MINUTES (kvstore bench replay --write-resumes);
#   3. pools the shards into the span table (scripts/merge_fidelity.py): $OUT/reduced_v41-d256.json,
#      the file to commit as replay/fidelity/reduced_v41-d256.json (the planner of a V4.1-Flash geometry
#      picks it by the geometry it records: replay.fidelity_budget.table_for_geometry).
# Run (carry [".whl"]): bash scripts/device_fidelity_v41.sh
# Writes into $OUT (default ./out): reduced_v41-d256.json, table.md (the intervals in markdown), logs/
# (training logs and JSON, each shard's bench JSON and stderr). The weights stay in $WORK (not shipped).
# A CPU smoke run of the whole chain on the tiny config (a minute or two): SMOKE=1 bash scripts/device_fidelity_v41.sh
# (SMOKE=1 CONFIG=reduced_v41-d256 runs the V4.1 config itself on the CPU: tens of minutes, its 40 layers are slow there).
# Every setting is an environment variable (defaults below).
set -uo pipefail
OUT=${OUT:-$PWD/out}
WORK=${WORK:-/tmp/fidelity-v41}
if [ "${SMOKE:-0}" = 1 ]; then  # the whole chain on the CPU, sized to finish in a minute or two
  : "${CONFIG:=tiny}" "${DEVICE:=cpu}" "${SKIP_INSTALL:=1}" "${PY:=.venv/bin/python}" "${TRAIN_SEEDS:=0 1}" "${PROMPT_SEEDS:=1}"
  : "${PROMPTS:=1}" "${STEPS:=2}" "${BATCH:=1}" "${SEQ:=256}" "${WARMUP:=1}" "${SPANS:=1,2}" "${MAX_WINDOWS:=6}"
  : "${CONTINUE:=2}" "${MIN_RESUMES:=1}"
fi
CONFIG=${CONFIG:-reduced_v41-d256}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
TRAIN_SEEDS=${TRAIN_SEEDS:-0 1}
PROMPT_SEEDS=${PROMPT_SEEDS:-1 2 3 4 5 6}  # 6 prompt seeds x 2 trainings = 12 shards at once on 16 cores
PROMPTS=${PROMPTS:-12}                     # per case and shard, at most: 12 x 12 = 144 a case and span, unless cut
STEPS=${STEPS:-100000}                     # more than fit: the time cap ends the training
TRAIN_MINUTES=${TRAIN_MINUTES:-3.5}
BATCH=${BATCH:-2}                          # 2 x 2048 tokens a step: ~25 GB of activations a training, two at once
SEQ=${SEQ:-2048}                           # 16 windows: the resumes' prefixes (<= MAX_WINDOWS / 2 windows) lie inside
LR=${LR:-1e-3}
WARMUP=${WARMUP:-50}
SPANS=${SPANS:-1,2,4,8}
MAX_WINDOWS=${MAX_WINDOWS:-32}             # stored prefixes H in (2, 16] windows = (256, 2048] tokens
CONTINUE=${CONTINUE:-32}                   # greedy tokens continued for the KL
FIDELITY_MINUTES=${FIDELITY_MINUTES:-2.75}      # each shard stops adding resumes then (>= 100 a case and span wanted)
INVARIANT=${INVARIANT:-off}                # off: the fused CUDA step (what a worker runs); on: bit-exact, slower
MIN_RESUMES=${MIN_RESUMES:-100}
TABLE=$OUT/$CONFIG.json
mkdir -p "$OUT/logs" "$WORK"
start=$SECONDS
say() { echo "[$((SECONDS - start)) s] $*"; }

if [ "${SKIP_INSTALL:-0}" != 1 ]; then  # as scripts/device_round.sh: our wheels, then the C extension
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  $PY setup.py build_ext --inplace -q >"$OUT/logs/build.log" 2>&1 || { tail -20 "$OUT/logs/build.log"; exit 1; }
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
$PY -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__,
        torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")'
say "cpus $(nproc); config $CONFIG on $DEVICE; training seeds $TRAIN_SEEDS, ${TRAIN_MINUTES} min each, in parallel"

# 1. training, both seeds at once (one GPU holds both); SKIP_TRAIN=1 reuses $WORK's weights (a second call on a
#    still-warm machine that only measures more, e.g. SKIP_TRAIN=1 FIDELITY_MINUTES=6)
train_cap=${TRAIN_CAP_S:-$(awk "BEGIN {print int($TRAIN_MINUTES * 60 + 60)}")}  # hard stops, seconds
[ "${SKIP_TRAIN:-0}" = 1 ] && say "SKIP_TRAIN=1: the weights already in $WORK"
for s in $TRAIN_SEEDS; do
  [ "${SKIP_TRAIN:-0}" = 1 ] && break
  timeout "$train_cap" $PY scripts/train_tiny.py --config "$CONFIG" --out "$WORK/$CONFIG-seed$s.pt" --seed "$s" \
    --steps "$STEPS" --max-minutes "$TRAIN_MINUTES" --time-schedule --matmul-precision high --batch "$BATCH" \
    --seq "$SEQ" --lr "$LR" --warmup "$WARMUP" --log-every 25 --device "$DEVICE" >"$WORK/train-seed$s.log" 2>&1 &
done
while [ -n "$(jobs -rp)" ]; do  # progress every 15 s: each training's last line
  sleep "${WATCH_S:-15}" & wait $!
  for s in $TRAIN_SEEDS; do say "seed $s: $(tail -1 "$WORK/train-seed$s.log" 2>/dev/null)"; done
done
wait
weights=()
for s in $TRAIN_SEEDS; do
  cp "$WORK/train-seed$s.log" "$OUT/logs/"; cp "$WORK/$CONFIG-seed$s.json" "$OUT/logs/" 2>/dev/null
  if [ -f "$WORK/$CONFIG-seed$s.pt" ]; then weights+=("$WORK/$CONFIG-seed$s.pt"); else say "seed $s: no weights"; fi
  grep -E "^stopped|held-out" "$WORK/train-seed$s.log" | sed "s/^/[seed $s] /"
done
[ ${#weights[@]} -gt 0 ] || { say "no training finished"; tail -n 20 "$WORK"/train-seed*.log; exit 1; }

# 2. fidelity, one shard per (weights, prompt seed), all at once
say "fidelity: ${#weights[@]} trainings x prompt seeds ($PROMPT_SEEDS) x $PROMPTS prompts per case, spans $SPANS"
fid_cap=${FIDELITY_CAP_S:-$(awk "BEGIN {print int($FIDELITY_MINUTES * 60 + 75)}")}
rm -f "$WORK"/resumes-*.json
for w in "${weights[@]}"; do
  name=$(basename "$w" .pt)
  for p in $PROMPT_SEEDS; do
    (timeout "$fid_cap" $PY -m kvstore.cli bench replay --json --no-progress --parts fidelity --model "$CONFIG" \
       --weights "$w" --device "$DEVICE" --batch-invariant "$INVARIANT" --cases "random,block boundary" \
       --spans "$SPANS" --seeds "$p" --prompts "$PROMPTS" --steps "$CONTINUE" --max-windows "$MAX_WINDOWS" \
       --tail-prompts 0 --fidelity-minutes "$FIDELITY_MINUTES" --write-resumes "$WORK/resumes-$name-p$p.json" \
       >"$OUT/logs/fidelity-$name-p$p.json" 2>"$OUT/logs/fidelity-$name-p$p.err"
     say "shard $name prompt seed $p rc=$?") &
  done
done
wait
shards=("$WORK"/resumes-*.json)
[ -e "${shards[0]}" ] || { say "no shard wrote its resumes"; tail -n 5 "$OUT"/logs/fidelity-*.err; exit 1; }

# 3. the table
$PY scripts/merge_fidelity.py --out "$TABLE" --min-resumes "$MIN_RESUMES" "${shards[@]}" | tee "$OUT/table.md"
rc=${PIPESTATUS[0]}
say "merge rc=$rc (1: fewer than $MIN_RESUMES resumes in some case and span); table $TABLE"
ls -la "$OUT"
exit "$rc"
