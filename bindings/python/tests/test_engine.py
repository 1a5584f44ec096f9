"""`mooncake.engine.TransferEngine` between Python processes, driven like vLLM's
MooncakeConnector, and next to `mooncake.store` in one process (MultiConnector, XpYd)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import KvCache, start_store, vllm_key
from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode
from mooncake.store import MooncakeDistributedStore, ReplicateConfig

PEER = Path(__file__).resolve().parent / "te_peer.py"
MB = 1 << 20


class Peer:
    """tests/te_peer.py in its own process: a decode engine with a registered KV cache."""

    def __init__(self, layers: int, blocks: int, block_len: int, master: str | None = None):
        args = [sys.executable, str(PEER), str(layers), str(blocks), str(block_len)]
        if master:
            args.append(master)
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self._line()
        assert line.startswith("ready"), line
        kv = dict(t.split("=", 1) for t in line.split()[1:])
        self.session = kv["session"]
        self.base = int(kv["base"])
        self.engine_id = int(kv["engine_id"])
        self.store_engine_id = int(kv["store_engine_id"])
        self.shape = (layers, blocks, block_len)

    def _line(self) -> str:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"te_peer exited ({self.p.wait()})")
        return line.strip()

    def cmd(self, *words: str) -> str:
        assert self.p.stdin is not None
        self.p.stdin.write(" ".join(words) + "\n")
        self.p.stdin.flush()
        line = self._line()
        assert line.startswith("ok"), line
        return line

    def dump(self, path: Path) -> np.ndarray:
        self.cmd("dump", str(path))
        return np.load(path)

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                assert self.p.stdin is not None
                self.p.stdin.write("exit\n")
                self.p.stdin.flush()
                self.p.wait(timeout=10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait(timeout=10)


@pytest.fixture
def peer(request):
    p = Peer(4, 16, 16 * 1024)
    request.addfinalizer(p.stop)
    return p


def engine() -> TransferEngine:
    te = TransferEngine()
    # vLLM's call: initialize(get_ip(), "P2PHANDSHAKE", protocol, "").
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return te


def block_addrs(base: int, shape, blocks: list[int]) -> list[int]:
    """One address per (layer, block), as vLLM's _build_transfer_params makes them."""
    layers, nblocks, block_len = shape
    return [base + layer * nblocks * block_len + b * block_len for layer in range(layers) for b in blocks]


# === two processes ===

def test_batch_write_then_read_between_two_processes(peer, tmp_path):
    te = engine()
    shape = peer.shape
    layers, blocks, block_len = shape
    kv = KvCache(layers, blocks, block_len)
    kv.arr[:] = np.random.default_rng(1).integers(0, 256, kv.arr.shape, dtype=np.uint8)
    assert te.batch_register_memory([kv.base], [kv.nbytes]) == 0

    # P writes its blocks 0..7 into D's blocks 8..15 (vLLM's block ids differ on each side).
    src_blocks, dst_blocks = list(range(8)), list(range(8, 16))
    src = block_addrs(kv.base, shape, src_blocks)
    dst = block_addrs(peer.base, shape, dst_blocks)
    assert te.batch_transfer_sync_write(peer.session, src, dst, [block_len] * len(src)) == 0

    got = peer.dump(tmp_path / "d.npy")
    assert np.array_equal(got[:, 8:16, :], kv.arr[:, 0:8, :])
    assert not got[:, 0:8, :].any(), "bytes outside the written blocks changed"

    # Single write, then read everything back the other way into fresh memory.
    assert te.transfer_sync_write(peer.session, kv.base + 5, peer.base, 1000) == 0
    back = np.zeros_like(kv.arr)
    dst_local = block_addrs(back.ctypes.data, shape, dst_blocks)
    assert te.batch_transfer_sync_read(peer.session, dst_local, dst, [block_len] * len(dst)) == 0
    assert np.array_equal(back[:, 8:16, :], kv.arr[:, 0:8, :])
    one = np.zeros(1000, dtype=np.uint8)
    assert te.transfer_sync_read(peer.session, one.ctypes.data, peer.base, 1000) == 0
    assert one.tobytes() == kv.arr.reshape(-1)[5:1005].tobytes()

    # The generic opcode forms and the async forms.
    peer.cmd("fill", "9")
    want = peer.dump(tmp_path / "d2.npy")
    buf = np.zeros(4096, dtype=np.uint8)
    assert te.transfer_sync("127.0.0.1:%d" % int(peer.session.rsplit(":", 1)[1]), buf.ctypes.data,
                            peer.base, 4096, TransferOpcode.Read) == 0
    assert buf.tobytes() == want.reshape(-1)[:4096].tobytes()
    bid = te.batch_transfer_async_write(peer.session, src[:4], dst[:4], [block_len] * 4)
    assert bid > 0
    assert te.get_batch_transfer_status([bid]) == 0
    sid = te.transfer_submit_write(peer.session, kv.base, peer.base, 64)
    assert sid > 0
    while (st := te.transfer_check_status(sid)) == 0:
        pass
    assert st == 1
    got = peer.dump(tmp_path / "d3.npy")
    assert got.reshape(-1)[:64].tobytes() == kv.arr.reshape(-1)[:64].tobytes()
    # src[:4] / dst[:4] are layer 0's blocks 0..3 -> 8..11.
    assert np.array_equal(got[0, 8:12, :], kv.arr[0, 0:4, :])


def test_concurrent_senders_share_the_engine(peer, tmp_path):
    """vLLM's sender pool calls batch_transfer_sync_write from many threads at once."""
    te = engine()
    layers, blocks, block_len = peer.shape
    kv = KvCache(layers, blocks, block_len)
    kv.arr[:] = np.random.default_rng(3).integers(0, 256, kv.arr.shape, dtype=np.uint8)
    rcs = []

    def send(b: int) -> None:
        src = block_addrs(kv.base, peer.shape, [b])
        dst = block_addrs(peer.base, peer.shape, [b])
        rcs.append(te.batch_transfer_sync_write(peer.session, src, dst, [block_len] * len(src)))

    threads = [threading.Thread(target=send, args=(b,)) for b in range(blocks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rcs == [0] * blocks
    assert np.array_equal(peer.dump(tmp_path / "d.npy"), kv.arr)


# === error paths: negative codes, never a crash ===

def test_error_paths_return_negative_codes():
    a, b = engine(), engine()
    target = np.zeros(4096, dtype=np.uint8)
    guard = np.zeros(4096, dtype=np.uint8)
    src = np.full(8192, 7, dtype=np.uint8)
    assert b.register_memory(target.ctypes.data, target.nbytes) == 0
    session = b.get_session_id()
    assert session == f"127.0.0.1:{b.get_rpc_port()}"

    # Unregistered peer address, and a range that starts inside the region but runs past it.
    assert a.transfer_sync_write(session, src.ctypes.data, guard.ctypes.data, 16) == -1
    assert a.transfer_sync_write(session, src.ctypes.data, target.ctypes.data + 4000, 200) == -1
    assert a.transfer_sync_read(session, src.ctypes.data, target.ctypes.data - 8, 16) == -1
    assert not target.any() and not guard.any()
    assert b._stats()["out_of_bounds"] == 3
    # One bad entry fails the batch; the good ones are still written (upstream: -1 for the batch).
    rc = a.batch_transfer_sync_write(session, [src.ctypes.data] * 2, [target.ctypes.data, 1 << 40], [16, 16])
    assert rc == -1
    # The connection survives refusals.
    assert a.transfer_sync_write(session, src.ctypes.data, target.ctypes.data, 4096) == 0
    assert (target == 7).all()

    # Bad sizes and pointers, mismatched lists, bad session ids.
    assert a.transfer_sync_write(session, src.ctypes.data, target.ctypes.data, -1) == -1
    assert a.transfer_sync_write(session, src.ctypes.data, target.ctypes.data, 0) == -1
    assert a.transfer_sync_write(session, 0, target.ctypes.data, 16) == -1
    assert a.transfer_sync_write(session, src.ctypes.data, -5, 16) == -1
    assert a.transfer_sync_write(session, src.ctypes.data, target.ctypes.data, 1 << 70) == -1
    assert a.batch_transfer_sync_write(session, [src.ctypes.data], [target.ctypes.data] * 2, [16]) == -1
    assert a.transfer_sync_write("127.0.0.1", src.ctypes.data, target.ctypes.data, 16) == -1
    assert a.transfer_sync_write("", src.ctypes.data, target.ctypes.data, 16) == -1
    dup = src.ctypes.data
    assert a.batch_transfer_sync_read(session, [dup, dup + 8], [target.ctypes.data] * 2, [16, 16]) == -1
    assert a.transfer_sync(session, src.ctypes.data, target.ctypes.data, 16, 5) == -1
    # A notification lunakv cannot deliver is refused, and nothing is written.
    target[:16] = 0
    src[:16] = 9
    note = TransferNotify("peer", "done")
    assert a.transfer_sync(session, src.ctypes.data, target.ctypes.data, 16,
                           TransferOpcode.Write, note) == -1
    assert a.batch_transfer_sync(session, [src.ctypes.data], [target.ctypes.data], [16],
                                 TransferOpcode.Write, note) == -1
    assert (target[:16] == 0).all()
    assert a.transfer_sync(session, src.ctypes.data, target.ctypes.data, 16,
                           TransferOpcode.Write, None) == 0
    assert (target[:16] == 9).all()

    # Dead peer: nothing listens there.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    assert a.transfer_sync_write(dead, src.ctypes.data, target.ctypes.data, 16) == -1
    assert a.batch_transfer_sync_read(dead, [src.ctypes.data], [target.ctypes.data], [16]) == -1
    assert a.transfer_check_status(12345) == -1
    bid = a.batch_transfer_async_write(dead, [src.ctypes.data], [target.ctypes.data], [16])
    assert bid > 0 and a.get_batch_transfer_status([bid]) == -1

    # Registration errors.
    assert b.register_memory(target.ctypes.data + 100, 100) == -7  # overlaps
    assert b.register_memory(0, 100) == -1
    assert b.register_memory(guard.ctypes.data, -1) == -1
    assert b.register_memory(guard.ctypes.data, 0) == -1
    assert b.batch_register_memory([guard.ctypes.data], [1, 2]) == -1
    assert b.unregister_memory(guard.ctypes.data) == -3
    # After unregister the peer refuses writes there.
    assert b.unregister_memory(target.ctypes.data) == 0
    assert a.transfer_sync_write(session, src.ctypes.data, target.ctypes.data, 16) == -1

    # Before initialize.
    fresh = TransferEngine()
    assert fresh.get_rpc_port() == -1
    assert fresh.register_memory(guard.ctypes.data, 16) < 0
    assert fresh.transfer_sync_write(session, src.ctypes.data, target.ctypes.data, 16) == -1
    assert fresh.initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink", "") < 0
    assert fresh.initialize("no-such-host.invalid", "P2PHANDSHAKE", "tcp", "") < 0
    # vLLM's default protocol is rdma: accepted (served over tcp).
    assert fresh.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    assert fresh.initialize_ext("127.0.0.1", "127.0.0.1:2379", "tcp", "", "etcd") == 0
    with pytest.raises(TypeError):
        a.transfer_sync_write(session, "not a pointer", target.ctypes.data, 16)


def test_sglang_calls_get_engine_and_send_probe(peer, master):
    """SGLang's calls: get_engine() is what it hands to store.setup(engine=...), and
    send_probe(session) answers 0 for a live peer, -1 for one that is not there."""
    te = engine()
    assert te.get_engine() is te
    assert te.send_probe(peer.session) == 0
    assert te.send_probe(te.get_session_id()) == 0
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    assert te.send_probe(f"127.0.0.1:{port}") == -1
    assert te.send_probe("not-a-session") == -1
    assert TransferEngine().send_probe(peer.session) == -1, "before initialize"
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MB, "tcp", "", master, engine=te.get_engine()) == 0
    assert store.close() == 0
    te.shutdown()


def test_listener_binds_exactly_the_given_host():
    te = engine()
    port = te.get_rpc_port()
    with socket.socket() as s:
        s.settimeout(2)
        assert s.connect_ex(("127.0.0.1", port)) == 0
    with socket.socket() as s:
        s.settimeout(2)
        # Bound to 127.0.0.1 only, not 0.0.0.0: another loopback address is refused.
        assert s.connect_ex(("127.0.0.2", port)) != 0


def test_managed_buffers_and_byte_helpers():
    a, b = engine(), engine()
    addr = b.allocate_managed_buffer(1 << 20)
    assert addr > 0
    data = bytes(range(256)) * 16
    assert b.write_bytes_to_buffer(addr, data, len(data)) == 0
    assert b.read_bytes_from_buffer(addr, len(data)) == data
    buf = np.zeros(len(data), dtype=np.uint8)
    assert a.transfer_sync_read(b.get_session_id(), buf.ctypes.data, addr, len(data)) == 0
    assert buf.tobytes() == data
    assert b.free_managed_buffer(addr, 1 << 20) == 0
    assert b.free_managed_buffer(addr, 1 << 20) == -1
    assert a.transfer_sync_read(b.get_session_id(), buf.ctypes.data, addr, 16) == -1


# === MultiConnector[MooncakeConnector + MooncakeStoreConnector]: both modules, one process ===

def test_multiconnector_pd_and_store_share_one_engine(request, master, tmp_path):
    proc, segment = start_store(master, "64MB")
    request.addfinalizer(proc.stop)
    layers, blocks, block_len = 8, 16, 16 * 1024
    decode = Peer(layers, blocks, block_len, master)
    request.addfinalizer(decode.stop)
    # The decode process's two modules share one transfer engine too.
    assert decode.engine_id != 0 and decode.engine_id == decode.store_engine_id

    # The prefill process: a standalone-store requester and a P/D engine.
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MB, "tcp", "", master) == 0
    request.addfinalizer(store.close)
    te = engine()
    assert te._transfer_engine_id() == store._transfer_engine_id() != 0

    kv = KvCache(layers, blocks, block_len)
    kv.arr[:] = np.random.default_rng(11).integers(0, 256, kv.arr.shape, dtype=np.uint8)
    stride = blocks * block_len
    assert te.batch_register_memory([kv.base + l * stride for l in range(layers)], [stride] * layers) == 0
    assert store.register_buffer(kv.base, kv.nbytes) == 0

    saved = [1, 2, 5, 6, 7, 12]
    # P/D: the prefill engine writes its blocks into the decode engine's blocks 0..5.
    src = block_addrs(kv.base, kv.arr.shape, saved)
    dst = block_addrs(decode.base, kv.arr.shape, list(range(len(saved))))
    # Contiguous remote blocks are one transfer per layer in vLLM (group_concurrent_contiguous);
    # here one per block and layer.
    assert te.batch_transfer_sync_write(decode.session, src, dst, [block_len] * len(src)) == 0
    # Store: the same blocks, one object per block with one piece per layer.
    keys = [vllm_key(b, prefix="multi") for b in saved]
    assert store.batch_is_exist(keys) == [0] * len(keys)
    cfg = ReplicateConfig()
    cfg.preferred_segment = segment
    ptrs, sizes = kv.addrs(saved)
    assert store.batch_put_from_multi_buffers(keys, ptrs, sizes, cfg) == [0] * len(keys)

    # Decode: both paths, bytes compared.
    pd = decode.dump(tmp_path / "pd.npy")
    line = decode.cmd("load", str(tmp_path / "store.npy"), *keys)
    assert json.loads(line.split("results=", 1)[1]) == [layers * block_len] * len(keys)
    st = np.load(tmp_path / "store.npy")
    for i, b in enumerate(saved):
        assert np.array_equal(pd[:, i, :], kv.arr[:, b, :]), f"P/D block {b}"
        assert np.array_equal(st[:, i, :], kv.arr[:, b, :]), f"store block {b}"
    assert not pd[:, len(saved):, :].any()
