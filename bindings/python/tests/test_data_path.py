"""The fast paths of the data path, from Python: big batches (copied over several threads in
embedded mode), caller buffers at odd alignments (the vector copy that replaces memcpy), and warm
gets that never ask the master."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest

from conftest import connect, start_store, vllm_key
from mooncake.store import MooncakeDistributedStore

MB = 1 << 20


def store_in_mode(request, master: str, mode: str) -> MooncakeDistributedStore:
    """A client owning a 64 MB segment (embedded), or a requester of a 64 MB lunakv-store on this
    host (standalone-shm: bytes move through the store's memfd)."""
    if mode == "embedded":
        return connect(master, 64 * MB)
    proc, _ = start_store(master, "64MB")
    request.addfinalizer(proc.stop)
    return connect(master)


class OffsetCache:
    """A KV cache (layers x blocks x block_len, one region per layer) whose data starts `offset`
    bytes past a 4 KiB boundary, with guard bytes on both sides that must never be written."""

    GUARD = 256

    def __init__(self, layers: int, blocks: int, block_len: int, offset: int, fill: int = 0):
        n = layers * blocks * block_len
        raw = np.full(n + 2 * self.GUARD + 4096, 0xEE, dtype=np.uint8)
        start = (-raw.ctypes.data) % 4096 + self.GUARD + offset
        self.raw, self.start, self.n = raw, start, n
        self.arr = raw[start : start + n].reshape(layers, blocks, block_len)
        self.arr[:] = fill
        self.layers, self.blocks, self.block_len = layers, blocks, block_len
        assert self.arr.ctypes.data % 4096 == (self.GUARD + offset) % 4096

    def addrs(self, blocks: list[int]) -> tuple[list[list[int]], list[list[int]]]:
        base, stride = self.arr.ctypes.data, self.blocks * self.block_len
        ptrs = [[base + l * stride + b * self.block_len for l in range(self.layers)] for b in blocks]
        return ptrs, [[self.block_len] * self.layers for _ in blocks]

    def guards_intact(self) -> bool:
        return bool((self.raw[: self.start] == 0xEE).all() and (self.raw[self.start + self.n :] == 0xEE).all())


@pytest.mark.parametrize("mode", ["embedded", "standalone-shm"])
@pytest.mark.parametrize("offset", [1, 16, 64])
def test_big_batches_at_odd_alignments_round_trip(request, master, mode, offset):
    """One 16 MiB batch (32 blocks x 32 layers x 16 KiB: split over copy threads in embedded
    mode) saved from a cache `offset` bytes into a page and loaded into another at a different
    offset: every byte arrives, nothing around the caches is touched."""
    s = store_in_mode(request, master, mode)
    layers, blocks, block_len = 32, 32, 16 * 1024
    src = OffsetCache(layers, blocks, block_len, offset)
    src.arr[:] = np.random.default_rng(offset).integers(0, 256, src.arr.shape, dtype=np.uint8)
    dst = OffsetCache(layers, blocks, block_len, (offset * 7 + 5) % 64)
    keys = [vllm_key(b, f"align{offset}-{mode}") for b in range(blocks)]
    ptrs, sizes = src.addrs(list(range(blocks)))
    assert s.batch_put_from_multi_buffers(keys, ptrs, sizes) == [0] * blocks
    # Loaded in reverse block order, so each object's pieces land elsewhere than they came from.
    order = list(reversed(range(blocks)))
    dptrs, dsizes = dst.addrs(order)
    assert s.batch_get_into_multi_buffers(keys, dptrs, dsizes) == [layers * block_len] * blocks
    assert np.array_equal(dst.arr[:, order, :], src.arr)
    assert dst.guards_intact() and src.guards_intact()
    # Single-buffer forms at an odd address too (one object, contiguous).
    one = np.zeros(layers * block_len + 3, dtype=np.uint8)
    assert s.get_into(keys[5], one.ctypes.data + 3, layers * block_len) == layers * block_len
    assert one[3:].tobytes() == src.arr[:, 5, :].tobytes()
    assert s.close() == 0


def rpc_counts(admin: str) -> dict[str, int]:
    """`master_<rpc>_requests_total` from the master's /metrics."""
    with urllib.request.urlopen(f"http://{admin}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("master_") and "_requests_total" in line and not line.startswith("#"):
            name, value = line.split()[:2]
            out[name.split("{")[0][len("master_") : -len("_requests_total")]] = int(float(value))
    return out


@pytest.mark.parametrize("mode", ["embedded", "standalone-shm"])
def test_warm_gets_do_not_ask_the_master(request, master_addrs, mode):
    """Objects this client put (or checked with batch_is_exist) are read without a master round
    trip: the get-path RPCs stay at zero however many gets run. A client that never saw the keys
    asks once per batch, so the counters do move when a get needs the master."""
    rpc, admin = master_addrs
    s = store_in_mode(request, rpc, mode)
    layers, blocks, block_len = 8, 8, 16 * 1024
    src = OffsetCache(layers, blocks, block_len, 0)
    src.arr[:] = np.random.default_rng(3).integers(0, 256, src.arr.shape, dtype=np.uint8)
    dst = OffsetCache(layers, blocks, block_len, 0)
    keys = [vllm_key(b, f"warm-{mode}") for b in range(blocks)]
    ptrs, sizes = src.addrs(list(range(blocks)))
    assert s.batch_put_from_multi_buffers(keys, ptrs, sizes) == [0] * blocks
    get_rpcs = ("get_replica_list", "batch_get_replica_list", "exist_key", "batch_exist_key")
    before = rpc_counts(admin)
    assert all(name in before for name in get_rpcs), before
    dptrs, dsizes = dst.addrs(list(range(blocks)))
    obj = layers * block_len
    flat = np.zeros(2 * obj, dtype=np.uint8)
    fp = flat.ctypes.data
    for _ in range(5):
        assert s.batch_get_into_multi_buffers(keys, dptrs, dsizes) == [obj] * blocks
        assert s.get_into(keys[0], fp, obj) == obj
        assert s.batch_get_into(keys[1:3], [fp, fp + obj], [obj, obj]) == [obj, obj]
    after = rpc_counts(admin)
    assert {n: after[n] - before[n] for n in get_rpcs} == {n: 0 for n in get_rpcs}
    assert np.array_equal(dst.arr, src.arr)
    assert flat.tobytes() == src.arr[:, 1, :].tobytes() + src.arr[:, 2, :].tobytes()

    # A second client in this process never saw the keys: its first batch asks the master once,
    # its second is warm again.
    cold = connect(rpc)
    other = OffsetCache(layers, blocks, block_len, 0)
    optrs, osizes = other.addrs(list(range(blocks)))
    assert cold.batch_get_into_multi_buffers(keys, optrs, osizes) == [layers * block_len] * blocks
    mid = rpc_counts(admin)
    assert mid["batch_get_replica_list"] - after["batch_get_replica_list"] == 1
    assert cold.batch_get_into_multi_buffers(keys, optrs, osizes) == [layers * block_len] * blocks
    assert rpc_counts(admin)["batch_get_replica_list"] == mid["batch_get_replica_list"]
    assert np.array_equal(other.arr, src.arr)
    assert cold.close() == 0 and s.close() == 0
