#!/usr/bin/env bash
# The H200 runs behind docs/DIRECT_RESTORE.md (issue 14 items 2 and 6), one script so the device
# command stays short. Usage, from the repository root on the GPU machine:
#   scripts/device_direct.sh probe   # versions, the GPU tests, the bench with the kernel sweep
#   scripts/device_direct.sh final   # the GPU tests, the bench, and the replay model's GPU tests
#   scripts/device_direct.sh bench   # the bench alone
#   scripts/device_direct.sh restore # the bench first, then the GPU, restore and reader tests
# Writes JSON and logs into $OUT (default ./out). Wheels in .whl/ are installed first; the native
# verify-and-copy loop is built in place.
set -uo pipefail
MODE=${1:-final}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 setup.py build_ext --inplace -q >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
python3 -c 'import sys, torch, triton; print(sys.version.split()[0], "torch", torch.__version__, "triton",
  triton.__version__, torch.cuda.get_device_name()); from kvstore.native import blockcopy; print("native verify",
  blockcopy.NATIVE_VERIFY)'
echo "cpus $(nproc)"; free -g | head -2; df -h /tmp | tail -1
t=$SECONDS
GPU_TESTS="tests/kvstore/client/test_gpu_gather_units.py tests/kvstore/client/test_gpu_gather.py
  tests/kvstore/client/test_gpu_gather_store.py"
if [ "$MODE" = restore ]; then  # the figure first: the tests may be cut by the device limit
  timeout "${BENCH_S:-240}" python3 -m kvstore.bench.transfer_direct --json >"$OUT/bench.json" 2>"$OUT/bench.err"
  echo "bench rc=$? $((SECONDS - t)) s"; tail -5 "$OUT/bench.err"; t=$SECONDS
  # shellcheck disable=SC2086
  timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider $GPU_TESTS tests/kvstore/client/test_restore.py \
    tests/kvstore/client/test_colocated.py tests/kvstore/client/test_colocated_overlap.py 2>&1 | tee "$OUT/tests.log" \
    | tail -25
  echo "tests rc=${PIPESTATUS[0]} $((SECONDS - t)) s"
  exit 0
fi
if [ "$MODE" != bench ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kvstore/client/test_gpu_gather_units.py \
    tests/kvstore/client/test_gpu_gather.py tests/kvstore/client/test_gpu_gather_store.py 2>&1 | tee "$OUT/tests.log" \
    | tail -25
  echo "gpu tests rc=${PIPESTATUS[0]} $((SECONDS - t)) s"; t=$SECONDS
fi
extra=""; [ "$MODE" = probe ] && extra="--sweep"
timeout "${BENCH_S:-300}" python3 -m kvstore.bench.transfer_direct --json $extra >"$OUT/bench.json" 2>"$OUT/bench.err"
echo "bench rc=$? $((SECONDS - t)) s"; tail -5 "$OUT/bench.err"
python3 - "$OUT/bench.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as exc:
    print("no bench json:", exc); sys.exit(0)
for f in r["figures"]:
    ratio = "-" if f["ratio"] is None else f"{f['ratio']:.2f}x"
    base = "" if f["baseline_value"] is None else f"  vs {f['baseline_value']:.3f} ({f['baseline']})"
    print(f"{f['name']}: {f['value']:.3f} {f['unit']}  {ratio}{base}")
print(json.dumps(r["notes"], indent=1))
PY
if [ "$MODE" = final ]; then
  t=$SECONDS
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/replay/model/test_gpu.py tests/replay/model/test_fast.py \
    2>&1 | tee "$OUT/replay-tests.log" | tail -8
  echo "replay model tests rc=${PIPESTATUS[0]} $((SECONDS - t)) s"
fi
