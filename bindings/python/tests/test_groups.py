"""Object groups (upstream's `ReplicateConfig.group_ids`) through a real master and store.

The callers replayed, with the calls and group ids their sources make:
- vLLM's `MooncakeStoreConnector` with `enable_group_semantics` (vllm-project/vllm main,
  mid-2026, `distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_store_worker.py`):
  each TP rank saves its shard of a chunk with `batch_put_from_multi_buffers(keys, addrs,
  sizes, config)` where `config.group_ids[i]` is
  `vllm-mooncake-store:<model>@<chunk hash>`: no TP rank in it, so all shards of one chunk are
  one group. The worker probes `group_ids` on the class before using it.
- SGLang HiCache (`mem_cache/storage/mooncake_store/mooncake_store.py`, sglang#26574) with
  `enable_group_semantics`: `batch_put_from(keys, ptrs, sizes, config)` with
  `config.group_ids[i] = "sglang-hicache:<logical page key>"`.
The pool is filled past its capacity so eviction must run, and after every put every group is
checked: a reader finds all of its members or none.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np
import pytest

from conftest import INVALID_PARAMS, Proc, start_store

MB = 1 << 20
SHARD = 1 * MB  # one TP shard of one chunk
TP = 2


@pytest.fixture
def short_lease_master():
    """A lunakv-master whose read leases last 50 ms, so the checks below (exists grants a
    lease, as upstream's) do not keep every group from eviction."""
    with tempfile.TemporaryDirectory(prefix="lunakv-py-groups-") as d:
        p = Proc("lunakv-master", ["--rpc_address=127.0.0.1", "--rpc_port=0", "--metrics_port=0",
                                   f"--data_dir={d}", "--default_kv_lease_ttl=50"])
        try:
            yield p.wait_for("listening")["rpc"].strip('",')
        finally:
            p.stop()


def store(master: str):
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MB, "tcp", "", master) == 0
    return s


def all_or_none(s, groups: dict[str, list[str]]) -> None:
    for g, keys in groups.items():
        found = s.batch_is_exist(keys)
        assert found in ([1] * len(keys), [0] * len(keys)), f"group {g} is partial: {found}"


def test_vllm_tp_shards_of_a_chunk_are_evicted_together(short_lease_master):
    from mooncake.store import ReplicateConfig

    assert hasattr(ReplicateConfig, "group_ids"), "vLLM probes the class for group_ids"
    master = short_lease_master
    proc, _seg = start_store(master, "32MB")
    try:
        ranks = [store(master) for _ in range(TP)]
        # One KV region per rank, registered as vLLM registers its KV tensors.
        regions = [np.zeros(4 * SHARD, dtype=np.uint8) for _ in range(TP)]
        for s, r in zip(ranks, regions):
            assert s.register_buffer(r.ctypes.data, r.nbytes) == 0
        groups: dict[str, list[str]] = {}
        written: dict[str, bytes] = {}
        for chunk in range(40):  # 40 chunks x 2 shards x 1 MiB = 80 MiB into a 32 MiB pool
            h = f"{chunk:064x}"
            group = f"vllm-mooncake-store:Qwen3-8B@{h}"
            keys = []
            for rank, (s, r) in enumerate(zip(ranks, regions)):
                key = f"Qwen3-8B@tp_rank:{rank}@{h}"
                # Two layer pieces per shard, as the worker passes K and V segments.
                r[: SHARD // 2] = (chunk * 7 + rank) % 251
                r[SHARD // 2: SHARD] = (chunk * 11 + rank) % 251
                addrs = [[r.ctypes.data, r.ctypes.data + SHARD // 2]]
                sizes = [[SHARD // 2, SHARD // 2]]
                cfg = ReplicateConfig()
                cfg.group_ids = [group]
                assert s.batch_put_from_multi_buffers([key], addrs, sizes, cfg) == [0]
                written[key] = r[:SHARD].tobytes()
                keys.append(key)
            groups[group] = keys
            all_or_none(ranks[0], groups)
            time.sleep(0.06)  # the check's 50 ms leases end, as a reader's would
        present = [g for g, keys in groups.items() if ranks[0].batch_is_exist(keys) == [1] * TP]
        assert 0 < len(present) < len(groups), "the pool had to evict and kept some"
        # What is present reads back exactly, every shard of every present chunk.
        for g in present:
            for rank, key in enumerate(groups[g]):
                assert ranks[rank].get(key) == written[key]
        for s in ranks:
            s.close()
    finally:
        proc.stop()


def test_sglang_pages_grouped_and_a_removed_member_takes_its_group(short_lease_master):
    from mooncake.store import ReplicateConfig

    master = short_lease_master
    proc, _seg = start_store(master, "32MB")
    try:
        s = store(master)
        buf = np.arange(8 * 4096, dtype=np.uint32).view(np.uint8)
        assert s.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        # Three sub-objects per logical page (K, V and an indexer sidecar), one group per page.
        keys, ptrs, sizes, gids = [], [], [], []
        for page in range(4):
            for part in ("k", "v", "idx"):
                keys.append(f"page{page}_{part}")
                ptrs.append(buf.ctypes.data + len(keys) * 4096)
                sizes.append(4096)
                gids.append(f"sglang-hicache:page{page}")
        cfg = ReplicateConfig()
        cfg.group_ids = gids
        assert s.batch_put_from(keys, ptrs, sizes, cfg) == [0] * len(keys)
        # Removing one member removes its page's group, and no other.
        assert s.remove("page1_v") == 0
        assert s.batch_is_exist(["page1_k", "page1_v", "page1_idx"]) == [0, 0, 0]
        assert s.batch_is_exist(["page2_k", "page2_v", "page2_idx"]) == [1, 1, 1]
        # group_ids must give one entry per key ("" for none); a mismatch is refused, not guessed.
        cfg.group_ids = ["only-one"]
        assert s.batch_put_from(["x1", "x2"], ptrs[:2], sizes[:2], cfg) == [INVALID_PARAMS] * 2
        cfg.group_ids = ["", "g"]
        assert s.batch_put_from(["x1", "x2"], ptrs[:2], sizes[:2], cfg) == [0, 0]
        s.close()
    finally:
        proc.stop()
