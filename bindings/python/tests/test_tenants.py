"""Tenants through a real lunakv-master (multi-tenant mode, a policy file) and lunakv-store.

What vLLM and SGLang do with Mooncake's `tenant_id` (docs/TENANTS.md): each engine names its
tenant in its Mooncake config, and `setup(..., tenant_id=...)` scopes every key it puts, reads,
checks and removes. Upstream's master admits each tenant's memory against its quota
(`--enable_multi_tenants`, `--tenant_quota_connector_uri`) and evicts the tenant's own objects
before refusing with TENANT_QUOTA_EXCEEDED (-1700).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import BIN_DIR, INVALID_PARAMS, Proc, start_store

INVALID_KEY = -400
TENANT_QUOTA_EXCEEDED = -1700
TENANT_NOT_REGISTERED = -1701
KB = 1024
V = 64 * KB  # one object; the quota of "full" is four of them


@pytest.fixture
def tenant_master():
    """A lunakv-master in multi-tenant mode; yields (rpc, admin, policy path)."""
    with tempfile.TemporaryDirectory(prefix="lunakv-py-tenants-") as d:
        policy = Path(d) / "tenant_quotas.yaml"
        policy.write_text(
            "version: 1\n\ntenants:\n"
            "  - name: full\n    quota: 256KB\n"
            "  - name: other\n    quota: 1GB\n"
            "  - name: default\n    quota: 1GB\n"
        )
        p = Proc(
            "lunakv-master",
            [
                "--rpc_address=127.0.0.1",
                "--rpc_port=0",
                "--metrics_port=0",
                f"--data_dir={d}",
                "--enable_multi_tenants=true",
                "--tenant_quota_connector_type=file",
                f"--tenant_quota_connector_uri={policy}",
                # Leases outlive a slow CI step: the leased objects below must stay leased.
                "--default_kv_lease_ttl=60000",
            ],
        )
        try:
            line = p.wait_for("listening")
            yield line["rpc"].strip('",'), line["admin"].strip('",'), policy
        finally:
            p.stop()


def tenant(master: str, tenant_id: str | None):
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    if tenant_id is None:
        rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master)
    else:
        # SGLang's and upstream's config-dict form, as vLLM's worker passes tenant_id.
        rc = s.setup({"local_hostname": "127.0.0.1", "master_server_address": master,
                      "global_segment_size": 0, "protocol": "tcp", "tenant_id": tenant_id})
    assert rc == 0
    return s


def http(method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(admin: str, line_start: str) -> float:
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {line_start!r} in /metrics")


def test_two_tenants_one_at_its_quota(tenant_master):
    rpc, admin, policy = tenant_master
    store, _seg = start_store(rpc, "64MB")
    try:
        full, other, default = tenant(rpc, "full"), tenant(rpc, "other"), tenant(rpc, None)

        # One key, three tenants, three values.
        assert full.put("k", b"F" * V) == 0
        assert other.put("k", b"O" * V) == 0
        assert default.put("k", b"D" * V) == 0
        assert (full.get("k"), other.get("k"), default.get("k")) == (b"F" * V, b"O" * V, b"D" * V)

        # "full" reaches its quota (four objects), "other" holds eight.
        for i in range(1, 4):
            assert full.put(f"f{i}", bytes([i]) * V) == 0
        for i in range(8):
            assert other.put(f"o{i}", bytes([i]) * V) == 0
        # At its quota, a put makes room from the tenant's own oldest object ("k").
        assert full.put("f4", b"4" * V) == 0
        assert full.is_exist("k") == 0
        assert [full.get(f"f{i}") for i in range(1, 5)] == [bytes([i]) * V for i in (1, 2, 3)] + [b"4" * V]
        assert other.batch_is_exist([f"o{i}" for i in range(8)]) == [1] * 8
        assert other.get("k") == b"O" * V and default.get("k") == b"D" * V

        # Each of its objects leased to a reader: nothing of its own can go, so it is refused.
        assert full.batch_is_exist([f"f{i}" for i in range(1, 5)]) == [1] * 4
        assert full.put("f5", b"5" * V) == TENANT_QUOTA_EXCEEDED
        assert full.is_exist("f5") == 0
        # The other tenants keep putting.
        assert other.put("o8", b"8" * V) == 0
        assert default.put("d1", b"d" * V) == 0
        assert metric(admin, 'mooncake_tenant_quota_reject_total{reason="quota_exceeded",tenant_id="full"}') == 1

        # `lunakv status` shows each tenant's usage and quota.
        st = subprocess.run([str(BIN_DIR / "lunakv"), "--master", rpc, "--json", "status"],
                            capture_output=True, text=True, timeout=20)
        assert st.returncode == 0, st.stderr
        rows = {t["tenant_id"]: t for t in json.loads(st.stdout)["tenants"]}
        assert rows["full"]["objects"] == 4 and rows["full"]["dram_bytes"] == 4 * V
        assert rows["full"]["quota_bytes"] == 256 * KB and rows["full"]["quota_rejected"] == 1
        assert rows["other"]["objects"] == 10
        assert metric(admin, 'lunakv_tenant_dram_bytes{tenant_id="full"}') == 4 * V

        # remove_all takes only the caller's tenant.
        assert other.remove_all(True) == 10
        assert full.batch_is_exist([f"f{i}" for i in range(1, 5)]) == [1] * 4
        assert default.is_exist("k") == 1

        # The admin API raises the quota (saved to the policy file first); the put goes in.
        code, body = http("PUT", f"http://{admin}/api/v1/tenant_quotas?tenant_id=full",
                          {"requested_quota_bytes": 1 << 20})
        assert (code, body["success"]) == (200, True), body
        assert body["data"]["requested_quota_bytes"] == 1 << 20
        assert "quota: 1048576" in policy.read_text()
        assert full.put("f5", b"5" * V) == 0
        code, body = http("GET", f"http://{admin}/api/v1/tenant_quotas?tenant_id=full")
        assert code == 200 and body["data"]["charged_bytes"] == 5 * V, body
        # A tenant that holds objects keeps its policy.
        code, body = http("DELETE", f"http://{admin}/api/v1/tenant_quotas?tenant_id=full")
        assert code == 409 and body["error_code"] == -1702, body
        code, body = http("PUT", f"http://{admin}/api/v1/tenant_quotas?tenant_id=_x",
                          {"requested_quota_bytes": 1})
        assert code == 400 and "reserves" in body["error_message"], body

        # Multi-tenant mode refuses a tenant the policy does not name, by name.
        stranger = tenant(rpc, "stranger")
        assert stranger.put("k", b"s") == TENANT_NOT_REGISTERED
        for s in (full, other, default, stranger):
            s.close()
    finally:
        store.stop()


def test_a_master_without_tenants_mode_still_separates_tenants(master_addrs):
    """Without --enable_multi_tenants there are no quotas, but keys of different tenants never
    collide, one tenant's regex removal never reaches another's keys, and the quota API says
    how to turn quotas on."""
    master, admin = master_addrs
    store, _seg = start_store(master, "64MB")
    try:
        a, b, d = tenant(master, "team-a"), tenant(master, "team-b"), tenant(master, None)
        assert a.put("same", b"a") == 0 and b.put("same", b"b") == 0 and d.put("same", b"d") == 0
        assert (a.get("same"), b.get("same"), d.get("same")) == (b"a", b"b", b"d")
        assert a.remove_by_regex("^same$", True) == 1
        assert (a.get("same"), b.get("same"), d.get("same")) == (b"", b"b", b"d")
        # A key of the caller's may not smuggle in another tenant's separator.
        assert a.put("team-b\x00same", b"x") == INVALID_KEY
        assert b.get("same") == b"b"
        code, body = http("GET", f"http://{admin}/api/v1/tenant_quotas")
        assert code == 409 and "--enable_multi_tenants" in body["error_message"], body
        for s in (a, b, d):
            s.close()
    finally:
        store.stop()


def test_layer_wise_sessions_stay_in_their_tenant(master_addrs):
    """vLLM-Ascend's layer-wise calls scope their keys by the tenant as every other call does."""
    import numpy as np

    master, _admin = master_addrs
    store, _seg = start_store(master, "64MB")
    try:
        a, b = tenant(master, "team-a"), tenant(master, "team-b")
        buf = np.arange(4096, dtype=np.uint8)
        assert a.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        assert a.batch_put_session_start(["layered"], [4096]) == [0]
        for layer in range(4):
            at = layer * 1024
            assert a.batch_put_from_multi_buffer_ranges(
                ["layered"], [[buf.ctypes.data + at]], [[1024]], [[at]]) == [1024]
        assert a.batch_put_session_end(["layered"]) == [0]
        assert a.get("layered") == buf.tobytes()
        assert b.is_exist("layered") == 0
        assert b.batch_get_session_start(["layered"]) == [-704]
        assert a.batch_get_session_start(["layered"]) == [0]
        a.batch_get_session_end(["layered"])
        for s in (a, b):
            s.close()
    finally:
        store.stop()
