"""`mooncake.store` against a real lunakv-master (and lunakv-store), driven like vLLM does."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import (
    BUFFER_OVERFLOW,
    INVALID_PARAMS,
    NO_AVAILABLE_HANDLE,
    OBJECT_NOT_FOUND,
    KvCache,
    Proc,
    connect,
    run_worker,
    start_store,
    vllm_key,
)
from mooncake.store import MooncakeDistributedStore, ReplicateConfig

MB = 1 << 20


# === the vLLM store worker's flow, across two processes ===

@pytest.mark.parametrize("mode", ["embedded", "standalone-shm", "standalone-tcp"])
def test_vllm_save_then_load_from_another_process(request, master, tmp_path, mode):
    """vLLM's store worker, as vllm-project/vllm main (mid-2026)
    `distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_store_worker.py` calls it:
    `setup` with its positional order, `register_buffer` per KV tensor, `batch_is_exist` then
    `batch_put_from_multi_buffers` (one piece per layer) on save, and
    `batch_get_into_multi_buffers` on load, from another process."""
    env = {}
    if mode == "embedded":
        gss = 64 * MB
    else:
        gss = 0
        proc, _segment = start_store(master, "64MB")
        request.addfinalizer(proc.stop)
        if mode == "standalone-tcp":
            env["LUNAKV_DISABLE_SHM"] = "1"
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        writer = connect(master, gss)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    layers, blocks, block_len = 8, 16, 16 * 1024
    kv = KvCache(layers, blocks, block_len)
    kv.arr[:] = np.random.default_rng(7).integers(0, 256, kv.arr.shape, dtype=np.uint8)
    assert writer.register_buffer(kv.base, kv.nbytes) == 0

    saved = [0, 3, 4, 9, 15]
    keys = [vllm_key(b, prefix=mode) for b in saved]
    assert writer.batch_is_exist(keys) == [0] * len(keys)
    ptrs, sizes = kv.addrs(saved)
    assert writer.batch_put_from_multi_buffers(keys, ptrs, sizes, ReplicateConfig()) == [0] * len(keys)
    assert writer.batch_is_exist(keys) == [1] * len(keys)
    # A second save of the same blocks: vLLM skips what exists; a blind re-put is refused.
    again = writer.batch_put_from_multi_buffers(keys[:1], ptrs[:1], sizes[:1])
    assert again[0] in (0, -705)

    out = tmp_path / "loaded.npy"
    stdout = run_worker(
        [master, str(gss), str(layers), str(blocks), str(block_len), str(out), *keys],
        env=env,
    )
    results = json.loads(stdout.strip().splitlines()[-1].split("=", 1)[1])
    assert results == [layers * block_len] * len(keys)
    loaded = np.load(out)
    for i, b in enumerate(saved):
        assert loaded[:, blocks - 1 - i, :].tobytes() == kv.block_bytes(b), f"block {b}"
    # Blocks nobody loaded into stay zero.
    untouched = set(range(blocks)) - {blocks - 1 - i for i in range(len(saved))}
    assert all(not loaded[:, b, :].any() for b in untouched)

    # The same process reads its own puts back too.
    dst = KvCache(layers, blocks, block_len)
    assert writer.register_buffer(dst.base, dst.nbytes) == 0
    dptrs, dsizes = dst.addrs(saved)
    assert writer.batch_get_into_multi_buffers(keys, dptrs, dsizes) == [layers * block_len] * len(keys)
    assert dst.arr[:, saved, :].tobytes() == kv.arr[:, saved, :].tobytes()
    assert writer.unregister_buffer(dst.base) == 0
    assert writer.unregister_buffer(kv.base) == 0

    assert writer.remove_all(True) == len(keys)
    assert writer.batch_is_exist(keys) == [0] * len(keys)
    assert writer.close() == 0


def test_concurrent_threads_share_one_store(master, store_64mb):
    """vLLM's sending and receiving threads call the same store at once."""
    s = connect(master)
    layers, blocks, block_len = 4, 32, 8 * 1024
    src = KvCache(layers, blocks, block_len)
    src.arr[:] = np.random.default_rng(1).integers(0, 256, src.arr.shape, dtype=np.uint8)
    keys = [vllm_key(b, "threads") for b in range(blocks)]
    ptrs, sizes = src.addrs(list(range(blocks)))
    assert s.batch_put_from_multi_buffers(keys, ptrs, sizes) == [0] * blocks

    errors: list[str] = []

    def reader(t: int) -> None:
        dst = KvCache(layers, blocks, block_len)
        for _ in range(10):
            mine = list(range(t, blocks, 4))
            dptrs, dsizes = dst.addrs(mine)
            r = s.batch_get_into_multi_buffers([keys[b] for b in mine], dptrs, dsizes)
            if r != [layers * block_len] * len(mine):
                errors.append(f"thread {t}: {r}")
            if dst.arr[:, mine, :].tobytes() != src.arr[:, mine, :].tobytes():
                errors.append(f"thread {t}: bytes differ")

    ts = [threading.Thread(target=reader, args=(t,)) for t in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert not errors, errors
    s.close()


# === error paths ===

def test_setup_against_a_dead_master_returns_nonzero(monkeypatch):
    # setup waits for a master that is not up yet (30 s by default); a short wait here.
    monkeypatch.setenv("LUNAKV_SETUP_WAIT_SEC", "1")
    s = MooncakeDistributedStore()
    started = time.monotonic()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MB, "tcp", "", "127.0.0.1:1") != 0
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 64 * MB, 16 * MB, "tcp", "", "127.0.0.1:1") != 0
    assert s.setup(
        local_hostname="127.0.0.1",
        metadata_server="P2PHANDSHAKE",
        global_segment_size=0,
        local_buffer_size=16 * MB,
        protocol="tcp",
        rdma_devices="",
        master_server_addr="127.0.0.1:1",
        tenant_id="default",
    ) != 0
    assert s.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                    "master_server_addr": "127.0.0.1:1"}) != 0
    assert time.monotonic() - started < 20
    # Still unusable, and still no exception.
    assert s.is_exist("k") == INVALID_PARAMS
    assert s.close() == 0


def test_setup_waits_for_a_master_started_after_it(monkeypatch, tmp_path):
    """vLLM and the master start in one rollout: a setup that begins before the master listens
    waits for it (bounded by LUNAKV_SETUP_WAIT_SEC) and returns 0 once it answers, where it
    used to return RPC_FAIL at once."""
    monkeypatch.setenv("LUNAKV_SETUP_WAIT_SEC", "120")
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    addr = f"127.0.0.1:{port}"
    s = MooncakeDistributedStore()
    result = {}
    calling = threading.Event()

    def run_setup() -> None:
        calling.set()
        result["rc"] = s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MB, 16 * MB, "tcp", "", addr)

    t = threading.Thread(target=run_setup)
    t.start()
    calling.wait()
    time.sleep(1)  # let setup find nothing there; the outcome does not depend on it
    master = Proc(
        "lunakv-master",
        ["--rpc_address=127.0.0.1", f"--rpc_port={port}", "--metrics_port=0",
         f"--data_dir={tmp_path}"],
    )
    try:
        master.wait_for("listening")
        t.join(timeout=120)
        assert not t.is_alive(), "setup never returned"
        assert result["rc"] == 0
        assert s.put("late-master", b"v") == 0
        assert s.get("late-master") == b"v"
        assert s.close() == 0
    finally:
        master.stop()


def test_setup_against_a_silent_master_fails_and_releases_the_gil():
    """A peer that accepts TCP but never answers: setup gives up after the client's RPC
    timeout with a non-zero code, and other Python threads run meanwhile."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    addr = "127.0.0.1:%d" % listener.getsockname()[1]
    ticks = [0]
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.01)

    t = threading.Thread(target=tick)
    t.start()
    try:
        s = MooncakeDistributedStore()
        started = time.monotonic()
        rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MB, "tcp", "", addr)
        elapsed = time.monotonic() - started
    finally:
        done.set()
        t.join()
        listener.close()
    assert rc != 0
    assert elapsed < 30
    # The ticker ran through the blocked call: the GIL was released.
    assert ticks[0] > elapsed * 20, (ticks[0], elapsed)


def test_setup_refuses_bad_config_without_raising(master):
    s = MooncakeDistributedStore()
    # "rdma" is accepted (served over tcp where unavailable: test_protocol.py); unknown ones not.
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MB, "nvlink", "", master) == INVALID_PARAMS
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", -1, 16 * MB, "tcp", "", master) == INVALID_PARAMS
    assert s.setup({"local_hostname": "127.0.0.1", "global_segment_size": "lots",
                    "master_server_addr": master}) == INVALID_PARAMS
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MB, "tcp", "", "not an address") != 0


def test_a_tenant_name_upstream_refuses_is_refused_by_name(master, capfd):
    """vLLM passes tenant_id only when mooncake_config.json names a tenant other than "default"
    (test_tenants.py covers what a tenant does). A name upstream reserves is refused at setup,
    with the rule it breaks, in either setup form."""
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MB, "tcp", "", master,
                   tenant_id="_internal") == INVALID_PARAMS
    assert s.setup({"local_hostname": "127.0.0.1", "master_server_addr": master,
                    "tenant_id": "bad\ttenant"}) == INVALID_PARAMS
    err = capfd.readouterr().err
    assert 'tenant_id "_internal"' in err and "reserves" in err, err
    assert "control character" in err, err
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MB, "tcp", "", master,
                   tenant_id="default") == 0
    s.close()
    s = MooncakeDistributedStore()
    assert s.setup({"local_hostname": "127.0.0.1", "master_server_addr": master,
                    "enable_offload": True, "ipc_socket_path": "/tmp/x.sock"}) == 0
    err = capfd.readouterr().err
    assert "enable_offload is ignored" in err and "ipc_socket_path" in err, err
    s.close()


def test_calls_before_setup_and_after_close(master):
    s = MooncakeDistributedStore()
    buf = np.zeros(64, dtype=np.uint8)
    ptr = buf.ctypes.data
    assert s.put("k", b"v") == INVALID_PARAMS
    assert s.get("k") == b""
    assert s.get_batch(["a", "b"]) == [b"", b""]
    assert s.is_exist("k") == INVALID_PARAMS
    assert s.batch_is_exist(["a", "b"]) == [INVALID_PARAMS] * 2
    assert s.get_into("k", ptr, 64) == INVALID_PARAMS
    assert s.batch_get_into_multi_buffers(["k"], [[ptr]], [[64]]) == [INVALID_PARAMS]
    assert s.register_buffer(ptr, 64) == INVALID_PARAMS
    assert s.remove_all(True) == INVALID_PARAMS
    assert s.batch_get_replica_desc(["k"]) == {}
    assert s.health_check() == 1
    assert s.close() == 0

    s = connect(master, 16 * MB)
    assert s.health_check() == 0
    assert s.put("k", b"v") == 0
    assert s.close() == 0
    assert s.close() == 0
    assert s.put("k2", b"v") == INVALID_PARAMS
    assert s.get("k") == b""


def test_unknown_key(master, store_64mb):
    s = connect(master)
    buf = np.zeros(4096, dtype=np.uint8)
    ptr = buf.ctypes.data
    assert s.get_into("never-put", ptr, 4096) == OBJECT_NOT_FOUND
    assert s.batch_get_into(["never-put", "nor-this"], [ptr, ptr + 2048], [2048, 2048]) == [OBJECT_NOT_FOUND] * 2
    assert s.batch_get_into_multi_buffers(["never-put"], [[ptr, ptr + 1024]], [[1024, 1024]]) == [OBJECT_NOT_FOUND]
    assert s.get("never-put") == b""
    assert s.get_batch(["never-put"]) == [b""]
    assert s.is_exist("never-put") == 0
    assert s.get_size("never-put") == OBJECT_NOT_FOUND
    assert s.remove("never-put") == OBJECT_NOT_FOUND
    assert s.get_replica_desc("never-put") == []
    assert s.batch_get_replica_desc(["never-put"]) == {}
    s.close()


def test_pool_full_returns_no_available_handle(master):
    proc, _ = start_store(master, "8MB")
    try:
        s = connect(master)
        # Larger than the whole pool.
        big = np.ones(9 * MB, dtype=np.uint8)
        assert s.put_from("too-big", big.ctypes.data, big.nbytes) == NO_AVAILABLE_HANDLE
        assert s.is_exist("too-big") == 0
        # Fill with hard-pinned objects (never evicted) until the pool refuses.
        cfg = ReplicateConfig()
        cfg.with_hard_pin = True
        obj = np.full(MB, 3, dtype=np.uint8)
        keys = [f"pinned-{i}" for i in range(12)]
        results = s.batch_put_from(keys, [obj.ctypes.data] * 12, [MB] * 12, cfg)
        assert NO_AVAILABLE_HANDLE in results, results
        assert set(results) <= {0, NO_AVAILABLE_HANDLE}, results
        stored = [k for k, r in zip(keys, results) if r == 0]
        assert 4 <= len(stored) < 12
        assert s.batch_is_exist(keys) == [1 if r == 0 else 0 for r in results]
        # What was stored is intact.
        out = np.zeros(MB, dtype=np.uint8)
        assert s.get_into(stored[0], out.ctypes.data, MB) == MB
        assert (out == 3).all()
        s.close()
    finally:
        proc.stop()


def test_bad_pointers_and_sizes_are_rejected_cleanly(master, store_64mb):
    s = connect(master)
    buf = np.arange(4096, dtype=np.uint32).view(np.uint8)  # 16 KiB
    ptr = buf.ctypes.data
    # register_buffer
    assert s.register_buffer(0, 4096) == INVALID_PARAMS
    assert s.register_buffer(ptr, -1) == INVALID_PARAMS
    assert s.register_buffer(ptr, 0) == INVALID_PARAMS
    assert s.register_buffer(-ptr, 10) == INVALID_PARAMS
    assert s.register_buffer(1 << 70, 10) == INVALID_PARAMS
    assert s.register_buffer(ptr, buf.nbytes) == 0
    assert s.register_buffer(ptr + 8, 64) == INVALID_PARAMS  # overlaps
    assert s.unregister_buffer(ptr + 8) == INVALID_PARAMS  # never registered
    assert s.unregister_buffer(ptr) == 0
    # single puts and gets
    assert s.put_from("p", 0, 100) == INVALID_PARAMS
    assert s.put_from("p", ptr, -5) == INVALID_PARAMS
    assert s.put_from("p", ptr, 0) == INVALID_PARAMS  # empty objects are refused
    assert s.put_from("p", (1 << 64) - 16, 64) == INVALID_PARAMS  # wraps
    assert s.get_into("p", 0, 100) == INVALID_PARAMS
    assert s.get_into("p", ptr, -1) == INVALID_PARAMS
    # list shapes
    assert s.batch_put_from(["a", "b"], [ptr], [16]) == [INVALID_PARAMS] * 2
    assert s.batch_put_from_multi_buffers(["a"], [[ptr, ptr + 16]], [[16]]) == [INVALID_PARAMS]
    assert s.batch_put_from_multi_buffers(["a", "b"], [[ptr]], [[16], [16]]) == [INVALID_PARAMS] * 2
    assert s.batch_get_into_multi_buffers(["a"], [[ptr]], [[16], [16]]) == [INVALID_PARAMS]
    # ints past 64 bits inside the lists are refused with -600, never raised
    assert s.batch_put_from_multi_buffers(["a"], [[1 << 64]], [[16]]) == [INVALID_PARAMS]
    assert s.batch_put_from_multi_buffers(["a"], [[ptr]], [[-(1 << 65)]]) == [INVALID_PARAMS]
    assert s.batch_put_from(["a"], [(1 << 63) + 4096], [16]) == [INVALID_PARAMS]
    assert s.batch_get_into_multi_buffers(["a"], [[ptr]], [[1 << 100]]) == [INVALID_PARAMS]
    # kernel-half addresses are refused, not dereferenced (that would kill the interpreter)
    assert s.get_into("p", 0xFFFF_8000_0000_0000, 64) == INVALID_PARAMS
    assert s.put_from("p", 0x8000_0000_0000_1000, 64) == INVALID_PARAMS
    assert s.batch_get_into_multi_buffers(["a"], [[ptr, 1 << 62]], [[16, 16]]) == [INVALID_PARAMS]
    # one bad key does not spoil the others
    r = s.batch_put_from_multi_buffers(["good", "bad"], [[ptr, ptr + 64], [0]], [[64, 64], [64]])
    assert r == [0, INVALID_PARAMS]
    assert s.batch_is_exist(["good", "bad"]) == [1, 0]
    # overlapping destinations are refused before anything is written
    out = np.zeros(256, dtype=np.uint8)
    optr = out.ctypes.data
    assert s.batch_get_into_multi_buffers(["good"], [[optr, optr + 64]], [[100, 28]]) == [INVALID_PARAMS]
    assert s.batch_get_into(["good", "good"], [optr, optr + 100], [128, 128]) == [INVALID_PARAMS] * 2
    assert not out.any()
    # a destination too small for the object
    assert s.get_into("good", optr, 100) == BUFFER_OVERFLOW
    assert s.get_into("good", optr, 256) == 128
    assert out[:128].tobytes() == buf[:128].tobytes()
    # wrong Python types raise TypeError, as upstream's bindings do
    with pytest.raises(TypeError):
        s.put_from("p", "not a pointer", 10)
    with pytest.raises(TypeError):
        s.batch_is_exist("not-a-list-of-keys")
    with pytest.raises(TypeError):
        s.batch_put_from_multi_buffers(["a"], [[float(ptr)]], [[16]])
    s.close()


# === the rest of the surface ===

INVALID_KEY = -400
OBJECT_ALREADY_EXISTS = -705


def test_put_batch_with_an_invalid_key_stores_none_of_it(master):
    """Issue 33 item 8: put_batch answered -400 for a batch with one bad key yet stored the
    good ones. A batch with an invalid key (empty, too long, a NUL) is now refused whole before
    anything is stored. A failure met while putting (here a key that exists) leaves the other
    keys stored and answers the first error, as upstream's put_batch does."""
    s = connect(master, 32 * MB)
    for bad in ["", "nul\0inside", "k" * 100_000]:
        keys = ["pb-good-1", bad, "pb-good-2"]
        assert s.put_batch(keys, [b"1", b"2", b"3"]) == INVALID_KEY, repr(bad[:16])
        assert s.batch_is_exist(["pb-good-1", "pb-good-2"]) == [0, 0], repr(bad[:16])
    # Not a validation failure: the fresh key is stored, the call answers the existing one.
    assert s.put("pb-dup", b"old") == 0
    assert s.put_batch(["pb-fresh", "pb-dup"], [b"new", b"x"]) == OBJECT_ALREADY_EXISTS
    assert s.get("pb-fresh") == b"new" and s.get("pb-dup") == b"old"
    s.close()


def test_bytes_api(master):
    s = connect(master, 32 * MB)
    assert s.put("a", b"hello") == 0
    assert s.get("a") == b"hello"
    assert s.get_size("a") == 5
    assert s.put("a", b"again") == -705  # objects are immutable
    assert s.put("arr", np.arange(10, dtype=np.int32)) == 0
    assert s.get("arr") == np.arange(10, dtype=np.int32).tobytes()
    assert s.put("ba", bytearray(b"xyz")) == 0 and s.get("ba") == b"xyz"
    assert s.put("mv", memoryview(b"0123456789")[2:5]) == 0 and s.get("mv") == b"234"
    assert s.put("s", "a str is not bytes") == INVALID_PARAMS
    assert s.put_batch(["b1", "b2", "b3"], [b"1", b"22", b"333"]) == 0
    assert s.get_batch(["b1", "b2", "missing", "b3"]) == [b"1", b"22", b"", b"333"]
    assert s.put_batch(["x"], [b"1", b"2"]) == INVALID_PARAMS
    assert s.is_exist("b2") == 1
    assert s.remove("b2") in (0, -706)  # a fresh lease may hold it
    assert s.remove("b2", True) in (0, OBJECT_NOT_FOUND)
    assert s.is_exist("b2") == 0
    assert s.batch_remove(["b1", "nope"], force=True) == [0, OBJECT_NOT_FOUND]
    assert s.remove_all(force=True) == 5
    assert s.batch_is_exist(["a", "arr", "ba", "mv", "b3"]) == [0] * 5
    assert s.get_hostname().startswith("127.0.0.1:")
    s.close()


def test_put_from_get_into_and_batches(master, store_64mb):
    s = connect(master)
    src = np.random.default_rng(3).integers(0, 256, 3 * 4096, dtype=np.uint8)
    dst = np.zeros_like(src)
    sp, dp = src.ctypes.data, dst.ctypes.data
    assert s.put_from("one", sp, 4096) == 0
    assert s.get_into("one", dp, 4096) == 4096
    assert dst[:4096].tobytes() == src[:4096].tobytes()
    keys = ["two", "three"]
    assert s.batch_put_from(keys, [sp + 4096, sp + 8192], [4096, 4096]) == [0, 0]
    assert s.batch_get_into(keys, [dp + 4096, dp + 8192], [4096, 4096]) == [4096, 4096]
    assert dst.tobytes() == src.tobytes()
    assert s.get("two") == src[4096:8192].tobytes()
    s.close()


def test_upsert_family_replaces_what_a_put_refuses(master, store_64mb):
    """Upstream's upsert, upsert_batch, upsert_from and batch_upsert_from: where a put of an
    existing key answers -705, an upsert stores the new value; a missing key is simply put; a
    value a reader just leased (a get) is replaced too; sizes may change."""
    s = connect(master)
    assert s.put("u", b"first") == 0
    assert s.put("u", b"second") == -705
    assert s.get("u") == b"first"  # leases "u" to this reader
    assert s.upsert("u", b"second, longer") == 0
    assert s.get("u") == b"second, longer"
    assert s.upsert("fresh", b"new key") == 0 and s.get("fresh") == b"new key"
    assert s.upsert_batch(["u", "fresh", "b"], [b"3", b"4", b"5"]) == 0
    assert s.get_batch(["u", "fresh", "b"]) == [b"3", b"4", b"5"]
    assert s.upsert("s", "a str is not bytes") == INVALID_PARAMS

    src = np.random.default_rng(5).integers(0, 256, 3 * 4096, dtype=np.uint8)
    dst = np.zeros_like(src)
    sp, dp = src.ctypes.data, dst.ctypes.data
    assert s.put_from("p", sp, 4096) == 0
    assert s.put_from("p", sp + 4096, 4096) == -705
    assert s.upsert_from("p", sp + 4096, 4096) == 0
    assert s.get_into("p", dp, 4096) == 4096 and dst[:4096].tobytes() == src[4096:8192].tobytes()
    assert s.batch_upsert_from(["p", "q"], [sp, sp + 8192], [8192, 4096]) == [0, 0]
    assert s.get_size("p") == 8192
    assert s.batch_get_into(["p", "q"], [dp, dp + 8192], [8192, 4096]) == [8192, 4096]
    assert dst.tobytes() == src.tobytes()
    s.close()


def test_remove_by_regex(master, store_64mb):
    """Upstream's remove_by_regex: the count removed; only matching keys go; a pattern that does
    not compile is INVALID_PARAMS and removes nothing."""
    s = connect(master)
    for k in ["rx-a1", "rx-a2", "rx-b1", "other"]:
        assert s.put(k, b"v") == 0
    assert s.remove_by_regex("(") == INVALID_PARAMS
    assert s.remove_by_regex(regex_pattern="^rx-a", force=True) == 2
    assert s.batch_is_exist(["rx-a1", "rx-a2", "rx-b1", "other"]) == [0, 0, 1, 1]
    assert s.remove_by_regex("^nothing-matches$") == 0
    assert s.remove_by_regex("^rx-", force=True) == 1
    assert s.is_exist("other") == 1
    s.close()


def test_lmcache_calls_put_parts_get_buffer_batch_get_buffer(master, store_64mb):
    """LMCache's default save and load path, as LMCache/LMCache dev (mid-2026)
    `lmcache/v1/storage_backend/connector/mooncakestore_connector.py` calls it: put_parts(key,
    *parts) and get_buffer / batch_get_buffer, whose BufferHandle has upstream's ptr(), size()
    and the buffer protocol."""
    import ctypes

    from mooncake.store import BufferHandle

    s = connect(master)
    assert s.put_parts("pp", b"ab", bytearray(b"cd"), memoryview(b"ef")) == 0
    assert s.get("pp") == b"abcdef"
    h = s.get_buffer("pp")
    assert isinstance(h, BufferHandle)
    assert (bytes(h), h.size(), len(h)) == (b"abcdef", 6, 6)
    assert ctypes.string_at(h.ptr(), 6) == b"abcdef"
    assert np.frombuffer(h, dtype=np.uint8).tobytes() == b"abcdef"
    assert s.get_buffer("missing") is None
    hs = s.batch_get_buffer(["pp", "missing"])
    assert bytes(hs[0]) == b"abcdef" and hs[1] is None
    assert s.put_parts("bad", b"x", "a str") == INVALID_PARAMS
    assert s.is_exist("bad") == 0
    # No object is empty, which is what lets an empty read mean a miss.
    assert s.put("empty", b"") != 0
    s.close()


def test_replica_descriptors(master, store_64mb):
    s = connect(master)
    assert s.put("r1", b"abc") == 0
    assert s.put("r2", b"defg") == 0
    d = s.batch_get_replica_desc(["r1", "r2", "missing"])
    assert set(d) == {"r1", "r2"}
    for key, size in (("r1", 3), ("r2", 4)):
        (rep,) = d[key]
        assert rep.is_memory_replica()
        assert not rep.is_disk_replica()
        assert not rep.is_local_disk_replica()
        assert rep.size == size
        assert rep.segment_name == store_64mb
        assert rep.status == "COMPLETE"
        # Upstream's accessors: the buffer of a memory replica; a disk one is refused here.
        buf = rep.get_memory_descriptor().buffer_descriptor
        assert (buf.size, buf.buffer_address) == (size, rep.offset)
        assert buf.transport_endpoint == rep.transport_endpoint
        with pytest.raises(RuntimeError, match="Expected DiskDescriptor"):
            rep.get_disk_descriptor()
    assert [r.is_memory_replica() for r in s.get_replica_desc("r1")] == [True]
    s.close()


def test_replicate_config_and_preferred_segment(master):
    stores = [start_store(master, "16MB") for _ in range(2)]
    try:
        c = ReplicateConfig()
        assert c.replica_num == 1
        assert c.preferred_segment == ""
        assert not c.with_soft_pin and not c.with_hard_pin
        # Upstream's defaults for what test_groups.py and test_upstream_surface.py exercise.
        assert c.group_ids is None and c.soft_pin_ttl_ms is None
        with pytest.raises(AttributeError):
            c.no_such_field = 1
        c.with_soft_pin = True
        assert "replica_num=1" in repr(c)

        s = connect(master)
        target = stores[1][1]
        c.preferred_segment = target
        for i in range(4):
            assert s.put(f"pref-{i}", b"x" * 100, c) == 0
            (rep,) = s.get_replica_desc(f"pref-{i}")
            assert rep.segment_name == target
        # The list form, upstream's: every replica in the listed order, not only the first.
        listed = ReplicateConfig()
        listed.replica_num = 2
        listed.preferred_segments = [target, stores[0][1]]
        for i in range(4):
            assert s.put(f"listed-{i}", b"z" * 100, listed) == 0
            reps = s.get_replica_desc(f"listed-{i}")
            assert [r.segment_name for r in reps] == [target, stores[0][1]]
        two = ReplicateConfig()
        two.replica_num = 2
        assert s.put("two-copies", b"y" * 100, two) == 0
        reps = s.get_replica_desc("two-copies")
        assert len(reps) == 2
        assert {r.segment_name for r in reps} == {stores[0][1], stores[1][1]}
        assert s.get("two-copies") == b"y" * 100
        s.close()
    finally:
        for p, _ in stores:
            p.stop()


def test_setup_from_env(master, tmp_path, monkeypatch):
    cfg = tmp_path / "mooncake_config.json"
    cfg.write_text(json.dumps({
        "mode": "embedded",
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": master,
        "global_segment_size": "16MB",
        "local_buffer_size": "16MB",
        "protocol": "tcp",
    }))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(cfg))
    s = MooncakeDistributedStore()
    assert s.setup_from_env() == 0
    assert s.put("env", b"ok") == 0 and s.get("env") == b"ok"
    s.close()
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH")
    assert MooncakeDistributedStore().setup_from_env() == INVALID_PARAMS


def test_setup_config_dict_form(master):
    """Newer vLLM calls setup with one dict of strings."""
    s = MooncakeDistributedStore()
    assert s.setup({
        "local_hostname": "127.0.0.1",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": str(16 * MB),
        "local_buffer_size": str(16 * MB),
        "protocol": "tcp",
        "rdma_devices": "",
        "master_server_addr": master,
    }) == 0
    assert s.put("dict", b"ok") == 0 and s.get("dict") == b"ok"
    s.close()


def test_exit_without_close_unmounts_the_embedded_segment(master):
    """An engine process that exits without close(): the atexit hook unmounts its segment, so
    its objects disappear at once rather than after the master's client TTL."""
    code = (
        "import sys\n"
        "from mooncake.store import MooncakeDistributedStore\n"
        "s = MooncakeDistributedStore()\n"
        f"assert s.setup('127.0.0.1', 'P2PHANDSHAKE', 16 << 20, 16 << 20, 'tcp', '', '{master}') == 0\n"
        "assert s.put('left-behind', b'x' * 1000) == 0\n"
        "print('put ok')\n"
    )
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "put ok" in r.stdout, r.stderr
    assert time.monotonic() - started < 15
    s = connect(master)
    assert s.is_exist("left-behind") == 0
    s.close()


def test_second_setup_replaces_the_first(master, store_64mb, monkeypatch):
    monkeypatch.setenv("LUNAKV_SETUP_WAIT_SEC", "0")
    s = connect(master)
    assert s.put("first", b"1") == 0
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MB, "tcp", "", master) == 0
    assert s.get("first") == b"1"
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MB, "tcp", "", "127.0.0.1:1") != 0
    assert s.get("first") == b""  # the failed setup left it unset, not half-connected
    s.close()


def test_local_hostname_from_the_environment_as_vllm_sets_it(master, monkeypatch):
    """An empty local_hostname falls back to MOONCAKE_REQUESTER_LOCAL_HOSTNAME, then VLLM_HOST_IP
    (vLLM's get_ip()); with neither, setup fails (non-zero) instead of guessing."""
    for v in ("MOONCAKE_REQUESTER_LOCAL_HOSTNAME", "MOONCAKE_LOCAL_HOSTNAME", "VLLM_HOST_IP"):
        monkeypatch.delenv(v, raising=False)
    s = MooncakeDistributedStore()
    assert s.setup("", "P2PHANDSHAKE", 16 * MB, 16 * MB, "tcp", "", master) != 0
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    assert s.setup("", "P2PHANDSHAKE", 16 * MB, 16 * MB, "tcp", "", master) == 0
    assert s.get_hostname().startswith("127.0.0.1:")
    assert s.put("h", b"x") == 0 and s.get("h") == b"x"
    # The requester variable wins: VLLM_HOST_IP now names an address this host cannot bind.
    monkeypatch.setenv("VLLM_HOST_IP", "192.0.2.1")
    assert s.setup("", "P2PHANDSHAKE", 16 * MB, 16 * MB, "tcp", "", master) != 0
    monkeypatch.setenv("MOONCAKE_REQUESTER_LOCAL_HOSTNAME", "127.0.0.1")
    assert s.setup("", "P2PHANDSHAKE", 16 * MB, 16 * MB, "tcp", "", master) == 0
    assert s.get_hostname().startswith("127.0.0.1:")
    assert s.close() == 0
