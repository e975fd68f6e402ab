#!/usr/bin/env bash
# Lean installs of the two inference engines the adapters plug into, into one venv:
#   bash scripts/install_engines.sh VENV
# vllm==0.33.0 and sglang==0.5.23 go in with --no-deps (their full installs pull a CUDA
# torch and ~9 GB), on top of the CPU torch already in VENV, plus the small pure
# dependencies they need to import their schedulers / storage backends, pinned one
# `name==version` per line in scripts/engines/vllm.txt and scripts/engines/sglang.txt.
# A name pinned by both files at different versions is installed once at the higher
# version (said on stderr). Each engine is checked by importing what the tests use.
#
# Never fails the run: when an engine cannot be installed or imported, the reason goes
# to VENV/engine-skip-<name>.txt (read by tests/integrations to skip with that reason)
# and the script goes on. A successful install removes a stale note.
#
# Fast when nothing changed: once both engines installed and imported, VENV/engines-ready.txt
# records the pins and every package of VENV at their versions; a later run that finds the
# same skips pip and the imports (~75 s of imports on a loaded 2-core box). The wheels are
# kept in a cache that outlives the venv and the clone (KVSTORE_WHEEL_CACHE, by default
# ~/.cache/kvstore/wheels; pip's own HTTP cache is not relied on): a fresh clone on the same
# machine installs them from there with no download.
set -uo pipefail
cd "$(dirname "$0")/.."

VENV=${1:?usage: scripts/install_engines.sh VENV}
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "install_engines: no python at $PY" >&2; exit 0; }

declare -A VERSION=([vllm]=0.33.0 [sglang]=0.5.23)
declare -A CHECK=(
    [vllm]="import vllm.v1.core.sched.scheduler, vllm.distributed.kv_transfer.kv_connector.v1.base"
    [sglang]="import sglang.srt.mem_cache.storage.backend_factory, sglang.srt.mem_cache.hicache_storage"
)
WHEELS=${KVSTORE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstore/wheels}
READY="$VENV/engines-ready.txt"
start=$(date +%s)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

pip_q() { "$PY" -m pip install -q --no-compile --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" ; return "${PIPESTATUS[0]}"; }

note() {  # note ENGINE REASON: record why ENGINE is not tested here
    printf '%s\n' "$2" > "$VENV/engine-skip-$1.txt"
    echo "install_engines: $1 skipped: $2" >&2
}

# One pin per package: the union of both files, the higher version where they differ.
merged="$work/pins.txt"
cat scripts/engines/vllm.txt scripts/engines/sglang.txt 2>/dev/null | sed 's/#.*//; s/[[:space:]]//g' | grep '==' |
    awk -F'==' '{ n = tolower($1); gsub("_", "-", n); print n "==" $2 }' | sort -t= -k1,1 -k3,3V | awk -F'==' '
    { if ($1 == last && $2 != ver) printf "install_engines: %s pinned at %s and %s: using %s\n", $1, ver, $2, $2 > "/dev/stderr"
      last = $1; ver = $2; line[$1] = $0 }
    END { for (n in line) print line[n] }' | sort > "$merged"

names() { sed 's/#.*//; s/[[:space:]]//g' "$1" | grep '==' | awk -F'==' '{ n = tolower($1); gsub("_", "-", n); print n }'; }

# What the ready stamp holds: the engines and pins asked for, and every package the venv has now.
state() {
    { for engine in vllm sglang; do echo "$engine==${VERSION[$engine]}"; done; cat "$merged"
      "$PY" -c 'import importlib.metadata as m; print(*sorted({f"{d.name}=={d.version}".lower() for d in m.distributions()}), sep="\n")'
    } | sha256sum | cut -d' ' -f1
}
if [ -f "$READY" ] && [ "$(cat "$READY")" = "$(state)" ]; then
    echo "install_engines: vllm==${VERSION[vllm]} and sglang==${VERSION[sglang]} installed and imported before, nothing changed since ($READY): skipped"
    exit 0
fi
rm -f "$READY"

# install ENGINE PINS: from the wheel cache alone when it holds them all, else fetched into it first.
install() {
    local spec="$1==${VERSION[$1]}"
    pip_q --no-deps --no-index --find-links "$WHEELS" -r "$2" "$spec" >/dev/null && return 0
    mkdir -p "$WHEELS"
    "$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$WHEELS" -r "$2" "$spec" 2>&1 |
        grep -v "^WARNING: Location" >&2
    pip_q --no-deps --no-index --find-links "$WHEELS" -r "$2" "$spec"
}

ready=0
for engine in vllm sglang; do
    rm -f "$VENV/engine-skip-$engine.txt"
    # This engine's pins, at the merged versions, and the engine itself: one pip call, no dependencies.
    pins="$work/$engine.txt"
    names "scripts/engines/$engine.txt" | while read -r n; do grep "^$n==" "$merged"; done > "$pins"
    if ! out=$(install "$engine" "$pins"); then
        note "$engine" "pip install --no-deps $engine==${VERSION[$engine]} -r scripts/engines/$engine.txt failed: $(echo "$out" | tail -1)"
        continue
    fi
    if ! err=$(VLLM_TARGET_DEVICE=cpu "$PY" -c "${CHECK[$engine]}" 2>&1); then
        note "$engine" "$engine==${VERSION[$engine]} installed but does not import: $(echo "$err" | tail -1)"
        continue
    fi
    echo "install_engines: $engine==${VERSION[$engine]} ready"
    ready=$((ready + 1))
done
# The engines' own metadata asks for other torch builds; the venv's CPU torch must stay.
"$PY" -c "import torch; print('install_engines: torch', torch.__version__, 'kept')"
[ "$ready" = 2 ] && state > "$READY"
echo "install_engines: done in $(( $(date +%s) - start )) s"
exit 0
