#!/bin/sh
# Turns on etcd's users for lunakv, as the lunakv-etcd-auth Job runs it (tests/tests/e2e/
# etcd_security.rs runs this same file against a real etcd, twice). Safe to run again.
#
# No password exists anywhere: etcd runs with --client-cert-auth, and takes a client
# certificate's CN as the user when a call carries no token. This script presents the `root`
# certificate; lunakv's pods present the `lunakv` one.
#
# ETCD_ENDPOINTS  etcd's client URLs, comma-separated (https://...)
# ETCD_TLS_DIR    ca.crt, tls.crt, tls.key of the root certificate (a cert-manager Secret)
# LUNAKV_PREFIX   the keys lunakv may read and write (default mooncake-store/)
set -eu
: "${ETCD_ENDPOINTS:?set ETCD_ENDPOINTS to etcd's client URLs}"
: "${ETCD_TLS_DIR:?set ETCD_TLS_DIR to the directory of the root certificate}"
prefix=${LUNAKV_PREFIX:-mooncake-store/}
export ETCDCTL_API=3
ctl() {
    etcdctl --endpoints="$ETCD_ENDPOINTS" --cacert="$ETCD_TLS_DIR/ca.crt" \
        --cert="$ETCD_TLS_DIR/tls.crt" --key="$ETCD_TLS_DIR/tls.key" "$@"
}
# The first call waits for etcd (the Job may start before the members are ready).
tries=0
until ctl endpoint health >/dev/null 2>&1; do
    tries=$((tries + 1))
    [ "$tries" -lt 60 ] || { echo "etcd at $ETCD_ENDPOINTS did not answer in 120 s" >&2; exit 1; }
    sleep 2
done
ctl user get root >/dev/null 2>&1 || ctl user add root --no-password
ctl role get root >/dev/null 2>&1 || ctl role add root
ctl user get root | grep -q 'Roles: .*root' || ctl user grant-role root root
ctl role get lunakv >/dev/null 2>&1 || ctl role add lunakv
ctl role grant-permission lunakv --prefix=true readwrite "$prefix"
ctl user get lunakv >/dev/null 2>&1 || ctl user add lunakv --no-password
ctl user get lunakv | grep -q 'Roles: .*lunakv' || ctl user grant-role lunakv lunakv
ctl auth enable
echo "etcd auth on: user lunakv (certificate CN lunakv) may read and write $prefix"
