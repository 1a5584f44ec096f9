#!/usr/bin/env bash
# `make test-gpu`, runnable from a copied bundle on a bare GPU machine (no network, no pip, no
# cargo): Python 3 with torch and numpy is all it needs. Without a CUDA GPU it prints one SKIP
# line and exits 0. Arguments go to test_gpu.py (--cpu-dry-run, --protocol, sizes); see its
# docstring. The whole run is bounded: it stops after LUNAKV_GPU_TIMEOUT seconds (default 480).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "SKIP test-gpu: no $PYTHON on this machine (set PYTHON=...)"
    exit 0
fi
exec timeout --kill-after=10 "${LUNAKV_GPU_TIMEOUT:-480}" "$PYTHON" "$here/test_gpu.py" --bundle "$here" "$@"
