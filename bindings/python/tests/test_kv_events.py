"""Pool KV events (issue 13, docs/EVENTS.md): subscribers written as Mooncake's guide and vLLM's
kv_events.py define them (pyzmq + msgpack, and msgspec structs), against a real lunakv-master
with `--enable_kv_event_publish` and a real lunakv-store, written to through the `mooncake`
module with vLLM-format keys.
"""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
import zmq

from conftest import Proc, connect, start_store, vllm_key

MB = 1 << 20
PODS = ["10.0.0.5:8000", "10.0.0.6:8000"]
MODEL = "Qwen3-8B"
END = b"\xff" * 8


# === vLLM's event structs (vllm/distributed/kv_events.py), array-like as llm-d reads them ===

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of vLLM's KV cache events (tag = class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


VLLM_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


# === the master and the subscribers ===

class EventsMaster:
    """A lunakv-master publishing KV events on ephemeral ports."""

    def __init__(self, extra: list[str] | None = None, pods: list[str] = PODS):
        self.dir = tempfile.TemporaryDirectory(prefix="lunakv-py-events-")
        self.p = Proc(
            "lunakv-master",
            [
                "--rpc_address=127.0.0.1",
                "--rpc_port=0",
                "--metrics_port=0",
                f"--data_dir={self.dir.name}",
                "--enable_kv_event_publish=true",
                "--kv_event_publisher_endpoint=tcp://127.0.0.1:*",
                "--kv_event_publisher_replay_endpoint=tcp://127.0.0.1:*",
                "--kv_events_vllm_endpoint=tcp://127.0.0.1:*",
                f"--kv_events_vllm_pods={','.join(pods)}",
                *(extra or []),
            ],
        )
        line = self.p.wait_for("listening")
        self.rpc = line["rpc"]
        self.admin = line["admin"]
        self.events = line["events"]
        self.replay = line["events_replay"]
        self.vllm = line["events_vllm"]

    def status(self) -> dict:
        with urllib.request.urlopen(f"http://{self.admin}/kv_events", timeout=5) as r:
            return json.loads(r.read())

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://{self.admin}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not in /metrics")

    def stop(self) -> None:
        self.p.stop()
        self.dir.cleanup()


class Sub:
    """A SUB socket on one stream, with the decoded messages it has received."""

    def __init__(self, ctx: zmq.Context, endpoint: str, prefix: bytes, stream: str, master: EventsMaster):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, prefix)
        self.sock.connect(endpoint)
        self.msgs: list[tuple[bytes, int, bytes]] = []
        # Slow joiner: wait until the master's PUB counts this connection, then until the
        # subscription itself has travelled (a short settle).
        deadline = time.monotonic() + 10
        while master.status()["subscribers"][stream] < 1:
            assert time.monotonic() < deadline, "the master never saw the subscriber"
            time.sleep(0.05)
        time.sleep(0.3)

    def drain(self, until, timeout: float = 15.0) -> None:
        """Receives until `until(self)` holds."""
        deadline = time.monotonic() + timeout
        while not until(self):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; got {len(self.msgs)} messages: {self.msgs[-3:]}"
            if self.sock.poll(int(min(left, 0.5) * 1000)):
                topic, seq, payload = self.sock.recv_multipart()
                assert len(seq) == 8
                self.msgs.append((topic, int.from_bytes(seq, "big"), payload))

    def close(self) -> None:
        self.sock.close(linger=0)


def mooncake_events(sub: Sub) -> list[list]:
    out = []
    for _, _, payload in sub.msgs:
        ts, events = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and ts > 1.6e9
        out.extend(events)
    return out


def vllm_events(sub: Sub, topic: str) -> list:
    out = []
    for t, _, payload in sub.msgs:
        if t.decode() == topic:
            batch = VLLM_DECODER.decode(payload)
            assert batch.data_parallel_rank == 0
            out.extend(batch.events)
    return out


def key_hash(key: str) -> str:
    return key.rsplit("@", 1)[1]


@pytest.fixture
def events_master():
    m = EventsMaster()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_store_remove_and_remove_all_on_both_streams(events_master, ctx):
    m = events_master
    store, seg = start_store(m.rpc, "64MB")
    moon = Sub(ctx, m.events, b"mooncake", "mooncake", m)
    vll = Sub(ctx, m.vllm, b"kv@", "vllm", m)
    try:
        s = connect(m.rpc)
        keys = [vllm_key(i, prefix="ev") for i in range(1, 6)]
        assert s.put_batch(keys, [b"x" * 4096] * len(keys)) == 0
        assert s.put("not-a-vllm-key", b"y") == 0

        moon.drain(lambda x: sum(e[0] == "BlockStoreEvent" for e in mooncake_events(x)) >= 6)
        stored = {e[1]: e for e in mooncake_events(moon) if e[0] == "BlockStoreEvent"}
        for k in keys:
            e = stored[k]
            assert len(e) == 8
            _, key, replicas, model, block_size, block_hash, parent, tokens = e
            assert replicas == [["memory", seg]]
            assert model == MODEL and block_size == 0
            assert block_hash == "0x" + key_hash(k), "the block hash is the key's"
            assert parent == "" and tokens == []
        other = stored["not-a-vllm-key"]
        assert other[3:] == ["", 0, "", "", []], "no metadata for a key that is not vLLM's"

        # The vLLM stream: one topic per serving pod, each credited with every block.
        for pod in PODS:
            topic = f"kv@{pod}@{MODEL}"
            vll.drain(lambda x, t=topic: len(vllm_events(x, t)) >= len(keys))
            evs = vllm_events(vll, topic)
            assert all(isinstance(e, BlockStored) for e in evs)
            assert sorted(h for e in evs for h in e.block_hashes) == sorted(
                bytes.fromhex(key_hash(k)) for k in keys
            )
            assert {e.medium for e in evs} == {"lunakv_dram"}
            assert all(e.parent_block_hash is None and e.token_ids == [] for e in evs)

        # remove: the key's replicas become empty / the block is removed from DRAM.
        assert s.remove(keys[0], True) == 0
        moon.drain(lambda x: any(e[0] == "BlockUpdateEvent" for e in mooncake_events(x)))
        upd = [e for e in mooncake_events(moon) if e[0] == "BlockUpdateEvent"]
        assert upd == [["BlockUpdateEvent", keys[0], []]]
        topic = f"kv@{PODS[0]}@{MODEL}"
        vll.drain(lambda x: any(isinstance(e, BlockRemoved) for e in vllm_events(x, topic)))
        rm = [e for e in vllm_events(vll, topic) if isinstance(e, BlockRemoved)]
        assert rm == [BlockRemoved(block_hashes=[bytes.fromhex(key_hash(keys[0]))], medium="lunakv_dram")]

        # remove_all: RemoveAllEvent / AllBlocksCleared.
        assert s.remove_all(force=True) == 5
        moon.drain(lambda x: any(e[0] == "RemoveAllEvent" for e in mooncake_events(x)))
        assert mooncake_events(moon)[-1] == ["RemoveAllEvent"]
        for pod in PODS:
            t = f"kv@{pod}@{MODEL}"
            vll.drain(lambda x, t=t: any(isinstance(e, AllBlocksCleared) for e in vllm_events(x, t)))

        # Sequences are gap-free per stream and per topic.
        seqs = [q for _, q, _ in moon.msgs]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        for pod in PODS:
            t = f"kv@{pod}@{MODEL}".encode()
            seqs = [q for tp, q, _ in vll.msgs if tp == t]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        st = m.status()
        assert st["published"]["mooncake"] >= 8 and st["dropped"]["queue_full"] == 0
        s.close()
    finally:
        moon.close()
        vll.close()
        store.stop()


def test_replay_returns_exactly_the_missed_batches_then_the_end_marker(events_master, ctx):
    m = events_master
    store, _ = start_store(m.rpc, "64MB")
    try:
        s = connect(m.rpc)
        moon = Sub(ctx, m.events, b"", "mooncake", m)
        first = [vllm_key(i, prefix="r1") for i in range(3)]
        assert s.put_batch(first, [b"a"] * 3) == 0
        moon.drain(lambda x: len([e for e in mooncake_events(x) if e[0] == "BlockStoreEvent"]) >= 3)
        last_seen = moon.msgs[-1][1]
        moon.close()

        # Missed while away.
        missed = [vllm_key(i, prefix="r2") for i in range(4)]
        for k in missed:
            assert s.put(k, b"b") == 0
        time.sleep(0.5)

        # vLLM's subscriber shape: a DEALER sends ["", start]; answers are ["", seq, payload].
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(m.replay)
        dealer.send_multipart([b"", (last_seen + 1).to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            frames = dealer.recv_multipart()
            assert len(frames) == 3 and frames[0] == b""
            if frames[1] == END:
                assert frames[2] == END, "Mooncake's end marker is the payload"
                break
            got.append((int.from_bytes(frames[1], "big"), frames[2]))
        seqs = [q for q, _ in got]
        assert seqs == list(range(last_seen + 1, last_seen + 1 + len(got)))
        replayed = [e for _, p in got for e in msgpack.unpackb(p)[1]]
        assert [e[1] for e in replayed] == missed, "exactly the missed events, in order"
        assert all(e[0] == "BlockStoreEvent" for e in replayed)

        # Mooncake's guide shape: [client_id, "", start] -> [client_id, "", seq, payload].
        dealer.send_multipart([b"me", b"", (last_seen + 1).to_bytes(8, "big")])
        frames = dealer.recv_multipart()
        assert len(frames) == 4 and frames[0] == b"me" and frames[1] == b""
        assert int.from_bytes(frames[2], "big") == last_seen + 1
        while frames[3] != END:
            frames = dealer.recv_multipart()
        dealer.close(linger=0)
        assert m.status()["replay_requests"] == 2
        assert m.metric("master_kv_event_replay_requests_total") == 2
        s.close()
    finally:
        store.stop()


def test_a_pod_name_stands_for_the_addresses_it_resolves_to(ctx):
    """kv_events_vllm_pods=localhost:8000 (as a headless Service name would be): topics are
    named by the resolved address, which is what llm-d matches against its endpoints."""
    m = EventsMaster(pods=["localhost:8000"])
    store, _ = start_store(m.rpc, "32MB")
    try:
        vll = Sub(ctx, m.vllm, b"kv@", "vllm", m)
        s = connect(m.rpc)
        obj = np.full(4096, 3, dtype=np.uint8)
        key = vllm_key(0, prefix="name")
        assert s.put_from(key, obj.ctypes.data, obj.nbytes) == 0
        topic = f"kv@127.0.0.1:8000@{MODEL}"
        vll.drain(lambda x: any(isinstance(e, BlockStored) for e in vllm_events(x, topic)))
        stored = [e for e in vllm_events(vll, topic) if isinstance(e, BlockStored)]
        assert stored[0].block_hashes == [bytes.fromhex(key_hash(key))]
        assert not any(t.startswith(b"kv@localhost") for t, _, _ in vll.msgs), "names never become topics"
        vll.close()
        s.close()
    finally:
        store.stop()
        m.stop()


# 1 MiB blocks in an 8 MiB pool: each put evicts 12.5% of it, past the default share one
# put may evict (put_eviction_limit_ratio 0.1, which production pools of GiBs never approach).
SMALL_POOL = ["--put_eviction_limit_ratio=0.25"]


def test_eviction_removes_blocks(ctx):
    m = EventsMaster(SMALL_POOL)
    store, seg = start_store(m.rpc, "8MB")
    try:
        moon = Sub(ctx, m.events, b"mooncake", "mooncake", m)
        vll = Sub(ctx, m.vllm, b"kv@", "vllm", m)
        s = connect(m.rpc)
        obj = np.full(MB, 7, dtype=np.uint8)
        keys = [vllm_key(i, prefix="ev") for i in range(16)]
        for k in keys:
            assert s.put_from(k, obj.ctypes.data, MB) == 0
        moon.drain(lambda x: any(e[0] == "BlockUpdateEvent" and e[2] == [] for e in mooncake_events(x)))
        gone = {e[1] for e in mooncake_events(moon) if e[0] == "BlockUpdateEvent" and e[2] == []}
        assert gone and gone <= set(keys)
        for k in gone:
            assert s.is_exist(k) == 0, "an evicted key is reported gone"
        topic = f"kv@{PODS[1]}@{MODEL}"
        vll.drain(lambda x: any(isinstance(e, BlockRemoved) for e in vllm_events(x, topic)))
        removed = {h for e in vllm_events(vll, topic) if isinstance(e, BlockRemoved) for h in e.block_hashes}
        assert removed <= {bytes.fromhex(key_hash(k)) for k in gone}
        moon.close()
        vll.close()
        s.close()
    finally:
        store.stop()
        m.stop()


def test_offload_and_promotion_move_blocks_between_tiers(ctx, tmp_path, monkeypatch):
    m = EventsMaster(["--enable_offload=true", "--promotion_on_hit=true", *SMALL_POOL])
    # The store's disk tier directory (its only source, as upstream's).
    monkeypatch.setenv("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", str(tmp_path))
    store = Proc(
        "lunakv-store",
        [
            f"--master_server_address={m.rpc}",
            "--host=127.0.0.1",
            "--port=0",
            "--metrics_port=0",
            "--global_segment_size=8MB",
            "--enable_offload=true",
        ],
    )
    seg = store.wait_for("listening")["transfer"].strip('",')
    try:
        moon = Sub(ctx, m.events, b"mooncake", "mooncake", m)
        vll = Sub(ctx, m.vllm, b"kv@", "vllm", m)
        s = connect(m.rpc)
        obj = np.full(MB, 9, dtype=np.uint8)
        keys = [vllm_key(i, prefix="off") for i in range(16)]
        for k in keys:
            assert s.put_from(k, obj.ctypes.data, MB) == 0

        def on_disk(e):
            return e[0] == "BlockUpdateEvent" and e[2] == [["local_disk", seg]]

        moon.drain(lambda x: any(on_disk(e) for e in mooncake_events(x)))
        offloaded = [e[1] for e in mooncake_events(moon) if on_disk(e)]
        k = offloaded[0]
        topic = f"kv@{PODS[0]}@{MODEL}"
        h = bytes.fromhex(key_hash(k))
        vll.drain(lambda x: any(isinstance(e, BlockRemoved) and e.block_hashes == [h] for e in vllm_events(x, topic)))
        mine = [e for e in vllm_events(vll, topic) if e.block_hashes == [h]]
        assert [(type(e).__name__, e.medium) for e in mine] == [
            ("BlockStored", "lunakv_dram"),
            ("BlockStored", "lunakv_ssd"),
            ("BlockRemoved", "lunakv_dram"),
        ], "stored in DRAM, then on SSD before gone from DRAM"

        # A get of the disk-only key promotes it back into DRAM (it keeps its disk copy), given
        # room there: the newest keys are still in DRAM, so removing them makes it.
        for newer in keys[-4:]:
            assert s.remove(newer, True) == 0
        out = np.zeros(MB, dtype=np.uint8)
        assert s.get_into(k, out.ctypes.data, MB) == MB and (out == 9).all()

        def promoted(e):
            return e[0] == "BlockUpdateEvent" and e[1] == k and sorted(map(tuple, e[2])) == [
                ("local_disk", seg),
                ("memory", seg),
            ]

        moon.drain(lambda x: any(promoted(e) for e in mooncake_events(x)))
        vll.drain(lambda x: len([e for e in vllm_events(x, topic) if e.block_hashes == [h]]) >= 4)
        last = [e for e in vllm_events(vll, topic) if e.block_hashes == [h]][3]
        assert isinstance(last, BlockStored) and last.medium == "lunakv_dram"
        moon.close()
        vll.close()
        s.close()
    finally:
        store.stop()
        m.stop()


def test_a_subscriber_that_never_reads_does_not_stall_the_publisher(ctx):
    """With a subscriber that never reads (its high-water mark full at once), every put still
    succeeds and the publisher still sends every event: ZMQ drops for that subscriber instead
    of blocking. No timing is asserted here (the bench-events target measures the cost)."""
    m = EventsMaster(["--kv_event_publisher_hwm=16", "--kv_event_publisher_max_batch_size=1"])
    store, _ = start_store(m.rpc, "256MB")
    try:
        s = connect(m.rpc)
        stuck = ctx.socket(zmq.SUB)
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.setsockopt(zmq.SUBSCRIBE, b"")
        stuck.connect(m.events)
        deadline = time.monotonic() + 10
        while m.status()["subscribers"]["mooncake"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        before = m.status()["published"]["mooncake"]
        n = 1500
        for i in range(n):
            assert s.put(vllm_key(i, prefix="stuck"), b"v" * 64) == 0
        # A publisher blocked on the stuck subscriber would stop near its high-water mark.
        deadline = time.monotonic() + 20
        while True:
            st = m.status()
            if st["published"]["mooncake"] >= before + n:
                break
            assert time.monotonic() < deadline, (before, st)
            time.sleep(0.1)
        assert st["dropped"]["queue_full"] == 0, st
        stuck.close(linger=0)
        s.close()
    finally:
        store.stop()
        m.stop()


def test_a_full_queue_drops_and_counts(ctx):
    m = EventsMaster(["--kv_event_publisher_max_queue_size=1"])
    store, _ = start_store(m.rpc, "256MB")
    try:
        s = connect(m.rpc)
        keys = [vllm_key(i, prefix="q") for i in range(2000)]
        assert s.put_batch(keys, [b"z" * 64] * len(keys)) == 0
        deadline = time.monotonic() + 10
        while True:
            st = m.status()
            # Every event is either published or counted as dropped (+1: the start's reset).
            if st["published"]["mooncake"] + st["dropped"]["queue_full"] == len(keys) + 1:
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.1)
        assert st["dropped"]["queue_full"] > 0
        assert m.metric('master_kv_events_dropped_total{reason="queue_full"}') == st["dropped"]["queue_full"]
        s.close()
    finally:
        store.stop()
        m.stop()


def test_lunakv_status_and_events_commands(events_master):
    import subprocess

    from conftest import BIN_DIR

    m = events_master
    store, seg = start_store(m.rpc, "64MB")
    try:
        lunakv = str(BIN_DIR / "lunakv")
        st = subprocess.run([lunakv, "--master", m.rpc, "status"], capture_output=True, text=True, timeout=20)
        assert st.returncode == 0, st.stderr
        assert f"kv events on  {m.events}" in st.stdout and f"replay {m.replay}" in st.stdout, st.stdout
        sub = subprocess.Popen(
            [lunakv, "--master", m.rpc, "--json", "events", "--count", "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 10
            while m.status()["subscribers"]["mooncake"] < 1:
                assert time.monotonic() < deadline, "lunakv events never subscribed"
                time.sleep(0.05)
            time.sleep(0.3)
            s = connect(m.rpc)
            keys = [vllm_key(i, prefix="cli") for i in range(2)]
            assert s.put_batch(keys, [b"c"] * 2) == 0
            out, err = sub.communicate(timeout=15)
        finally:
            if sub.poll() is None:
                sub.kill()
        assert sub.returncode == 0, err
        lines = [json.loads(x) for x in out.splitlines()]
        assert [x["event"][1] for x in lines] == keys
        assert all(x["topic"] == "mooncake" and x["event"][0] == "BlockStoreEvent" for x in lines)
        assert lines[0]["event"][5] == "0x" + key_hash(keys[0])
        s.close()
    finally:
        store.stop()
