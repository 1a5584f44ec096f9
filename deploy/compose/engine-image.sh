#!/usr/bin/env bash
# The engine-image test: lunakv's Python package reaches an engine container whose image was not
# rebuilt, the way the Kubernetes overlays deliver it, and `import mooncake.store` there is
# lunakv's, talking to the stack's store. Run by deploy/compose/e2e.sh against its running stack
# (or by hand against `docker-compose up -d`, same COMPOSE_PROJECT_NAME).
#
# lunakv/vllm-standin is a TEST DOUBLE of vLLM's image: Debian's python3 with no `mooncake`
# module of its own. The compose profile `engine` runs the lunakv/python init service into the
# lunakv-python volume, then the stand-in with that volume and PYTHONPATH=/opt/lunakv/python.
# Checks:
#   1. without PYTHONPATH the stand-in has no `mooncake` (so nothing below can come from the image);
#   2. with it, mooncake and mooncake.store load from the volume, the distribution is `lunakv`
#      (importlib.metadata) with mooncake.__version__, and lunakv's native mooncake._lunakv is
#      the module behind MooncakeDistributedStore (upstream's wheel has neither);
#   3. MooncakeDistributedStore.setup_from_env() (MOONCAKE_CONFIG_PATH, master via etcd) + put +
#      get round-trips an object, and the CLI container reads the same bytes back
#      from the store, so the engine's put reached the stack's pool;
#   4. the init container as Kubernetes runs it (uid 10001, read-only root, no capabilities)
#      fills a root-owned 0777 volume (an emptyDir's shape), and another uid imports from it.
# Prints one `ok`/`FAIL` line per check; exits 1 if any failed.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
COMPOSE=(docker-compose -f "$ROOT/compose.yaml")
if ! command -v docker-compose >/dev/null && docker compose version >/dev/null 2>&1; then
    COMPOSE=(docker compose -f "$ROOT/compose.yaml")
fi
COMPOSE+=(--profile engine)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
failed=0
ok() { printf 'ok   %s\n' "$*"; }
fail() { printf 'FAIL %s\n' "$*"; failed=$((failed + 1)); }

standin() { "${COMPOSE[@]}" run --rm -T "$@" 2>"$WORK/run.err"; }
# `run` starts an existing one-shot lunakv-python container as it is; a fresh one copies what
# the current image holds.
"${COMPOSE[@]}" rm -fsv lunakv-python >/dev/null 2>&1 || true

# 1. The stand-in alone: no mooncake. (PYTHONPATH= empties the compose-set value.)
if standin -e PYTHONPATH= vllm-standin python3 -c 'import mooncake' >/dev/null; then
    fail "the stand-in imports mooncake without PYTHONPATH: it is no stand-in for vLLM's image"
elif grep -q "No module named 'mooncake'" "$WORK/run.err"; then
    ok "without PYTHONPATH the stand-in has no mooncake module"
else
    fail "the stand-in without PYTHONPATH: $(tail -n 5 "$WORK/run.err")"
fi

# 2 + 3. With the volume and PYTHONPATH (compose.yaml's vllm-standin service).
key="engine-image/$(date +%s)-$$"
value="lunakv python package through an init container $RANDOM"
cat >"$WORK/check.py" <<'PY'
import importlib.metadata, json, os, sys
import mooncake, mooncake.store, mooncake._lunakv
from mooncake.store import MooncakeDistributedStore

root = os.environ["PYTHONPATH"].split(":")[0].rstrip("/") + "/"
out = {
    "python": sys.version.split()[0],
    "mooncake": mooncake.__file__,
    "mooncake.store": mooncake.store.__file__,
    "native": mooncake._lunakv.__file__,
    "native_class": MooncakeDistributedStore is mooncake._lunakv.MooncakeDistributedStore,
    "dist": importlib.metadata.distribution("lunakv").metadata["Name"],
    "dist_version": importlib.metadata.version("lunakv"),
    "version": mooncake.__version__,
}
out["from_volume"] = all(out[k].startswith(root) for k in ("mooncake", "mooncake.store", "native"))
s = MooncakeDistributedStore()
out["setup"] = s.setup_from_env()
key, value = sys.argv[1], sys.argv[2].encode()
out["put"] = s.put(key, value) if out["setup"] == 0 else None
out["get_equal"] = out["setup"] == 0 and s.get(key) == value
print(json.dumps(out))
PY
if standin -v "$WORK/check.py:/check.py:ro" vllm-standin python3 /check.py "$key" "$value" >"$WORK/check.json"; then
    facts=$(tail -n1 "$WORK/check.json")
    echo "     $facts"
    j() { python3 -c "import json,sys; d=json.loads(sys.argv[1]); print($1)" "$facts"; }
    if [ "$(j 'd["from_volume"] and d["native_class"]')" = True ]; then
        ok "import mooncake.store resolves to the lunakv-python volume ($(j 'd["mooncake.store"]'), Python $(j 'd["python"]'))"
    else
        fail "mooncake.store did not come from the volume: $facts"
    fi
    if [ "$(j 'd["dist"] == "lunakv" and d["dist_version"] == d["version"]')" = True ]; then
        ok "the installed distribution is lunakv $(j 'd["version"]') (importlib.metadata == mooncake.__version__)"
    else
        fail "the distribution is not lunakv: $facts"
    fi
    if [ "$(j 'd["setup"] == 0 and d["put"] == 0 and d["get_equal"]')" = True ]; then
        ok "MooncakeDistributedStore.setup_from_env() + put + get in the engine container"
    else
        fail "setup/put/get in the engine container: $facts"
        sed -n '/lunakv/p' "$WORK/run.err" | tail -n 5
    fi
else
    fail "the stand-in with PYTHONPATH: $(tail -n 20 "$WORK/run.err")"
fi
if got=$("${COMPOSE[@]}" run --rm -T cli get "$key" 2>>"$WORK/run.err") && [ "$got" = "$value" ]; then
    ok "the CLI reads the engine's object back from the stack's store ($key)"
else
    fail "lunakv get $key after the engine's put: '${got:-}' $(tail -n 3 "$WORK/run.err")"
fi

# 4. As the Kubernetes overlays run it: an emptyDir is root's directory with mode 0777, and the
#    init container runs as uid 10001 with a read-only root and no capabilities
#    (components/vllm-mooncake/patch-vllm.yaml). A volume prepared the same way stands in.
vol="${COMPOSE_PROJECT_NAME:-lunakv}-engine-image-emptydir"
docker volume rm -f "$vol" >/dev/null 2>&1 || true
docker run --rm -v "$vol:/v" --user 0 --entrypoint bash lunakv/python:dev -c 'chown 0:0 /v && chmod 0777 /v' >/dev/null
if docker run --rm -v "$vol:/opt/lunakv/python" --user 10001:10001 --read-only --cap-drop ALL \
    --security-opt no-new-privileges lunakv/python:dev >"$WORK/k8s.out" 2>&1 \
    && docker run --rm -v "$vol:/opt/lunakv/python:ro" -e PYTHONPATH=/opt/lunakv/python --user 4242 \
        lunakv/vllm-standin:dev python3 -c 'import mooncake.store, mooncake._lunakv; print(mooncake.store.__file__)' \
        >>"$WORK/k8s.out" 2>&1; then
    ok "into an emptyDir-like volume (root, 0777) as uid 10001 with a read-only root; another uid imports it"
else
    fail "the init container as Kubernetes runs it: $(tail -n 5 "$WORK/k8s.out")"
fi
docker volume rm -f "$vol" >/dev/null 2>&1 || true
[ "$failed" -eq 0 ]
