"""Device (GPU) buffers on every data path, proven without a GPU (docs/GPU.md).

The test double (``LUNAKV_DEVICE=fake``, set by conftest.py for the whole suite) hands out
"device" memory whose address is a ``PROT_NONE`` mapping: a single CPU access to it kills the
process with SIGSEGV. Each test runs once on host (numpy) buffers, once on such device buffers,
and once on a mix (pieces of one object alternating between the two): passing with device
buffers proves that no path dereferences a device pointer, and the crash tests at the end prove
the double does crash a path that would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from conftest import Proc, connect, start_store, vllm_key
from mooncake import _lunakv_testing as dev
from mooncake.engine import TransferEngine, TransferOpcode

MB = 1 << 20
KINDS = ["host", "device", "mixed"]


@pytest.fixture(autouse=True, scope="module")
def fake_device_layer():
    assert dev.device_layer() == "fake", "conftest.py sets LUNAKV_DEVICE=fake before any transfer"


class Buf:
    """`n` bytes at an address `offset` bytes past an allocation's start, in host memory (numpy)
    or in fake device memory."""

    def __init__(self, kind: str, n: int, offset: int = 0):
        self.kind, self.n = kind, n
        if kind == "host":
            self._arr = np.zeros(n + offset, dtype=np.uint8)
            self.addr = self._arr.ctypes.data + offset
            self._base = None
        else:
            self._base = dev.device_alloc(n + offset)
            self.addr = self._base + offset

    def write(self, off: int, data: bytes) -> None:
        if self._base is None:
            self._arr[self.addr - self._arr.ctypes.data + off :][: len(data)] = np.frombuffer(data, np.uint8)
        else:
            dev.device_write(self.addr + off, data)

    def read(self, off: int = 0, n: int | None = None) -> bytes:
        n = self.n - off if n is None else n
        if self._base is None:
            start = self.addr - self._arr.ctypes.data + off
            return self._arr[start : start + n].tobytes()
        return dev.device_read(self.addr + off, n)

    def free(self) -> None:
        if self._base is not None:
            dev.device_free(self._base)
            self._base = None


class Cache:
    """A vLLM-like KV cache: one buffer per layer (`blocks` x `block_len`), on the host, on the
    device, or (mixed) even layers on the device and odd ones on the host."""

    def __init__(self, kind: str, layers: int, blocks: int, block_len: int, offset: int):
        self.layers, self.blocks, self.block_len = layers, blocks, block_len
        kinds = [("device" if l % 2 == 0 else "host") if kind == "mixed" else kind for l in range(layers)]
        self.bufs = [Buf(k, blocks * block_len, offset + l) for l, k in enumerate(kinds)]

    def fill(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for b in self.bufs:
            b.write(0, rng.integers(0, 256, b.n, dtype=np.uint8).tobytes())

    def addrs(self, blocks: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        ptrs = [[b.addr + blk * self.block_len for b in self.bufs] for blk in blocks]
        return ptrs, [[self.block_len] * self.layers for _ in blocks]

    def block(self, blk: int) -> bytes:
        return b"".join(b.read(blk * self.block_len, self.block_len) for b in self.bufs)

    def device_pieces(self, nblocks: int) -> int:
        return nblocks * sum(b.kind == "device" for b in self.bufs)

    def register(self, s) -> None:
        for b in self.bufs:
            assert s.register_buffer(b.addr, b.n) == 0

    def free(self) -> None:
        for b in self.bufs:
            b.free()


def store_in_mode(request, monkeypatch, master: str, mode: str):
    if mode == "embedded":
        return connect(master, 64 * MB)
    proc, _ = start_store(master, "64MB")
    request.addfinalizer(proc.stop)
    if mode == "standalone-tcp":
        monkeypatch.setenv("LUNAKV_DISABLE_SHM", "1")
    return connect(master)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["embedded", "standalone-shm", "standalone-tcp"])
def test_store_calls_move_device_buffers(request, monkeypatch, master, mode, kind):
    """vLLM's save and load (register_buffer, batch_is_exist, the multi-buffer calls), the
    single-buffer calls and batch_put_from / batch_get_into, at odd addresses, with objects
    larger than a staging chunk: every byte arrives and nothing is touched by the CPU."""
    s = store_in_mode(request, monkeypatch, master, mode)
    layers, blocks, block_len = 4, 8, 48 * 1024 + 3
    src = Cache(kind, layers, blocks, block_len, offset=5)
    dst = Cache(kind, layers, blocks, block_len, offset=11)
    src.fill(hash((mode, kind)) & 0xFFFF)
    src.register(s)
    dst.register(s)
    keys = [vllm_key(b, f"dev-{mode}-{kind}") for b in range(blocks)]
    before = dev.device_stats()

    assert s.batch_is_exist(keys) == [0] * blocks
    ptrs, sizes = src.addrs(list(range(blocks)))
    assert s.batch_put_from_multi_buffers(keys, ptrs, sizes) == [0] * blocks
    put_syncs = dev.device_stats()["syncs"] - before["syncs"]
    assert s.batch_is_exist(keys) == [1] * blocks
    order = list(reversed(range(blocks)))
    dptrs, dsizes = dst.addrs(order)
    mid = dev.device_stats()
    assert s.batch_get_into_multi_buffers(keys, dptrs, dsizes) == [layers * block_len] * blocks
    get_syncs = dev.device_stats()["syncs"] - mid["syncs"]
    if kind != "host" and mode == "embedded":
        # 1.5 MB: one copy thread, so the whole batch synchronizes once each way.
        assert (put_syncs, get_syncs) == (1, 1)
    if kind != "host" and mode == "standalone-shm":
        # Once per connection the batch is spread over (at most 4), not once per object (8).
        assert 1 <= put_syncs <= 4 and 1 <= get_syncs <= 4, (put_syncs, get_syncs)
    for i, blk in enumerate(order):
        assert dst.block(blk) == src.block(i), f"block {i} -> {blk}"

    after = dev.device_stats()
    moved = src.device_pieces(blocks)
    if mode != "standalone-tcp" and kind != "host":
        # One DMA per device piece straight into / out of the segment: no bounce buffer, and
        # the segment mapping was pinned for it.
        assert after["d2h_copies"] - before["d2h_copies"] == moved
        assert after["h2d_copies"] - before["h2d_copies"] == moved
        assert after["pinned_bytes"] > 0
    if kind == "host":
        assert after["d2h_copies"] == before["d2h_copies"]
        assert after["h2d_copies"] == before["h2d_copies"]

    # Objects of 3 MiB + 7 (several staging chunks on tcp), single and batch forms.
    big = 3 * MB + 7
    one_kind = "host" if kind == "host" else "device"
    a, b, c = Buf(one_kind, 2 * big, 3), Buf(one_kind, big, 1), Buf(kind if kind != "mixed" else "host", big)
    payload = np.random.default_rng(7).integers(0, 256, 2 * big, dtype=np.uint8).tobytes()
    a.write(0, payload)
    k1, k2, k3 = (vllm_key(i, f"big-{mode}-{kind}") for i in range(3))
    assert s.put_from(k1, a.addr, big) == 0
    assert s.get_into(k1, b.addr, big) == big
    assert b.read() == payload[:big]
    assert s.batch_put_from([k2, k3], [a.addr, a.addr + big], [big, big]) == [0, 0]
    assert s.batch_get_into([k3, k2], [b.addr, c.addr], [big, big]) == [big, big]
    assert b.read() == payload[big:] and c.read() == payload[:big]
    # A destination too small is refused without a byte moved.
    assert s.get_into(k1, b.addr, big - 1) < 0

    assert s.close() == 0
    for x in (src, dst):
        x.free()
    for x in (a, b, c):
        x.free()


@pytest.mark.parametrize("mode", ["embedded", "standalone-shm", "standalone-tcp"])
def test_device_buffers_with_the_pool_secured(monkeypatch, mode):
    """A GPU pod on a secured pool (docs/SECURITY.md): with LUNAKV_AUTH_TOKEN the owners require
    capabilities on every transfer, and vLLM's device-memory save and load still move every byte
    (the capability rides along the staged tcp path and the shm attach as with host buffers)."""
    token = {"LUNAKV_AUTH_TOKEN": "gpu-pod-token-0123456789abcdef"}
    with tempfile.TemporaryDirectory(prefix="lunakv-py-gpu-auth-") as d:
        m = Proc("lunakv-master", ["--rpc_address=127.0.0.1", "--rpc_port=0", "--metrics_port=0",
                                   f"--data_dir={d}"], token)
        store = None
        try:
            addr = m.wait_for("listening")["rpc"].strip('",')
            monkeypatch.setenv("LUNAKV_AUTH_TOKEN", token["LUNAKV_AUTH_TOKEN"])
            if mode != "embedded":
                store, _ = start_store(addr, "64MB", token)
            if mode == "standalone-tcp":
                monkeypatch.setenv("LUNAKV_DISABLE_SHM", "1")
            s = connect(addr, 64 * MB if mode == "embedded" else 0)
            layers, blocks, block_len = 4, 6, 40 * 1024 + 1
            src = Cache("device", layers, blocks, block_len, offset=3)
            dst = Cache("device", layers, blocks, block_len, offset=9)
            src.fill(99)
            src.register(s)
            dst.register(s)
            keys = [vllm_key(b, f"sec-{mode}") for b in range(blocks)]
            ptrs, sizes = src.addrs(list(range(blocks)))
            assert s.batch_put_from_multi_buffers(keys, ptrs, sizes) == [0] * blocks
            assert s.batch_is_exist(keys) == [1] * blocks
            order = list(reversed(range(blocks)))
            dptrs, dsizes = dst.addrs(order)
            assert s.batch_get_into_multi_buffers(keys, dptrs, dsizes) == [layers * block_len] * blocks
            for i, blk in enumerate(order):
                assert dst.block(blk) == src.block(i), f"block {i} -> {blk}"
            assert s.close() == 0
            src.free()
            dst.free()
        finally:
            if store is not None:
                store.stop()
            m.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_pd_raw_transfers_move_device_buffers(kind):
    """mooncake.engine (P/D): a decode engine registers its (device) KV cache, the prefill
    engine writes blocks from its own (device) cache into it with every transfer form, reads
    them back, and the byte helpers work on device memory."""
    prefill, decode = TransferEngine(), TransferEngine()
    for te in (prefill, decode):
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    layers, blocks, block_len = 4, 8, 40 * 1024 + 1
    p = Cache(kind, layers, blocks, block_len, offset=3)
    d = Cache(kind, layers, blocks, block_len, offset=0)
    p.fill(11)
    for te, c in ((prefill, p), (decode, d)):
        assert te.batch_register_memory([b.addr for b in c.bufs], [b.n for b in c.bufs]) == 0
    session = decode.get_session_id()

    # Blocks 0..3 of P into blocks 4..7 of D, one piece per (layer, block).
    src = [b.addr + blk * block_len for b in p.bufs for blk in range(4)]
    dst = [b.addr + blk * block_len for b in d.bufs for blk in range(4, 8)]
    assert prefill.batch_transfer_sync_write(session, src, dst, [block_len] * len(src)) == 0
    for blk in range(4):
        assert d.block(blk + 4) == p.block(blk)
    assert d.block(0) == bytes(layers * block_len), "bytes outside the written blocks changed"

    # Read them back into P's blocks 4..7, sync and async; single forms with odd lengths.
    back = [b.addr + blk * block_len for b in p.bufs for blk in range(4, 8)]
    assert prefill.batch_transfer_sync_read(session, back, dst, [block_len] * len(dst)) == 0
    for blk in range(4):
        assert p.block(blk + 4) == p.block(blk)
    n = block_len * 2 + 17
    assert prefill.transfer_sync_write(session, p.bufs[0].addr + 1, d.bufs[1].addr + 3, n) == 0
    assert d.bufs[1].read(3, n) == p.bufs[0].read(1, n)
    assert prefill.transfer_sync(session, p.bufs[2].addr, d.bufs[1].addr + 3, n, TransferOpcode.Read) == 0
    assert p.bufs[2].read(0, n) == p.bufs[0].read(1, n)
    bid = prefill.batch_transfer_async_write(session, src[:2], dst[:2], [block_len] * 2)
    assert bid > 0 and prefill.get_batch_transfer_status([bid]) == 0

    # The byte helpers on the registered memory.
    data = bytes(range(256)) * 33
    assert decode.write_bytes_to_buffer(d.bufs[3].addr + 7, data, len(data)) == 0
    assert decode.read_bytes_from_buffer(d.bufs[3].addr + 7, len(data)) == data

    for te in (prefill, decode):
        assert te.shutdown() == 0
    p.free()
    d.free()


def test_a_batch_mixing_host_and_device_objects(request, monkeypatch, master):
    """One batch whose objects live on the host and on the device (and one object split across
    both), in embedded mode: each lands where it belongs."""
    s = connect(master, 64 * MB)
    n = 256 * 1024 + 1
    bufs = [Buf("host", n), Buf("device", n, 1), Buf("device", n, 2), Buf("host", n, 3)]
    for i, b in enumerate(bufs):
        b.write(0, bytes([i + 1]) * n)
    keys = [vllm_key(i, "mixed-batch") for i in range(3)]
    # Object 2 is half host, half device.
    half = n // 2
    ptrs = [[bufs[0].addr], [bufs[1].addr], [bufs[3].addr, bufs[2].addr + half]]
    sizes = [[n], [n], [half, n - half]]
    assert s.batch_put_from_multi_buffers(keys, ptrs, sizes) == [0, 0, 0]
    out = [Buf("device", n), Buf("host", n), Buf("device", half, 1), Buf("host", n - half)]
    got = s.batch_get_into_multi_buffers(
        keys, [[out[0].addr], [out[1].addr], [out[2].addr, out[3].addr]], [[n], [n], [half, n - half]]
    )
    assert got == [n, n, n]
    assert out[0].read() == bytes([1]) * n and out[1].read() == bytes([2]) * n
    assert out[2].read() + out[3].read() == bytes([4]) * half + bytes([3]) * (n - half)
    assert s.close() == 0
    for b in bufs + out:
        b.free()


# === the double does crash a path that touches device memory with the CPU ===

def run_py(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=60)


def test_a_cpu_read_of_fake_device_memory_is_sigsegv():
    r = run_py(
        "from mooncake import _lunakv_testing as d\n"
        "a = d.device_alloc(4096)\n"
        "print('allocated', flush=True)\n"
        "d.host_only_read(a, 16)\n"
        "print('survived', flush=True)\n",
        {"LUNAKV_DEVICE": "fake"},
    )
    assert "allocated" in r.stdout and "survived" not in r.stdout
    assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stderr)


def test_a_host_only_data_path_crashes_on_device_buffers(master):
    """With the data path told every address is host memory (`fake-blind`), an embedded
    put_from of a device buffer is a CPU copy from it, and the process dies: what every path
    of the store did before it knew device memory."""
    r = run_py(
        "from mooncake import _lunakv_testing as d\n"
        "from mooncake.store import MooncakeDistributedStore\n"
        "s = MooncakeDistributedStore()\n"
        f"assert s.setup('127.0.0.1', 'P2PHANDSHAKE', 16 << 20, 16 << 20, 'tcp', '', '{master}') == 0\n"
        "a = d.device_alloc(1 << 20)\n"
        "print('put', flush=True)\n"
        "print(s.put_from('k', a, 1 << 20), flush=True)\n",
        {"LUNAKV_DEVICE": "fake-blind"},
    )
    assert "put" in r.stdout, r.stderr
    assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stdout, r.stderr)
