#!/usr/bin/env bash
# Set up and run the whole test suite on a fresh machine (the README's second
# command; .ci/run calls exactly this). Installs what the tests need: a venv
# with the CPU build of torch, the project, its test tools, redis-server and etcd
# (tests start their own redis-server and etcd processes on free loopback ports and stop
# them; nothing listens beyond 127.0.0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    echo "== installing redis-server"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    # The package may start a system instance on port 6379; the tests do not use it.
    (service redis-server stop || pkill -x redis-server || true) >/dev/null 2>&1
fi

if ! command -v etcd >/dev/null || ! command -v etcdctl >/dev/null; then
    echo "== installing etcd (the fleet's membership store; tests start their own on loopback)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server etcd-client >/dev/null
    # The package may start a system instance on port 2379; the tests do not use it.
    (service etcd stop || pkill -x etcd || true) >/dev/null 2>&1
fi

if ! command -v cc >/dev/null; then
    echo "== installing a C compiler (the native copy loop, kvstore/native/_blockcopy.c)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev >/dev/null
fi

echo "== python environment ($((SECONDS - start)) s)"
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
pip install -q --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v "^WARNING: Location" || true

# The build of the native module is optional for users (a Python loop stands
# in); here it must have been built, so its tests run rather than skip.
native() { python -c "import kvstore.native.blockcopy as b, kvstore.native.ring as r, sys; sys.exit(0 if b.NATIVE and r.NATIVE else 1)"; }
if ! native; then
    echo "== kvstore.native._blockcopy was not built: installing Python's headers and building again"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-dev >/dev/null
    pip install -q --disable-pip-version-check --no-deps -e . 2>&1 | grep -v "^WARNING: Location" || true
    native || { echo "kvstore.native._blockcopy did not build (see: pip install -v -e .)" >&2; exit 1; }
fi

# The engines' pins constrain the extras below, so that the engines' install (in the background,
# beside the tests) finds every package they share already at its version and adds only new ones.
pins=(-c scripts/engines/vllm.txt -c scripts/engines/sglang.txt)

# The events' extra (pyzmq, msgspec).
python -c "import zmq, msgspec" 2>/dev/null || pip install -q --disable-pip-version-check "${pins[@]}" $(python -c \
    "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['events'])") || true

# Mooncake's transfer engine, for the bulk transport's tests and the bench's Mooncake
# figure (pyproject's "bulk" extra). Never fails the run: without it those tests skip
# saying why. Its native library needs libibverbs.so.1, even with no RDMA hardware.
echo "== mooncake transfer engine (the bulk transport) ($((SECONDS - start)) s)"
if ! ldconfig -p | grep -q 'libibverbs\.so\.1 '; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null) \
        || echo "   libibverbs1 could not be installed: the bulk transport's tests will skip"
fi
bulk=$(python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['bulk'])")
pip install -q --disable-pip-version-check "${pins[@]}" $bulk 2>&1 | grep -v "^WARNING: Location" || true
python -c "from mooncake.engine import TransferEngine" 2>/dev/null \
    || echo "   mooncake cannot be imported here: the bulk transport's tests will skip"

# vLLM and SGLang, lean (no CUDA torch), for the adapters' tests against the real
# engines (tests/integrations) and the events tests that decode with vLLM's own classes.
# Never fails the run: an engine that cannot be installed is noted in
# .venv/engine-skip-<name>.txt and its tests skip saying why. Skipped when they installed and
# imported before and nothing changed; their wheels are kept in ~/.cache/kvstore/wheels
# (KVSTORE_WHEEL_CACHE), so a fresh clone downloads none.
# It runs in the background, beside the main test run (three minutes from a fresh cache):
# it only adds packages that nothing outside ENGINE_TESTS imports (the dev install shares no
# package with scripts/engines/*.txt, the extras take their pins), and everything that
# reads the engines (mypy, which follows vLLM's py.typed; ENGINE_TESTS) waits for it.
# The Triton interpreter tests need the triton that SGLang's install brings (the dev install has none).
ENGINE_TESTS=(tests/integrations tests/tiers/test_events.py tests/gateway/test_events_tokens.py tests/faults/test_events_kill.py
    tests/kvstore/codec/test_sglang_v4_triton_interpret.py tests/kvstore/codec/test_rows_triton_interpret.py)
# A pinned package the venv holds at another version would change under the running tests: then
# the install runs first, as before.
clash=$(python scripts/engines/clash.py scripts/engines/*.txt)
engines_log=$(mktemp)
if [ -n "$clash" ]; then
    echo "== inference engines (vllm, sglang): installing first, the venv holds $clash ($((SECONDS - start)) s)"
    bash scripts/install_engines.sh .venv >"$engines_log" 2>&1 &
    wait $! || true
else
    echo "== inference engines (vllm, sglang): installing in the background, log at the end ($((SECONDS - start)) s)"
    bash scripts/install_engines.sh .venv >"$engines_log" 2>&1 &
fi
engines=$!
trap 'kill "$engines" 2>/dev/null || true; rm -f "$engines_log"' EXIT
engines_ready() {
    echo "== inference engines: waiting for the install ($((SECONDS - start)) s)"
    wait "$engines" || true
    sed 's/^/   /' "$engines_log"
}

echo "== lint ($((SECONDS - start)) s)"
ruff check .

echo "== tests ($((SECONDS - start)) s)"
# -rs: every skip says why in the CI output; --durations: the slowest tests, to keep the run short. Two workers (pytest-xdist), each test file on one of
# them in file order (--dist loadfile: a module's fixtures and its story stay in one process): most
# tests wait on child processes (servers, etcd, Redis), so two cores run two files at once.
# ENGINE_TESTS run apart, after the rest, once the engines are in: one of vLLM's preemption tests
# failed in every shared two-worker run and never in a process of their own (cause not found; see
# docs/ENGINES.md). Arguments given: one run of exactly them, after the engines and types.
# --no-loadscope-reorder: the files in collection order, where tests/conftest.py puts the slowest first
# (SLOW_FILES_FIRST), so that the run does not end on one worker's long file.
workers=(-n "${KVSTORE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
types() { echo "== types ($((SECONDS - start)) s)"; mypy kvstore tiers gateway replay scripts integrations; }
if [ $# -eq 0 ]; then
    python -m pytest -q -rs --durations=15 "${workers[@]}" "${ENGINE_TESTS[@]/#/--ignore=}"
    engines_ready
    # The types beside the engine tests (mypy is one process, the engine tests mostly wait on vLLM's and
    # SGLang's imports): about a minute off the whole command. Its output is printed once it ends.
    types_log=$(mktemp)
    trap 'kill "$engines" 2>/dev/null || true; rm -f "$engines_log" "$types_log"' EXIT
    types >"$types_log" 2>&1 & types_pid=$!
    echo "== engine tests, the types beside them ($((SECONDS - start)) s)"
    tests_rc=0; python -m pytest -q -rs "${workers[@]}" "${ENGINE_TESTS[@]}" || tests_rc=$?
    types_rc=0; wait "$types_pid" || types_rc=$?
    cat "$types_log"
    [ "$tests_rc" -eq 0 ] && [ "$types_rc" -eq 0 ] || { echo "engine tests rc=$tests_rc, types rc=$types_rc" >&2; exit 1; }
else
    engines_ready
    types
    python -m pytest -q -rs "${workers[@]}" "$@"
fi
echo "== done in $((SECONDS - start)) s"
