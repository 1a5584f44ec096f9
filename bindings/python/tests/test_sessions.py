"""Upstream's layer-wise session calls on `mooncake.store.MooncakeDistributedStore`, against a
real lunakv-master (and lunakv-store).

The round trip replays the sequence of upstream Mooncake's own end-to-end test for these calls,
mooncake-store/tests/e2e/session_ranges_tcp_e2e.py (kvcache-ai/Mooncake): put session start for
N keys, one `batch_put_from_multi_buffer_ranges` call per layer with one range per key
(`[[ptr]], [[page]], [[layer * page]]`), put session end, then a get session read back layer by
layer with `batch_get_into_multi_buffer_ranges`, get session end, and a revoke of a started
put. vllm-ascend's layer-wise connector (its `LayerwiseStoreBackend` protocol) makes the same
calls with the same shapes; its source was not at hand to cite by path.

Return conventions checked here are upstream's (mooncake-store/src/real_client.cpp): range
calls answer the bytes moved per key; a key without a session, a range outside the object, a
second end or a second start of a put session answer INVALID_PARAMS (-600);
`batch_get_session_end` answers 0 whatever the keys.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import INVALID_PARAMS, NO_AVAILABLE_HANDLE, OBJECT_NOT_FOUND, KvCache, connect, start_store, vllm_key

MB = 1 << 20


@pytest.fixture(params=["embedded", "standalone"])
def store(request, master):
    if request.param == "embedded":
        s = connect(master, 64 * MB)
    else:
        proc, _segment = start_store(master, "64MB")
        request.addfinalizer(proc.stop)
        s = connect(master, 0)
    yield s
    s.close()


def layer_put(s, keys, kv, blocks, layer):
    """One layer of a layer-wise save: key i's range is block `blocks[i]` of `layer`, at
    `layer * block_len` in its object."""
    ptrs = [[kv.pieces(b)[0][layer]] for b in blocks]
    sizes = [[kv.block_len] for _ in blocks]
    offsets = [[layer * kv.block_len] for _ in blocks]
    return s.batch_put_from_multi_buffer_ranges(keys, ptrs, sizes, offsets)


def layer_get(s, keys, kv, blocks, layer):
    ptrs = [[kv.pieces(b)[0][layer]] for b in blocks]
    sizes = [[kv.block_len] for _ in blocks]
    offsets = [[layer * kv.block_len] for _ in blocks]
    return s.batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, offsets)


def test_layerwise_put_then_get_round_trip(store):
    s = store
    layers, blocks, block_len = 6, 8, 8 * 1024
    src = KvCache(layers, blocks, block_len)
    src.arr[:] = np.random.default_rng(11).integers(0, 256, src.arr.shape, dtype=np.uint8)
    dst = KvCache(layers, blocks, block_len)
    assert s.register_buffer(src.base, src.nbytes) == 0
    assert s.register_buffer(dst.base, dst.nbytes) == 0

    saved = [1, 2, 5, 7]
    keys = [vllm_key(b, prefix="session") for b in saved]
    size = layers * block_len
    assert s.batch_put_session_start(keys, [size] * len(keys)) == [0] * len(keys)
    # Reserved, not readable yet.
    assert s.batch_is_exist(keys) == [0] * len(keys)
    # Layers in an order other than 0..L-1: each call writes only its own range.
    for layer in [3, 0, 5, 1, 4, 2]:
        assert layer_put(s, keys, src, saved, layer) == [block_len] * len(keys)
    assert s.batch_put_session_end(keys) == [0] * len(keys)
    assert s.batch_is_exist(keys) == [1] * len(keys)
    # Ended once: a second end has no session.
    assert s.batch_put_session_end(keys[:1]) == [INVALID_PARAMS]

    # Whole-object reads see the layers in order.
    for k, b in zip(keys, saved):
        assert s.get(k) == src.block_bytes(b)
    ptrs, sizes = dst.addrs(saved)
    assert s.batch_get_into_multi_buffers(keys, ptrs, sizes) == [size] * len(keys)
    assert dst.arr[:, saved, :].tobytes() == src.arr[:, saved, :].tobytes()
    dst.arr[:] = 0

    # Layer-wise read back into other blocks of the destination cache.
    load_to = [0, 3, 4, 6]
    assert s.batch_get_session_start(keys) == [0] * len(keys)
    for layer in range(layers):
        assert layer_get(s, keys, dst, load_to, layer) == [block_len] * len(keys)
    assert s.batch_get_session_end(keys) == 0
    for b_src, b_dst in zip(saved, load_to):
        assert dst.block_bytes(b_dst) == src.block_bytes(b_src), f"block {b_src}"
    assert not dst.arr[:, [1, 2, 5, 7], :].any()
    # The session is gone: ranges have nothing to read.
    assert layer_get(s, keys[:1], dst, load_to[:1], 0) == [INVALID_PARAMS]
    assert s.batch_get_session_end(keys) == 0

    # Several ranges of one key in one call (all of its layers at once).
    one = KvCache(layers, 1, block_len)
    assert s.register_buffer(one.base, one.nbytes) == 0
    assert s.batch_get_session_start(keys[:1]) == [0]
    got = s.batch_get_into_multi_buffer_ranges(
        keys[:1],
        [one.pieces(0)[0][::-1]],
        [[block_len] * layers],
        [[layer * block_len for layer in reversed(range(layers))]],
    )
    assert got == [size]
    assert one.block_bytes(0) == src.block_bytes(saved[0])
    assert s.batch_get_session_end(keys[:1]) == 0
    assert s._session_counts() == (0, 0, 0)


def test_revoked_session_is_not_readable_and_the_key_can_be_put_again(store):
    s = store
    data = np.random.default_rng(3).integers(0, 256, 2 * 4096, dtype=np.uint8)
    assert s.register_buffer(data.ctypes.data, data.nbytes) == 0
    key = vllm_key(1, prefix="revoke")
    assert s.batch_put_session_start([key], [4096]) == [0]
    assert s.batch_put_from_multi_buffer_ranges([key], [[data.ctypes.data]], [[4096]], [[0]]) == [4096]
    assert s.batch_put_session_revoke([key]) == [0]
    assert s.is_exist(key) == 0
    assert s.get(key) == b""
    assert s.get_size(key) == OBJECT_NOT_FOUND
    # Revoked: no session to write to, end or revoke.
    assert s.batch_put_from_multi_buffer_ranges([key], [[data.ctypes.data]], [[4096]], [[0]]) == [INVALID_PARAMS]
    assert s.batch_put_session_end([key]) == [INVALID_PARAMS]
    assert s.batch_put_session_revoke([key]) == [INVALID_PARAMS]

    # The key is free again, for a session ...
    assert s.batch_put_session_start([key], [4096]) == [0]
    second = data.ctypes.data + 4096
    assert s.batch_put_from_multi_buffer_ranges([key], [[second]], [[4096]], [[0]]) == [4096]
    assert s.batch_put_session_end([key]) == [0]
    assert s.get(key) == data[4096:].tobytes()
    # ... and for a plain put once removed.
    assert s.remove(key) == 0
    assert s.put_from(key, data.ctypes.data, 4096) == 0
    assert s.get(key) == data[:4096].tobytes()


def test_out_of_range_writes_and_reads_are_refused_whole(store):
    s = store
    buf = np.arange(4 * 4096, dtype=np.uint8)
    ptr = buf.ctypes.data
    assert s.register_buffer(ptr, buf.nbytes) == 0
    size = 2 * 4096
    good, bad = vllm_key(1, prefix="oob"), vllm_key(2, prefix="oob")
    assert s.batch_put_session_start([good, bad], [size, size]) == [0, 0]

    # `bad`: a first range that fits and a second that ends past the object: nothing of it is
    # written. `good` in the same call is written.
    got = s.batch_put_from_multi_buffer_ranges(
        [good, bad],
        [[ptr, ptr + 4096], [ptr, ptr + 4096]],
        [[4096, 4096], [4096, 4096]],
        [[0, 4096], [0, 4097]],
    )
    assert got == [size, INVALID_PARAMS]
    for offsets, sizes in [([size], [1]), ([0], [size + 1]), ([size - 10], [20]), ([1 << 62], [4096])]:
        assert s.batch_put_from_multi_buffer_ranges([bad], [[ptr]], [sizes], [offsets]) == [INVALID_PARAMS]
    # A negative offset, or pointer and offset lists of different lengths.
    assert s.batch_put_from_multi_buffer_ranges([bad], [[ptr]], [[16]], [[-1]]) == [INVALID_PARAMS]
    assert s.batch_put_from_multi_buffer_ranges([bad], [[ptr]], [[16]], [[0, 16]]) == [INVALID_PARAMS]
    # Outer lists that do not match the keys refuse every key.
    assert s.batch_put_from_multi_buffer_ranges([good, bad], [[ptr]], [[16]], [[0]]) == [INVALID_PARAMS] * 2

    assert s.batch_put_session_end([good, bad]) == [0, 0]
    assert s.get(good) == buf[:size].tobytes()
    # None of the refused ranges reached `bad`: never written, its bytes are zero.
    assert s.get(bad) == bytes(size)

    # Reads: a range past the object is refused and the destination is left alone.
    out = np.full(size, 0xEE, dtype=np.uint8)
    assert s.register_buffer(out.ctypes.data, out.nbytes) == 0
    assert s.batch_get_session_start([good]) == [0]
    got = s.batch_get_into_multi_buffer_ranges(
        [good], [[out.ctypes.data, out.ctypes.data + 4096]], [[4096, 4096]], [[0, 4097]]
    )
    assert got == [INVALID_PARAMS]
    assert (out == 0xEE).all()
    assert s.batch_get_into_multi_buffer_ranges([good], [[out.ctypes.data]], [[16]], [[size - 8]]) == [INVALID_PARAMS]
    # Overlapping destinations are refused (as every get into caller buffers).
    assert s.batch_get_into_multi_buffer_ranges(
        [good], [[out.ctypes.data, out.ctypes.data + 8]], [[16, 16]], [[0, 16]]
    ) == [INVALID_PARAMS]
    assert (out == 0xEE).all()
    assert s.batch_get_into_multi_buffer_ranges([good], [[out.ctypes.data]], [[100]], [[4000]]) == [100]
    assert out[:100].tobytes() == buf[4000:4100].tobytes()
    assert s.batch_get_session_end([good]) == 0


def test_calls_without_a_session(store):
    s = store
    buf = np.zeros(4096, dtype=np.uint8)
    ptr = buf.ctypes.data
    assert s.register_buffer(ptr, buf.nbytes) == 0
    key = vllm_key(9, prefix="nosession")
    assert s.batch_put_from_multi_buffer_ranges([key], [[ptr]], [[16]], [[0]]) == [INVALID_PARAMS]
    assert s.batch_get_into_multi_buffer_ranges([key], [[ptr]], [[16]], [[0]]) == [INVALID_PARAMS]
    assert s.batch_put_session_end([key]) == [INVALID_PARAMS]
    assert s.batch_put_session_revoke([key]) == [INVALID_PARAMS]
    assert s.batch_get_session_end([key]) == 0
    # A get session needs the object; a missing one is the master's answer.
    assert s.batch_get_session_start([key]) == [OBJECT_NOT_FOUND]
    # A put session is opened once; the second start is refused and the first stays usable.
    assert s.batch_put_session_start([key], [4096]) == [0]
    assert s.batch_put_session_start([key], [4096]) == [INVALID_PARAMS]
    assert s.batch_put_from_multi_buffer_ranges([key], [[ptr]], [[4096]], [[0]]) == [4096]
    # A put session does not make a get session.
    assert s.batch_get_into_multi_buffer_ranges([key], [[ptr]], [[16]], [[0]]) == [INVALID_PARAMS]
    assert s.batch_put_session_end([key]) == [0]
    # A plain put of a key whose session is open is refused by the master as any second put.
    other = vllm_key(10, prefix="nosession")
    assert s.batch_put_session_start([other], [4096]) == [0]
    assert s.put_from(other, ptr, 4096) == -705
    assert s.batch_put_session_revoke([other]) == [0]
    # Mismatched keys and sizes refuse every key; an empty call answers nothing.
    assert s.batch_put_session_start([other, key], [4096]) == [INVALID_PARAMS] * 2
    assert s.batch_put_session_start([other], [0]) == [INVALID_PARAMS]
    assert s.batch_put_session_start([other], [-1]) == [INVALID_PARAMS]
    assert s.batch_get_session_start([]) == []
    assert s._session_counts() == (0, 0, 0)


def test_session_bounds_refuse_more_and_free_on_end(master, monkeypatch, capfd):
    monkeypatch.setenv("LUNAKV_SESSION_MAX_KEYS", "3")
    monkeypatch.setenv("LUNAKV_SESSION_MAX_BYTES", "64KB")
    s = connect(master, 64 * MB)
    try:
        keys = [vllm_key(i, prefix="bound") for i in range(5)]
        assert s.batch_put_session_start(keys, [4096] * 5) == [0, 0, 0, NO_AVAILABLE_HANDLE, NO_AVAILABLE_HANDLE]
        # -200 alone would read as a full pool: the log names the bound that refused them.
        err = capfd.readouterr().err
        assert "refused 2 key(s) at a session bound" in err and "LUNAKV_SESSION_MAX_KEYS" in err, err
        assert s._session_counts() == (3, 0, 3 * 4096)
        # Get sessions count against the same bound.
        assert s.put(keys[4], b"x" * 100) == 0
        assert s.batch_get_session_start([keys[4]]) == [NO_AVAILABLE_HANDLE]
        assert s.batch_put_session_end(keys[:1]) == [0]
        assert s.batch_put_session_revoke(keys[1:2]) == [0]
        assert s.batch_get_session_start([keys[4]]) == [0]
        # Starting it again replaces it (no second slot).
        assert s.batch_get_session_start([keys[4]]) == [0]
        assert s._session_counts() == (1, 1, 4096 + 100)
        # The byte bound: 64 KiB in all.
        big = vllm_key(99, prefix="bound")
        assert s.batch_put_session_start([big], [64 * 1024]) == [NO_AVAILABLE_HANDLE]
        assert "LUNAKV_SESSION_MAX_BYTES" in capfd.readouterr().err
        assert s.batch_get_session_end([keys[4]]) == 0
        assert s.batch_put_session_revoke([keys[2]]) == [0]
        assert s.batch_put_session_start([big], [64 * 1024]) == [0]
        assert s.batch_put_session_revoke([big]) == [0]
        assert s._session_counts() == (0, 0, 0)
    finally:
        s.close()


def test_sessions_never_ended_are_dropped_when_idle(master, monkeypatch):
    monkeypatch.setenv("LUNAKV_SESSION_IDLE_SEC", "0.5")
    s = connect(master, 64 * MB)
    try:
        buf = np.ones(4096, dtype=np.uint8)
        assert s.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        done = vllm_key(1, prefix="idle")
        assert s.put(done, b"y" * 4096) == 0
        left = [vllm_key(i, prefix="idle") for i in range(2, 6)]
        assert s.batch_put_session_start(left, [4096] * len(left)) == [0] * len(left)
        assert s.batch_get_session_start([done]) == [0]
        assert s._session_counts() == (4, 1, 5 * 4096)
        time.sleep(0.7)
        # The next start sweeps them: their staged bytes are gone and their keys have no session.
        fresh = vllm_key(7, prefix="idle")
        assert s.batch_put_session_start([fresh], [4096]) == [0]
        assert s._session_counts() == (1, 0, 4096)
        assert s.batch_put_from_multi_buffer_ranges(left[:1], [[buf.ctypes.data]], [[16]], [[0]]) == [INVALID_PARAMS]
        assert s.batch_get_into_multi_buffer_ranges([done], [[buf.ctypes.data]], [[16]], [[0]]) == [INVALID_PARAMS]
        # A session in use is not idle.
        for _ in range(3):
            time.sleep(0.3)
            assert s.batch_put_from_multi_buffer_ranges([fresh], [[buf.ctypes.data]], [[4096]], [[0]]) == [4096]
            assert s.batch_put_session_start([vllm_key(8, prefix="idle")], [16]) == [0]
            assert s.batch_put_session_revoke([vllm_key(8, prefix="idle")]) == [0]
        assert s.batch_put_session_end([fresh]) == [0]
        assert s.get(fresh) == buf.tobytes()
    finally:
        s.close()


def test_device_buffers_are_refused_not_dereferenced(master):
    """Session ranges are copied by the CPU, so device memory (the fake double: a CPU access
    is SIGSEGV, docs/GPU.md) is refused with -600; reaching this test's end proves no copy ran."""
    from mooncake import _lunakv_testing as dev

    assert dev.device_layer() == "fake", "conftest.py sets LUNAKV_DEVICE=fake"
    s = connect(master, 64 * MB)
    gpu = dev.device_alloc(4096)
    try:
        assert s.register_buffer(gpu, 4096) == 0
        key = vllm_key(1, prefix="device")
        assert s.batch_put_session_start([key], [4096]) == [0]
        assert s.batch_put_from_multi_buffer_ranges([key], [[gpu]], [[4096]], [[0]]) == [INVALID_PARAMS]
        host = np.full(4096, 7, dtype=np.uint8)
        assert s.batch_put_from_multi_buffer_ranges([key], [[host.ctypes.data]], [[4096]], [[0]]) == [4096]
        assert s.batch_put_session_end([key]) == [0]
        assert s.batch_get_session_start([key]) == [0]
        assert s.batch_get_into_multi_buffer_ranges([key], [[gpu]], [[4096]], [[0]]) == [INVALID_PARAMS]
        assert s.batch_get_session_end([key]) == 0
        # The whole-block calls take the same device buffer.
        assert s.batch_get_into_multi_buffers([key], [[gpu]], [[4096]]) == [4096]
        assert dev.device_read(gpu, 4096) == host.tobytes()
    finally:
        s.close()
        dev.device_free(gpu)
