#!/usr/bin/env bash
# One device run for a round's CUDA paths and host figures (docs/BENCHMARKS.md): the GPU tests, then
# `kvstore bench fleet`, `kvstore bench lookup` and `kvstore bench store` on the 16-core host. Carry [".whl", ".etcd"]:
#   mkdir -p .etcd && cp /usr/bin/etcd .etcd/     # here, once (the device has no etcd package)
#   The fleet's GPU test (F48) also needs redis-server: carry Debian's beside etcd, with the two libraries
#   the device image lacks (liblzf, libjemalloc) and a wrapper that sets LD_LIBRARY_PATH for it only:
#     mkdir -p .etcd/lib && cp /usr/bin/redis-check-rdb .etcd/redis-server.bin && cp /usr/bin/redis-cli .etcd/redis-cli.bin
#     cp -L /lib/x86_64-linux-gnu/{liblzf.so.1,libjemalloc.so.2,libatomic.so.1} .etcd/lib/
#     printf '#!/bin/bash\nd=$(dirname "$(readlink -f "$0")")\nLD_LIBRARY_PATH="$d/lib" exec -a %s "$d/%s.bin" "$@"\n' \
#       redis-server redis-server >.etcd/redis-server; (same for redis-cli); chmod +x .etcd/redis-*
#   run: bash scripts/device_round.sh
# PART=gpu runs only the GPU tests, `bench replay` (speed) and `bench transcode`; PART=host only the fleet, lookup
# and store benches (each half fits one 10-minute device call); default both.
# Writes logs and JSON into $OUT (default ./out).
set -uo pipefail
PART=${PART:-all}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PATH="$PWD/.etcd:$PATH"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 setup.py build_ext --inplace -q >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, torch.cuda.get_device_name())'
echo "cpus $(nproc)"
t=$SECONDS
if [ "$PART" != host ]; then
timeout "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider -rs tests/kvstore/codec/test_codec_gpu.py \
  tests/kvstore/client/test_gpu_gather.py tests/kvstore/client/test_gpu_gather_store.py \
  tests/kvstore/client/test_gpu_gather_units.py tests/kvstore/client/test_transfer.py tests/replay/model/test_gpu.py tests/replay/model/test_graphs_gpu.py \
  tests/kvstore/client/test_chain_memo.py tests/kvstore/codec/test_sglang_v4_gpu.py \
  tests/kvstore/codec/test_sglang_v4_triton_gpu.py tests/integrations/test_engine_writes_gpu.py \
  $(command -v redis-server >/dev/null && echo tests/kvstore/client/test_fleet_swa.py::test_f48_direct_gpu_restore_over_a_fleet) 2>&1 | tee "$OUT/tests.log" | tail -8
echo "gpu tests rc=${PIPESTATUS[0]} $((SECONDS - t)) s"; t=$SECONDS
timeout "${REPLAY_S:-150}" python3 -m kvstore.cli bench replay --json --no-progress --parts speed --prefill-sizes 8192,16384 --resume-tokens 65536 \
  >"$OUT/replay.json" 2>"$OUT/replay.err"
echo "bench replay rc=$? $((SECONDS - t)) s"; t=$SECONDS
timeout "${TRANSCODE_S:-300}" python3 -m kvstore.cli bench transcode --json --no-progress >"$OUT/transcode.json" \
  2>"$OUT/transcode.err"
echo "bench transcode rc=$? $((SECONDS - t)) s"; t=$SECONDS
fi
if [ "$PART" != gpu ]; then
timeout "${FLEET_S:-200}" python3 -m kvstore.cli bench fleet --json >"$OUT/fleet.json" 2>"$OUT/fleet.err"
echo "bench fleet rc=$? $((SECONDS - t)) s"; t=$SECONDS
timeout "${LOOKUP_S:-90}" python3 -m kvstore.cli bench lookup --json >"$OUT/lookup.json" 2>"$OUT/lookup.err"
echo "bench lookup rc=$? $((SECONDS - t)) s"; t=$SECONDS
timeout "${STORE_S:-150}" python3 -m kvstore.cli bench store --json --no-progress >"$OUT/store.json" 2>"$OUT/store.err"
echo "bench store rc=$? $((SECONDS - t)) s"
fi
for f in "$OUT"/fleet.json "$OUT"/lookup.json "$OUT"/store.json "$OUT"/replay.json "$OUT"/transcode.json; do
[ -f "$f" ] || continue
python3 - "$f" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as exc:
    print(sys.argv[1], "no json:", exc); sys.exit(0)
for f in r["figures"]:
    ratio = "-" if f["ratio"] is None else f"{f['ratio']:.2f}x"
    print(f"{f['name']}: {f['value']:.4g} {f['unit']}  {ratio} vs {f['baseline']}")
PY
done
