#!/usr/bin/env bash
# Builds the lunakv wheel (the `mooncake` package: mooncake.store, mooncake.engine) and runs its
# pytest suite against the real lunakv-master / lunakv-store binaries.
#
#   bindings/python/build.sh          build the wheel, install it into the venv, run the tests
#   bindings/python/build.sh wheel    only build and install the wheel
#   bindings/python/build.sh bench    release wheel + release binaries, then bench/bench_store.py
#                                     (lunakv vs upstream side by side; BENCH_ARGS=--no-upstream
#                                     for lunakv alone)
#   bindings/python/build.sh bench-meta  the same build, then bench/bench_meta.py (the masters'
#                                     memory per key and ops per CPU-second, side by side)
#   bindings/python/build.sh bench-cluster  the same build, then bench/bench_cluster.py (K stores
#                                     and J requesters in network namespaces; needs root)
#   bindings/python/build.sh bench-trace  the same build, then bench/bench_trace.py (a trace
#                                     replayed from Python, lunakv vs upstream's wheel)
#   bindings/python/build.sh bench-busy  the same build, then bench/bench_busy.py (vLLM's save and
#                                     load beside two busy loops, against upstream's wheel)
#
# Environment: VENV (default <repo>/.venv), PYTHON (the interpreter that creates the venv,
# default python3), PROFILE (cargo profile for the wheel: dev, the default, builds fast for
# tests; use release for a wheel to ship), PYTEST_ARGS (extra pytest arguments).
# Needs PyPI for maturin, pytest, numpy (and pyzmq, msgpack, msgspec: the KV event tests) on the
# first run.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
target=${CARGO_TARGET_DIR:-$repo/target}
VENV=${VENV:-$repo/.venv}
PYTHON=${PYTHON:-python3}
what=${1:-test}
if [ "${what#bench}" != "$what" ]; then
    PROFILE=${PROFILE:-release}
else
    PROFILE=${PROFILE:-dev}
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV" || {
        echo "cannot create a venv with $PYTHON: install python3-venv (apt-get install -y python3-venv)" >&2
        exit 1
    }
fi
"$VENV/bin/python" -m pip install -q "maturin>=1.9.4,<2" pytest numpy grpcio grpcio-reflection grpcio-health-checking pyzmq msgpack msgspec

echo "== wheel (profile $PROFILE)"
rm -f "$target"/wheels/lunakv-*.whl
"$VENV/bin/maturin" build -m "$here/Cargo.toml" --profile "$PROFILE" \
    -i "$VENV/bin/python" -o "$target/wheels"
"$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$target"/wheels/lunakv-*.whl

if [ "$what" = test ]; then
    echo "== python tests"
    # The tests start the real binaries.
    (cd "$repo" && cargo build --bins)
    export LUNAKV_BIN_DIR=${LUNAKV_BIN_DIR:-$target/debug}
    cd "$here"
    # shellcheck disable=SC2086
    "$VENV/bin/python" -m pytest -q tests ${PYTEST_ARGS:-}
fi
if [ "${what#bench}" != "$what" ]; then
    echo "== benchmark"
    (cd "$repo" && cargo build --release --bins)
    case $what in
        bench) script=bench_store.py ;;
        bench-meta) script=bench_meta.py ;;
        bench-cluster) script=bench_cluster.py ;;
        bench-trace) script=bench_trace.py ;;
        bench-busy) script=bench_busy.py ;;
        *) echo "unknown benchmark $what (bench, bench-meta, bench-cluster, bench-trace, bench-busy)" >&2; exit 2 ;;
    esac
    # shellcheck disable=SC2086
    "$VENV/bin/python" "$here/bench/$script" --lunakv-python "$VENV/bin/python" \
        --bin-dir "${LUNAKV_BIN_DIR:-$target/release}" ${BENCH_ARGS:-}
fi
