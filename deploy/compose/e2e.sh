#!/usr/bin/env bash
# make e2e-compose: the compose stack, end to end, on this machine.
#
# 1. builds the images (deploy/docker/build-images.sh; SKIP_IMAGES=1 reuses them),
# 2. `docker-compose up -d` under its own project name, waits until every container is healthy,
# 3. drives a chat completion through the routing sidecar with x-prefiller-host-port pointing at
#    the prefill simulator, and checks that the decode engine received the KV from the prefill
#    engine (not a local recompute) and answered exactly what a decode-only request answers,
# 4. puts and gets objects through the store with the CLI container on the stack's network
#    (the HA master found through etcd from the engine's mooncake_config.json, and by --master
#    master:50051), and checks the bytes, the leader election and the master's view of the pool,
# 4b. runs deploy/compose/engine-image.sh: lunakv's Python package in a vLLM stand-in through
#    the lunakv/python init container's volume and PYTHONPATH (profile `engine`),
# 5. starts a second bootstrap replica on the etcd table and checks it lists the prefill engine,
#    then runs `lunakv doctor` in the CLI container (every check passes) and once with a mismatched
#    sidecar connector (it must fail that row),
# 6. fills the store-client's 64 MB segment past the eviction watermark and checks that evicted
#    objects went to the SSD tier (the offload volume grew) and come back byte-exact,
# 7. monitoring (the `observability` profile, on by default here): Prometheus scrapes every
#    service (up == 1 for each target), then every PromQL expression of every dashboard panel in
#    deploy/grafana runs against it and must return data (deploy/compose/dashboard_queries.py
#    would name any the run cannot feed, and why: none today); trace export is on towards a collector that
#    is not there (LUNAKV_OTLP_ENDPOINT=http://jaeger:4318, the observability-ui profile's
#    Jaeger, which cannot be pulled here): each service says so in at most one log line, and
#    P/D completions stay fast,
# 8. always brings the stack down (`docker-compose down -v`), printing logs if anything failed.
#
# Host ports are published on loopback, on free ports picked by Docker; nothing else is reached.
# Environment: SKIP_IMAGES=1, LUNAKV_PROFILE=debug (images from target/debug, e.g. after
# `make test` in CI), KEEP_STACK=1 (leave it running for inspection), E2E_TIMEOUT (s, 120),
# COMPOSE_PROFILES (default observability; empty skips step 7), LUNAKV_OTLP_ENDPOINT (default
# http://jaeger:4318; empty turns trace export off).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-lunakv-e2e}
export LUNAKV_SIDECAR_PORT=0 LUNAKV_MASTER_ADMIN_PORT=0 LUNAKV_PROMETHEUS_PORT=0
# Every command below (up, run, ps, down) sees the same services.
export COMPOSE_PROFILES=${COMPOSE_PROFILES-observability}
export LUNAKV_OTLP_ENDPOINT=${LUNAKV_OTLP_ENDPOINT-http://jaeger:4318}
observability=0
[[ ",$COMPOSE_PROFILES," == *,observability,* || ",$COMPOSE_PROFILES," == *,observability-ui,* ]] && observability=1
# A small segment, so a few puts reach the eviction watermark and exercise the SSD tier.
export LUNAKV_STORE_SEGMENT_SIZE=64MB
COMPOSE=(docker-compose -f "$ROOT/compose.yaml")
if ! command -v docker-compose >/dev/null && docker compose version >/dev/null 2>&1; then
    COMPOSE=(docker compose -f "$ROOT/compose.yaml")
fi
TIMEOUT=${E2E_TIMEOUT:-120}
T0=$(date +%s)
passed=0
failed=0
WORK=$(mktemp -d)

step() { printf '\n== %s (%ss)\n' "$*" "$(($(date +%s) - T0))"; }
ok() { printf 'ok   %s\n' "$*"; passed=$((passed + 1)); }
fail() { printf 'FAIL %s\n' "$*"; failed=$((failed + 1)); }
json() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
# has_metric URL REGEX: fetch first, then grep the file. `curl | grep -q` under pipefail fails
# when grep exits at its first match and curl dies writing the rest (curl: (23)).
has_metric() { curl -sS -m 10 "$1" >"$WORK/metrics.txt" && grep -Eq "$2" "$WORK/metrics.txt"; }

cleanup() {
    rc=$?
    if [ "$rc" -ne 0 ] || [ "$failed" -ne 0 ]; then
        echo; echo "== stack state at failure"
        "${COMPOSE[@]}" ps || true
        "${COMPOSE[@]}" logs --no-color --tail=40 || true
    fi
    if [ "${KEEP_STACK:-0}" = 1 ]; then
        echo "KEEP_STACK=1: the stack is still up; stop it with: COMPOSE_PROJECT_NAME=$COMPOSE_PROJECT_NAME docker-compose down -v"
    else
        docker rm -f "${COMPOSE_PROJECT_NAME}_bootstrap_replica" >/dev/null 2>&1 || true
        "${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
    fi
    rm -rf "$WORK"
    echo "e2e-compose: wall time $(($(date +%s) - T0)) s"
}
trap cleanup EXIT

command -v curl >/dev/null || { echo "e2e-compose needs curl on the host (apt-get install curl)"; exit 2; }

if [ "${SKIP_IMAGES:-0}" != 1 ]; then
    step "images"
    deploy/docker/build-images.sh
fi

step "docker-compose up -d"
"${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
"${COMPOSE[@]}" up -d

step "waiting for every container to be healthy (up to ${TIMEOUT}s)"
deadline=$(($(date +%s) + TIMEOUT))
while :; do
    states=$(docker inspect -f '{{.Name}} {{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}' \
        $("${COMPOSE[@]}" ps -q))
    if ! grep -vq ' healthy$' <<<"$states"; then break; fi
    if [ "$(date +%s)" -gt "$deadline" ]; then
        echo "$states"; fail "stack healthy within ${TIMEOUT}s"; exit 1
    fi
    sleep 1
done
echo "$states"
ok "all $(wc -l <<<"$states") containers healthy"

SIDECAR=$("${COMPOSE[@]}" port sidecar 8000)
ADMIN=$("${COMPOSE[@]}" port master 9003)
echo "sidecar on $SIDECAR, master admin on $ADMIN"

step "P/D completion through the sidecar"
body='{"model":"sim-model","messages":[{"role":"user","content":"lunakv compose end to end: the decoder must pull this prompt'"'"'s KV from the prefiller"}],"max_tokens":12}'
code=$(curl -sS -o "$WORK/pd.json" -w '%{http_code}' -m 30 "http://$SIDECAR/v1/chat/completions" \
    -H 'content-type: application/json' -H 'x-prefiller-host-port: prefill:8200' -d "$body")
pd_text=$(json 'd["choices"][0]["message"]["content"]' <"$WORK/pd.json" 2>/dev/null || true)
if [ "$code" = 200 ] && [ -n "$pd_text" ]; then
    ok "disaggregated completion: HTTP $code, \"$pd_text\""
else
    fail "disaggregated completion: HTTP $code: $(head -c 400 "$WORK/pd.json")"
fi
# /sim/stats is not a disaggregated route, so the sidecar proxies it to its decode engine.
curl -sS -m 10 "http://$SIDECAR/sim/stats" >"$WORK/stats.json"
read -r received remote failed_x < <(json 'd["kv_bytes_received"], d["remote_decodes"], d["transfers_failed"]' <"$WORK/stats.json" | tr -d '(),')
if [ "${received:-0}" -gt 0 ] && [ "${remote:-0}" -ge 1 ] && [ "${failed_x:-1}" = 0 ]; then
    ok "decode engine pulled ${received} KV bytes from the prefill engine (remote decodes ${remote}, failed transfers 0)"
else
    fail "KV did not move from prefill to decode: $(cat "$WORK/stats.json")"
fi
code=$(curl -sS -o "$WORK/local.json" -w '%{http_code}' -m 30 "http://$SIDECAR/v1/chat/completions" \
    -H 'content-type: application/json' -d "$body")
local_text=$(json 'd["choices"][0]["message"]["content"]' <"$WORK/local.json" 2>/dev/null || true)
if [ "$code" = 200 ] && [ "$local_text" = "$pd_text" ]; then
    ok "decode-only answer is identical (the transferred KV was byte-exact)"
else
    fail "decode-only answer differs: HTTP $code \"$local_text\" vs \"$pd_text\""
fi
if has_metric "http://$SIDECAR/lunakv/sidecar/metrics" '^lunakv_sidecar_disaggregated_total [1-9]'; then
    ok "sidecar counted the disaggregated request (/lunakv/sidecar/metrics)"
else
    fail "lunakv_sidecar_disaggregated_total is not >= 1"
fi

step "put/get through the store with the CLI container"
cli() { "${COMPOSE[@]}" run --rm -T cli "$@" 2>"$WORK/cli.err"; }
head -c $((3 * 1024 * 1024 + 17)) /dev/urandom >"$WORK/blob"
if cli put e2e/blob - <"$WORK/blob" >/dev/null && cli --master master:50051 get e2e/blob >"$WORK/blob.out" \
    && cmp -s "$WORK/blob" "$WORK/blob.out"; then
    ok "3 MiB object: put (master from mooncake_config.json) == get (--master master:50051)"
else
    fail "put/get of a 3 MiB object: $(cat "$WORK/cli.err")"
fi
# The CLI container shares the store's socket volume and node name, so it moved those bytes
# through shared memory, as a same-node engine pod does (deploy/k8s: patch-vllm-shm.yaml).
store_metrics='exec 3<>/dev/tcp/store/9004 && printf "GET /metrics HTTP/1.0\r\nHost: store\r\n\r\n" >&3 && cat <&3'
attaches=$("${COMPOSE[@]}" run --rm -T --entrypoint bash cli -c "$store_metrics" 2>/dev/null \
    | awk '$1 == "lunakv_store_shm_attaches_total" {print $2}')
if [ "${attaches:-0}" -ge 1 ] 2>/dev/null; then
    ok "the CLI container mapped the store's segment over the shared socket (shm attaches ${attaches})"
else
    fail "the CLI container did not use shm: lunakv_store_shm_attaches_total=${attaches:-missing}"
fi
if echo "hello from compose" | cli --master master:50051 put e2e/hello - >/dev/null \
    && [ "$(cli get e2e/hello)" = "hello from compose" ] && cli exists e2e/hello >/dev/null; then
    ok "small object round trip and exists"
else
    fail "small object round trip: $(cat "$WORK/cli.err")"
fi
# A vLLM-shaped key (MooncakeStoreConnector's <model>@tp_rank:<r>@<chunk hash>) put by one CLI
# container and found by another (each is its own client): the cross-instance hit the master
# counts per key namespace (lunakv_namespace_*, the pool dashboard's consistency panels).
vkey='sim-model@tp_rank:0@00c0ffee'
if echo "kv block" | cli put "$vkey" - >/dev/null && cli exists "$vkey" >/dev/null \
    && has_metric "http://$ADMIN/metrics" '^lunakv_namespace_shared_keys_total\{namespace="sim-model@tp_rank:0"\} [1-9]'; then
    ok "a vLLM-shaped key put by one client and found by another counts as shared in its namespace"
else
    fail "vLLM-shaped key $vkey: $(cat "$WORK/cli.err"); $(grep '^lunakv_namespace' "$WORK/metrics.txt" 2>/dev/null | head -n 5)"
fi
if cli --json status >"$WORK/status.json"; then
    read -r cap keys segs < <(json 'd["capacity_bytes"], d["keys"], len(d["segments"])' <"$WORK/status.json" | tr -d '(),')
    if [ "${cap:-0}" -gt 0 ] && [ "${keys:-0}" -ge 2 ] && [ "${segs:-0}" -ge 1 ]; then
        ok "master sees the pool: capacity ${cap} B, ${keys} keys, ${segs} segment(s)"
    else
        fail "master status: $(cat "$WORK/status.json")"
    fi
else
    fail "lunakv status: $(cat "$WORK/cli.err")"
fi
if has_metric "http://$ADMIN/metrics" '^master_is_leader 1'; then
    ok "the master is the elected leader in etcd (master_is_leader 1)"
else
    fail "master_is_leader is not 1 on http://$ADMIN/metrics"
fi
if has_metric "http://$ADMIN/metrics" '^master_total_capacity_bytes [1-9]'; then
    ok "master /metrics reports the pool's capacity"
else
    fail "master_total_capacity_bytes is not > 0 on http://$ADMIN/metrics"
fi

step "engine image: lunakv's Python package through the lunakv/python init container"
# deploy/compose/engine-image.sh: the vLLM stand-in gets `mooncake` only from the init
# container's volume + PYTHONPATH, and its put reaches this stack's store.
if deploy/compose/engine-image.sh; then
    ok "engine image: import mooncake.store in the vLLM stand-in is lunakv's, put/get against the stack"
else
    fail "engine image (deploy/compose/engine-image.sh, output above)"
fi

step "a second bootstrap replica answers from the shared etcd table"
# Beside the first one (same network namespace, other ports), with nothing registered at it:
# prefill-0 in its /query can only have come from etcd.
# (docker run: docker-compose 1.x cannot `run` a service that shares another's network.)
docker run -d --name "${COMPOSE_PROJECT_NAME}_bootstrap_replica" \
    --network "container:$("${COMPOSE[@]}" ps -q prefill)" lunakv/bootstrap:dev \
    --host=127.0.0.1 --port=8997 --grpc-port=8996 --etcd-endpoints=etcd:2379 --cluster-id=mooncake_cluster >/dev/null
replica_query=""
for _ in $(seq 1 30); do
    replica_query=$(docker exec "${COMPOSE_PROJECT_NAME}_bootstrap_replica" bash -c \
        'exec 3<>/dev/tcp/127.0.0.1/8997 && printf "GET /query HTTP/1.0\r\nHost: x\r\n\r\n" >&3 && cat <&3' 2>/dev/null || true)
    grep -q '"prefill-0"' <<<"$replica_query" && break
    sleep 1
done
docker rm -f "${COMPOSE_PROJECT_NAME}_bootstrap_replica" >/dev/null 2>&1 || true
if grep -q '"prefill-0"' <<<"$replica_query"; then
    ok "bootstrap replica lists prefill-0 from etcd: $(tail -n1 <<<"$replica_query")"
else
    fail "bootstrap replica on the shared etcd table does not list prefill-0: $replica_query"
fi

step "the store image carries the rdma transport"
# Built with the `rdma` feature and libibverbs in the image: asked for rdma on a host with no
# RDMA device, the store says so and serves tcp. A build without the feature would say "this
# lunakv build has no RDMA transport"; one that failed to load libibverbs would not start.
# The log is read whole first: `logs | grep -q` under pipefail fails when grep exits at its
# match before compose has written the rest (SIGPIPE), as has_metric explains.
store_log=$("${COMPOSE[@]}" logs store 2>&1 || true)
if grep -q 'requested but unavailable (no RDMA device found' <<<"$store_log"; then
    ok "store: protocol rdma requested, no RDMA device here: one WARN line, serving tcp"
else
    fail "store log lacks the rdma fallback line: $(grep -i rdma <<<"$store_log" | head -n 3)"
fi

step "lunakv doctor inside the stack"
# The same flags an operator gives it (deploy/README.md): the engine config the CLI container
# mounts, the store-client's admin port and offload volume, the prefill's bootstrap, and the
# sidecar's flags against the engine's --kv-transfer-config.
if cli doctor --config /etc/mooncake/mooncake_config.json --store store:9004 --offload-dir /data/mooncake-offload --bootstrap prefill:8998 \
    --sidecar-args "--kv-connector=mooncake --mooncake-bootstrap-port=8998" \
    --kv-transfer-config '{"kv_connector":"MooncakeConnector","kv_role":"kv_both"}' >"$WORK/doctor.txt"; then
    ok "lunakv doctor: every check passes ($(grep -c ' pass ' "$WORK/doctor.txt" || true) rows pass)"
else
    fail "lunakv doctor failed: $(cat "$WORK/doctor.txt" "$WORK/cli.err")"
fi
if cli doctor --sidecar-args "--kv-connector=nixlv2" \
    --kv-transfer-config '{"kv_connector":"MooncakeConnector","kv_role":"kv_both"}' >"$WORK/doctor-bad.txt"; then
    fail "lunakv doctor passed a sidecar/engine connector mismatch: $(cat "$WORK/doctor-bad.txt")"
elif grep -q "connectors" "$WORK/doctor-bad.txt" && grep -qi "fail" "$WORK/doctor-bad.txt"; then
    ok "lunakv doctor flags a sidecar/engine connector mismatch (exit 1)"
else
    fail "lunakv doctor on a connector mismatch: $(cat "$WORK/doctor-bad.txt" "$WORK/cli.err")"
fi

step "SSD tier: fill the 64 MB segment; evicted objects go to disk and come back"
# 24 deterministic 4 MiB objects in one CLI container (96 MiB > 95% of 64 MiB).
fill='for i in $(seq 1 24); do yes "obj-$i" | head -c 4194304 | lunakv put e2e/fill-$i - >/dev/null || exit 1; done'
if "${COMPOSE[@]}" run --rm -T --entrypoint bash cli -c "$fill" 2>"$WORK/cli.err"; then
    ok "24 x 4 MiB puts into a 64 MB segment (eviction made room)"
else
    fail "filling the segment: $(cat "$WORK/cli.err")"
fi
on_disk=0
for _ in $(seq 1 30); do
    on_disk=$(curl -sS -m 5 "http://$ADMIN/metrics" | awk '$1 == "master_disk_key_count" {print $2}')
    [ "${on_disk:-0}" -gt 0 ] 2>/dev/null && break
    sleep 0.5
done
offload_bytes=$("${COMPOSE[@]}" run --rm -T --entrypoint bash cli -c 'du -sb /data/mooncake-offload | cut -f1' 2>/dev/null || echo 0)
if [ "${on_disk:-0}" -gt 0 ] 2>/dev/null && [ "${offload_bytes:-0}" -gt 4194304 ]; then
    ok "evicted objects are on disk: master_disk_key_count ${on_disk}, /data/mooncake-offload ${offload_bytes} B"
else
    fail "nothing reached the SSD tier: master_disk_key_count ${on_disk:-?}, offload dir ${offload_bytes:-?} B"
    curl -sS -m 5 "http://$ADMIN/metrics" | grep -E '^master_(disk|offload|evicted)' || true
fi
want=$( (yes obj-1 || true) | head -c 4194304 | sha256sum | cut -d' ' -f1) # yes dies of SIGPIPE
got=$( (cli get e2e/fill-1 || true) | sha256sum | cut -d' ' -f1)
if [ "$got" = "$want" ]; then
    ok "the first (evicted) object reads back byte-exact"
else
    fail "e2e/fill-1 after eviction: sha256 $got, want $want: $(cat "$WORK/cli.err")"
fi

if [ "$observability" = 1 ]; then
    step "monitoring: Prometheus scrapes every service; every dashboard query returns data"
    PROM=$("${COMPOSE[@]}" port prometheus 9090)
    echo "Prometheus on http://$PROM"
    # More P/D traffic, timed, while trace export fails (no collector): requests must not wait
    # on it. It also spreads the sidecar's samples over several scrapes.
    : >"$WORK/pd-times"
    for _ in $(seq 1 20); do
        curl -sS -o /dev/null -w '%{time_total}\n' -m 30 "http://$SIDECAR/v1/chat/completions" \
            -H 'content-type: application/json' -H 'x-prefiller-host-port: prefill:8200' -d "$body" >>"$WORK/pd-times" || true
    done
    read -r n p50 worst < <(python3 -c "import sys; t=sorted(float(x) for x in open('$WORK/pd-times') if x.strip()); print(len(t), int(t[len(t)//2]*1000) if t else -1, int(t[-1]*1000) if t else -1)")
    if [ "$n" = 20 ] && [ "$worst" -lt 2000 ]; then
        ok "20 P/D completions with trace export on: p50 ${p50} ms, max ${worst} ms"
    else
        fail "P/D completions with trace export on: $n of 20 answered, p50 ${p50} ms, max ${worst} ms"
    fi
    # Every target up, and two scrapes of each after the traffic above, so rate() sees it.
    t_traffic=$(date +%s)
    # master, store, bootstrap, sidecar, 2 engines, etcd and Prometheus itself
    want_targets=8
    targets=""
    for _ in $(seq 1 30); do
        targets=$(curl -sS -m 5 "http://$PROM/api/v1/targets?state=active" | python3 -c "
import json, sys, datetime
ts = json.load(sys.stdin)['data']['activeTargets']
after = $t_traffic + 2
fresh = all(datetime.datetime.fromisoformat(t['lastScrape'][:26].rstrip('Z')).replace(tzinfo=datetime.timezone.utc).timestamp() >= after for t in ts)
up = [t['labels']['job'] + '/' + t['labels']['instance'] for t in ts if t['health'] == 'up']
down = [t['labels']['job'] + '/' + t['labels']['instance'] + ': ' + (t.get('lastError') or t['health']) for t in ts if t['health'] != 'up']
print('fresh' if fresh else 'stale', len(up), ' '.join(sorted(up)), '|', '; '.join(down))
" 2>/dev/null || true)
        read -r fresh n_up _ <<<"$targets"
        [ "$fresh" = fresh ] && [ "${n_up:-0}" -ge "$want_targets" ] && break
        sleep 1
    done
    if [ "${fresh:-}" = fresh ] && [ "${n_up:-0}" -ge "$want_targets" ]; then
        ok "Prometheus scrapes every service: $(cut -d' ' -f3- <<<"$targets" | cut -d'|' -f1)"
    else
        fail "Prometheus targets: $targets"
    fi
    if python3 deploy/compose/dashboard_queries.py "http://$PROM" >"$WORK/queries.txt" 2>&1; then
        ok "every dashboard query runs on the real Prometheus: $(tail -n1 "$WORK/queries.txt")"
    else
        fail "dashboard queries: $(tail -n1 "$WORK/queries.txt")"
    fi
    cat "$WORK/queries.txt"
fi

if [ -n "$LUNAKV_OTLP_ENDPOINT" ]; then
    step "trace export to an absent collector ($LUNAKV_OTLP_ENDPOINT): one line, no flood"
    # The export is on in every lunakv service; with no collector each must say so once, not
    # once per batch (the SDK's own lines were two per batch, every 5 s, per service).
    loud=""
    said=0
    for svc in master store bootstrap prefill decode sidecar; do
        n=$("${COMPOSE[@]}" logs --no-color "$svc" 2>/dev/null | grep -ciE 'export traces|trace export|opentelemetry|otlp' || true)
        echo "$svc: $n line(s) about trace export"
        [ "$n" -gt 0 ] && said=$((said + 1))
        [ "$n" -gt 1 ] && loud="$loud $svc($n)"
    done
    if [ -z "$loud" ] && [ "$said" -ge 1 ]; then
        ok "trace export failing quietly: at most one line per service ($said services said so)"
    else
        fail "trace export to an absent collector: too many lines from$loud, or none at all (said=$said)"
    fi
fi

echo
echo "e2e-compose: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
