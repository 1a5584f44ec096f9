#!/usr/bin/env bash
# The GPU comparison docs/GPU.md reports ("The GPU run"): test_gpu.sh three times in a row on
# one machine, defaults, then LUNAKV_DEVICE_COALESCE=0, then LUNAKV_PIN_AHEAD=0, each run's
# service and worker logs kept under OUT (default ./gpu-compare), and one tarball of them.
# Runs from the bundle like test_gpu.sh (`make gpu-bundle`; about 3 minutes on an H200).
# Arguments go to every test_gpu.sh run. Exit status: the first failing run's, else 0.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$PWD/gpu-compare}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0
run() {
    local name=$1
    shift
    echo "== $name"
    env "$@" LUNAKV_GPU_TIMEOUT="${LUNAKV_GPU_TIMEOUT:-200}" "$here/test_gpu.sh" --keep-logs "$out/logs-$name" \
        ${ARGS:-} 2>&1 | tee "$out/$name.txt"
    local rc=${PIPESTATUS[0]}
    [ "$status" = 0 ] && status=$rc
}
run default
run no-coalesce LUNAKV_DEVICE_COALESCE=0
run no-pin-ahead LUNAKV_PIN_AHEAD=0
tar czf "$out/logs.tgz" -C "$out" logs-default logs-no-coalesce logs-no-pin-ahead 2>/dev/null
rm -rf "$out"/logs-default "$out"/logs-no-coalesce "$out"/logs-no-pin-ahead
grep -h -A14 '^MODE' "$out"/default.txt "$out"/no-coalesce.txt "$out"/no-pin-ahead.txt
exit "$status"
