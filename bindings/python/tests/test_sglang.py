"""SGLang HiCache's Mooncake backend, as its source calls the store, through a real master and
lunakv-store.

Followed: sgl-project/sglang main (mid-2026),
`python/sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py`:
- `standalone_storage=True`: the host KV pool comes from `MooncakeHostTensorAllocator`, which
  calls `mooncake.store.MooncakeHostMemAllocator().alloc(size)` and wraps the address with
  `ctypes` + `torch.frombuffer`; then `setup_dummy(pool bytes, 16 MiB, client_server_address)`;
- `register_mem_pool_host`: `register_buffer(kv_buffer.data_ptr(), nbytes)`;
- the zero-copy set and get: `batch_is_exist(keys)`, `batch_put_from(keys, ptrs, sizes)`,
  `batch_get_into(keys, ptrs, sizes)` (bytes read per key), with MHA keys
  `<page hash>_<tp rank>_k` / `_v`.
numpy stands in for torch's tensor over the same address (the test double is the host pool
only; every byte goes through the real store).
"""

from __future__ import annotations

import ctypes

import numpy as np

from conftest import INVALID_PARAMS

PAGE = 64 * 1024
PAGES = 8


def test_sglang_standalone_storage_sequence(master, store_64mb, monkeypatch, capfd):
    from mooncake.store import MooncakeDistributedStore, MooncakeHostMemAllocator

    # The engine's Mooncake config names the master (lunakv has no dummy/real client split).
    monkeypatch.setenv("MOONCAKE_MASTER", master)
    alloc = MooncakeHostMemAllocator()
    pool_bytes = PAGES * 2 * PAGE  # K and V of each page
    ptr = alloc.alloc(pool_bytes)
    assert ptr != 0 and ptr % 4096 == 0
    pool = np.frombuffer((ctypes.c_ubyte * pool_bytes).from_address(ptr), dtype=np.uint8)
    pool[:] = np.arange(pool_bytes, dtype=np.uint64).astype(np.uint8)
    expected = pool.copy()

    s = MooncakeDistributedStore()
    assert s.setup_dummy(pool_bytes, 16 * 1024 * 1024, store_64mb) == 0
    assert s.register_buffer(ptr, pool_bytes) == 0
    keys, ptrs, sizes = [], [], []
    for page in range(PAGES):
        for i, kv in enumerate("kv"):
            keys.append(f"{page:064x}_0_{kv}")
            ptrs.append(ptr + (page * 2 + i) * PAGE)
            sizes.append(PAGE)
    assert s.batch_is_exist(keys) == [0] * len(keys)
    assert s.batch_put_from(keys, ptrs, sizes) == [0] * len(keys)
    assert s.batch_is_exist(keys) == [1] * len(keys)
    # Puts land on the standalone store first, as on upstream's real client.
    descs = s.batch_get_replica_desc(keys)
    assert {r.segment_name for reps in descs.values() for r in reps} == {store_64mb}
    pool[:] = 0
    assert s.batch_get_into(keys, ptrs, sizes) == sizes
    assert np.array_equal(pool, expected)
    assert s.unregister_buffer(ptr) == 0
    s.close()
    assert alloc.free(ptr) == 0
    assert alloc.free(ptr) == -1, "an address it did not hand out (any more)"

    # Without a master to reach, setup_dummy refuses and names the fix.
    monkeypatch.delenv("MOONCAKE_MASTER")
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    s = MooncakeDistributedStore()
    assert s.setup_dummy(pool_bytes, 16 * 1024 * 1024, store_64mb) == INVALID_PARAMS
    err = capfd.readouterr().err
    assert "setup_dummy" in err and "MOONCAKE_MASTER" in err, err
