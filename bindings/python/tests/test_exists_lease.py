"""batch_is_exist answered from a lease the master granted: vLLM asks for the same prefix blocks
again and again, and while at least half of the lease from the last master answer is left, the
client answers from its cache instead of a master round trip (docs/ARCHITECTURE.md, "Existence
checks")."""

from __future__ import annotations

import contextlib
import tempfile
import time

from conftest import Proc, connect, vllm_key
from test_data_path import rpc_counts

MB = 1 << 20


@contextlib.contextmanager
def master_with_lease(ttl_ms: int):
    """A lunakv-master whose reads and existence checks grant leases of `ttl_ms`."""
    with tempfile.TemporaryDirectory(prefix="lunakv-py-lease-") as d:
        p = Proc(
            "lunakv-master",
            [
                "--rpc_address=127.0.0.1",
                "--rpc_port=0",
                "--metrics_port=0",
                f"--data_dir={d}",
                f"--default_kv_lease_ttl={ttl_ms}",
            ],
        )
        try:
            line = p.wait_for("listening")
            yield line["rpc"].strip('",'), line["admin"].strip('",')
        finally:
            p.stop()


def exist_calls(admin: str) -> int:
    c = rpc_counts(admin)
    return c["batch_exist_key"] + c["exist_key"]


def test_a_leased_key_is_answered_without_the_master():
    # A lease long enough that the checks below always fall in its first half.
    with master_with_lease(120_000) as (rpc, admin):
        s = connect(rpc, 16 * MB)
        leased = [vllm_key(i, "leased") for i in range(4)]
        fresh = [vllm_key(i, "fresh") for i in range(2)]
        for k in leased + fresh:
            assert s.put(k, k.encode()) == 0
        # A put grants no lease: the first check asks the master, which grants one.
        before = exist_calls(admin)
        assert s.batch_is_exist(leased) == [1] * 4
        assert exist_calls(admin) == before + 1
        for _ in range(5):
            assert s.batch_is_exist(leased) == [1] * 4
            assert s.is_exist(leased[0]) == 1
        assert exist_calls(admin) == before + 1, "leased keys were asked of the master again"

        # A mixed batch asks only for what no lease covers, and keeps the caller's order.
        mixed = [leased[0], fresh[0], "never-put", leased[1], fresh[1]]
        assert s.batch_is_exist(mixed) == [1, 1, 0, 1, 1]
        assert exist_calls(admin) == before + 2

        # Another client cannot take a leased key away with a plain remove, so the cached
        # answer stays the master's.
        other = connect(rpc)
        assert other.remove(leased[2]) == -706  # OBJECT_HAS_LEASE
        assert s.is_exist(leased[2]) == 1
        assert s.get(leased[2]) == leased[2].encode()
        other.close()

        # This client's own remove drops the lease with the location.
        assert s.remove(leased[3], True) == 0
        assert s.is_exist(leased[3]) == 0
        s.close()


def test_past_half_the_lease_the_master_is_asked_again():
    ttl_ms = 400
    with master_with_lease(ttl_ms) as (rpc, admin):
        s = connect(rpc, 16 * MB)
        keys = [vllm_key(i, "short") for i in range(3)]
        for k in keys:
            assert s.put(k, b"x") == 0
        before = exist_calls(admin)
        assert s.batch_is_exist(keys) == [1] * 3
        # Half the lease is 200 ms; past it a cached answer would leave the caller's load less
        # than half a lease, so the client asks again (and is granted a new lease).
        time.sleep(ttl_ms / 1000 * 0.75)
        assert s.batch_is_exist(keys) == [1] * 3
        assert exist_calls(admin) == before + 2
        # Once the lease has run out, a force remove from elsewhere is seen at once.
        time.sleep(ttl_ms / 1000 * 1.25)
        other = connect(rpc)
        assert other.remove(keys[0], True) == 0
        assert s.batch_is_exist(keys) == [0, 1, 1]
        other.close()
        s.close()
