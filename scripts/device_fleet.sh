#!/usr/bin/env bash
# `kvstore bench fleet --json` on the GPU machine's host (docs/FLEET.md, "Figures"; issue 23), one script so the
# device command stays short. The device has no etcd package and lacks some wheels, so both travel with the tree:
#   mkdir -p .etcd && cp /usr/bin/etcd .etcd/      # here, once: the bench runs the `etcd` it finds on PATH
#   run: scripts/device_fleet.sh [bench flags...]   # carry [".etcd", ".whl"]; flags go to the bench as they are
# Writes bench.json, bench.err and build.log into $OUT (default ./out), then prints the figures and targets.
# Wheels in .whl/ (lmdb, grpcio-health-checking, grpcio-reflection, redis, zstandard, aetcd, ...) are installed
# first, as scripts/device_direct.sh does; the native helpers are built in place.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
[ -x .etcd/etcd ] || { echo "no .etcd/etcd: copy /usr/bin/etcd into .etcd/ and carry it"; exit 1; }
export PATH="$PWD/.etcd:$PATH"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 setup.py build_ext --inplace -q >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
python3 -c 'import sys; print(sys.version.split()[0])'; etcd --version | head -1
echo "cpus $(nproc)"; free -g | head -2; df -h /tmp | tail -1
t=$SECONDS
timeout "${BENCH_S:-540}" python3 -m kvstore.cli bench fleet --json "$@" >"$OUT/bench.json" 2>"$OUT/bench.err"
echo "bench rc=$? $((SECONDS - t)) s"; grep -v '^[IWE][0-9]' "$OUT/bench.err" | tail -5
python3 - "$OUT/bench.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as exc:
    print("no bench json:", exc); sys.exit(0)
for f in r["figures"]:
    ratio = "-" if f["ratio"] is None else f"{f['ratio']:.2f}x"
    base = "" if f["baseline_value"] is None else f"  vs {f['baseline_value']:.4g} ({f['baseline']})"
    print(f"{f['name']}: {f['value']:.4g} {f['unit']}  {ratio}{base}")
print(json.dumps(r["notes"], indent=1))
PY
