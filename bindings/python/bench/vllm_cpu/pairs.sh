#!/usr/bin/env bash
# Paired runs of real vLLM on CPU with the MooncakeStoreConnector, lunakv's wheel against
# upstream's: each pair runs both arms (arm.sh, each in `unshare -n`), the order flipping every
# pair (L U, U L, ...), then summary.py prints the per-pair ratios and the threads.
# Usage: pairs.sh [--pairs N] [--tag TAG] [client.py args: --n REQUESTS --tokens T --gap S ...]
# Results: WORK/runs/TAG/pairI-IMPL/{result.json,serve.log,client.log,...}. Needs root (unshare)
# and setup.sh run first. IMPL_A / IMPL_B choose the arms (default lunakv, upstream).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export WORK=${WORK:-/tmp/lunakv-vllm-cpu}
pairs=3
tag=$(date -u +%Y%m%dT%H%M%S)
while [ $# -gt 0 ]; do
    case $1 in
        --pairs) pairs=$2; shift 2 ;;
        --tag) tag=$2; shift 2 ;;
        *) break ;;
    esac
done
if [ "$(id -u)" != 0 ]; then
    echo "pairs.sh needs root: each arm runs in its own network namespace (unshare -n)" >&2
    exit 1
fi
for c in unshare ip curl timeout; do
    command -v "$c" >/dev/null || { echo "pairs.sh needs $c" >&2; exit 1; }
done
for f in "$WORK/model/model.safetensors" "$WORK/bin/lunakv-master" "$WORK/site-upstream/.done" "$WORK/site-lunakv/.done"; do
    [ -e "$f" ] || { echo "missing $f: run setup.sh first (WORK=$WORK)" >&2; exit 1; }
done
runs=$WORK/runs/$tag
a=${IMPL_A:-lunakv}; b=${IMPL_B:-upstream}
echo "== $pairs pairs, $a vs $b, client args: ${*:-(defaults)}; results in $runs"
for i in $(seq 1 "$pairs"); do
    if [ $((i % 2)) = 1 ]; then order="$a $b"; else order="$b $a"; fi
    for impl in $order; do
        d=$runs/pair$i-$impl
        rm -rf "$d"; mkdir -p "$d"
        echo "$(date -u +%T) pair $i $impl, load $(cut -d' ' -f1 /proc/loadavg)"
        timeout 900 unshare -n "$here/arm.sh" "$impl" "$d" --seed "$i" "$@" \
            || echo "   arm failed (rc $?): see $d/client.log and $d/serve.log"
        grep -E "^$impl (quiet|busy):" "$d/client.log" | sed 's/^/   /' || true
    done
done
python3 "$here/summary.py" --impls "$a,$b" "$runs"
