#!/usr/bin/env bash
# One arm of a pair: IMPL (lunakv or upstream), run inside `unshare -n` (a network namespace of
# its own with only loopback, so the fixed ports 50051, 8000 and 9003 are free and nothing reaches
# the network). Starts the implementation's master, `vllm serve` of the tiny model with vLLM's
# MooncakeStoreConnector (embedded mode: the worker process contributes a 1 GB segment), waits
# for /health, then client.py (quiet phase, then beside two busy loops); stops both.
# Usage: unshare -n arm.sh IMPL OUTDIR [client.py args...]   (WORK as for setup.sh)
set -u
IMPL=$1; OUT=$2; shift 2
here=$(cd "$(dirname "$0")" && pwd)
WORK=${WORK:-/tmp/lunakv-vllm-cpu}
VLLM_VENV=${VLLM_VENV:-$WORK/venv-vllm}
mkdir -p "$OUT"
ip link set lo up
MPORT=50051
case $IMPL in
    lunakv*)
        SITE=$WORK/site-lunakv
        mkdir -p "$OUT/master-data"
        "$WORK/bin/lunakv-master" --rpc_address=127.0.0.1 --rpc_port=$MPORT --metrics_port=0 \
            --data_dir="$OUT/master-data" > "$OUT/master.log" 2>&1 &
        MPID=$!
        export LUNAKV_LOG=error
        ;;
    upstream*)
        SITE=$WORK/site-upstream
        "$SITE/mooncake/mooncake_master" --rpc_port=$MPORT --rpc_address=127.0.0.1 --metrics_port=9003 \
            > "$OUT/master.log" 2>&1 &
        MPID=$!
        export MC_TCP_BIND_ADDRESS=127.0.0.1 MC_METADATA_SERVER=P2PHANDSHAKE GLOG_minloglevel=2 MC_LOG_LEVEL=ERROR
        ;;
    *) echo "unknown IMPL $IMPL (lunakv, upstream)" >&2; exit 2 ;;
esac
for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$MPORT) 2>/dev/null && break; sleep 0.1; done
cat > "$OUT/mooncake.json" <<J
{"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "master_server_address": "127.0.0.1:$MPORT",
 "protocol": "tcp", "device_name": "", "mode": "embedded", "global_segment_size": "1GB", "local_buffer_size": "512MB"}
J
# VLLM_TARGET_DEVICE=cpu: with the version's "+cpu" (setup.sh), vLLM picks its CPU platform.
export MOONCAKE_CONFIG_PATH=$OUT/mooncake.json PYTHONPATH=$SITE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1 PYTHONHASHSEED=0 VLLM_SERVER_DEV_MODE=1 \
    VLLM_NO_USAGE_STATS=1 VLLM_TARGET_DEVICE=cpu DO_NOT_TRACK=1
"$VLLM_VENV/bin/python" -c "import mooncake.store as s; print('mooncake.store from', s.__file__)" > "$OUT/which.txt" 2>&1
# shellcheck disable=SC2086
"$VLLM_VENV/bin/vllm" serve "$WORK/model" --served-model-name tiny --host 127.0.0.1 --port 8000 \
    --dtype bfloat16 --max-model-len 2048 --enforce-eager --no-enable-prefix-caching --enable-prompt-tokens-details \
    --kv-transfer-config '{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both"}' ${VLLM_EXTRA:-} \
    > "$OUT/serve.log" 2>&1 &
SPID=$!
ok=0
for _ in $(seq 600); do
    if curl -sf http://127.0.0.1:8000/health >/dev/null 2>&1; then ok=1; break; fi
    kill -0 $SPID 2>/dev/null || break
    sleep 0.5
done
rc=1
if [ $ok = 1 ]; then
    "$VLLM_VENV/bin/python" "$here/client.py" --impl "$IMPL" --out "$OUT" --server-pid $SPID "$@" > "$OUT/client.log" 2>&1
    rc=$?
    echo "client rc=$rc" >> "$OUT/client.log"
else
    echo "server did not come up (see $OUT/serve.log)" > "$OUT/client.log"
fi
kill -INT $SPID
for _ in $(seq 60); do kill -0 $SPID 2>/dev/null || break; sleep 0.5; done
pkill -9 -P $SPID 2>/dev/null  # the server's own children, if any are left
kill -9 $SPID 2>/dev/null
kill $MPID; wait $MPID 2>/dev/null
exit $rc
