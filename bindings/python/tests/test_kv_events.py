"""Pool KV events (issue 13, docs/EVENTS.md): subscribers written as today's consumers define
them (vLLM's msgspec structs from vllm/distributed/kv_events.py, and a decoder of upstream
Mooncake main's RFC #1527 master events written from its docs), against a real lunakv-master
with `--enable_kv_event_publish` and a real lunakv-store, written to through the `mooncake`
module with vLLM-format keys. The older forms (positional vLLM events, Mooncake's arrays) are
checked behind their settings.
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
BACKEND = "lunakv-test"


# === vLLM's event classes as vllm/distributed/kv_events.py declares them today ===
# The batch is array-like; each event is a tagged struct WITHOUT array_like, so it travels as a
# map whose "type" names the class. Fields without a default must be on the wire; the rest
# default to None and are left out when unset (omit_defaults).

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's event base: tag field "type", value the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


VLLM_DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
# msgspec skips map keys a struct does not declare; the stream must send none.
VLLM_FIELDS = {c.__name__: set(c.__struct_fields__) | {"type"} for c in (BlockStored, BlockRemoved, AllBlocksCleared)}


# === the older positional form (kv_events_vllm_format=array): events array-like too ===

class OldKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM's event base before its events became maps."""


class OldBlockStored(OldKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class OldBlockRemoved(OldKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class OldAllBlocksCleared(OldKVCacheEvent, tag="AllBlocksCleared"):
    pass


class OldKVEventBatch(EventBatch):
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]


OLD_VLLM_DECODER = msgspec.msgpack.Decoder(type=OldKVEventBatch)


def vllm_int_hash(key: str) -> int:
    """vLLM's default event hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) of a key's block:
    int.from_bytes(hash, "big") masked to 64 bits."""
    return int.from_bytes(bytes.fromhex(key_hash(key)), "big") & (2**64 - 1)


# === upstream Mooncake main's master events (RFC #1527), decoded from its docs ===
# conductor-indexer.md ("KV Events API", "Mooncake Store master publisher", field provenance
# matrix) and mooncake-store-deployment-guide.md ("KV Cache Event Publisher"): frames [topic,
# 8-byte big-endian sequence, msgpack [timestamp, [events], dp_rank]]; each event a map.

RFC_ENVELOPE = {
    "event_id", "timestamp", "event_type", "model_name", "block_size", "additional_salt",
    "lora_name", "tenant_id", "backend_id", "medium", "dp_rank",
}
LEGACY_TYPE = {"stored": "BlockStored", "removed": "BlockRemoved", "cleared": "AllBlocksCleared"}


def rfc_seq_hash(key: str) -> list[int]:
    """seq_hashes of a master event: the whole key as a decimal or 0x-hex u64, else none."""
    digits, base, allowed = (key[2:], 16, "0123456789abcdefABCDEF") if key[:2] in ("0x", "0X") else (key, 10, "0123456789")
    if not digits or any(c not in allowed for c in digits):
        return []
    v = int(digits, base)
    return [v] if v < 2**64 else []


def check_rfc_event(e: dict, backend_id: str = BACKEND) -> None:
    assert isinstance(e, dict), e
    assert RFC_ENVELOPE <= e.keys(), e
    assert isinstance(e["event_id"], int) and e["event_id"] >= 0
    assert e["timestamp"] is None or isinstance(e["timestamp"], int)
    assert e["event_type"] in LEGACY_TYPE, e
    assert e["type"] == LEGACY_TYPE[e["event_type"]], "legacy alias agrees"
    assert e["tenant_id"] == "default" and e["backend_id"] == backend_id
    if e["event_type"] == "cleared":
        return
    assert e["medium"] in ("cpu", "disk"), "the master's media"
    assert isinstance(e["object_key"], str) and e["object_key"]
    assert e["seq_hashes"] == rfc_seq_hash(e["object_key"]), e
    assert [h & (2**64 - 1) for h in e["block_hashes"]] == e["seq_hashes"], "legacy alias"
    if e["event_type"] == "stored":
        assert e["base_block_idx"] == 0 or e.get("parent_hash") is not None, "RFC: one of them"


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
                f"--kv_events_backend_id={BACKEND}",
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


def rfc_batch(payload: bytes, backend_id: str = BACKEND) -> list[dict]:
    ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
    assert isinstance(ts, int) and ts > 1.6e12, "milliseconds since the epoch"
    assert dp_rank == 0
    for e in events:
        check_rfc_event(e, backend_id)
    return events


def mooncake_events(sub: Sub) -> list[dict]:
    """Every event of the Mooncake stream (RFC #1527, the default), each checked."""
    return [e for _, _, payload in sub.msgs for e in rfc_batch(payload)]


def mooncake_array_events(sub: Sub) -> list[list]:
    """Every event of the Mooncake stream in its older array form."""
    out = []
    for _, _, payload in sub.msgs:
        ts, events = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and ts > 1.6e9
        out.extend(events)
    return out


def vllm_events(sub: Sub, topic: str, decoder=VLLM_DECODER) -> list:
    out = []
    for t, _, payload in sub.msgs:
        if t.decode() == topic:
            batch = decoder.decode(payload)
            assert batch.data_parallel_rank == 0
            if decoder is VLLM_DECODER:
                for raw in msgpack.unpackb(payload, raw=False)[1]:
                    assert isinstance(raw, dict), "today's vLLM events are maps"
                    assert raw.keys() <= VLLM_FIELDS[raw["type"]], raw
            out.extend(batch.events)
    return out


def key_hash(key: str) -> str:
    return key.rsplit("@", 1)[1]


def of(events: list[dict], event_type: str, medium: str | None = None) -> list[dict]:
    return [e for e in events if e["event_type"] == event_type and medium in (None, e["medium"])]


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
        assert s.put("0x2a", b"z") == 0

        # Mooncake's stream: one `stored` per object in the pool's DRAM ("cpu").
        moon.drain(lambda x: len(of(mooncake_events(x), "stored")) >= 7)
        stored = {e["object_key"]: e for e in of(mooncake_events(moon), "stored")}
        for k in [*keys, "not-a-vllm-key"]:
            e = stored[k]
            assert e["medium"] == "cpu" and e["seq_hashes"] == [] and e["base_block_idx"] == 0
            assert e["model_name"] is None and e["token_ids"] is None
        assert stored["0x2a"]["seq_hashes"] == [42], "a key that is a hash names its block"

        # The vLLM stream: one topic per serving pod, each credited with every block, in the
        # form vLLM's own classes decode.
        for pod in PODS:
            topic = f"kv@{pod}@{MODEL}"
            vll.drain(lambda x, t=topic: len(vllm_events(x, t)) >= len(keys))
            evs = vllm_events(vll, topic)
            assert all(isinstance(e, BlockStored) for e in evs)
            assert sorted(h for e in evs for h in e.block_hashes) == sorted(vllm_int_hash(k) for k in keys)
            assert all(type(h) is int for e in evs for h in e.block_hashes), "vLLM's default: ints"
            assert {(e.medium, e.locality, e.ownership) for e in evs} == {("CPU", "REMOTE", "lunakv")}
            assert all(e.parent_block_hash is None and e.token_ids == [] for e in evs)
        payload = next(p for t, _, p in vll.msgs)
        with pytest.raises(msgspec.ValidationError):
            OLD_VLLM_DECODER.decode(payload)  # the positional decoder cannot read maps

        # remove: the object leaves "cpu" / the block is removed from CPU.
        assert s.remove(keys[0], True) == 0
        moon.drain(lambda x: of(mooncake_events(x), "removed"))
        rm = of(mooncake_events(moon), "removed")
        assert [(e["object_key"], e["medium"]) for e in rm] == [(keys[0], "cpu")]
        topic = f"kv@{PODS[0]}@{MODEL}"
        vll.drain(lambda x: any(isinstance(e, BlockRemoved) for e in vllm_events(x, topic)))
        rm = [e for e in vllm_events(vll, topic) if isinstance(e, BlockRemoved)]
        assert rm == [BlockRemoved(block_hashes=[vllm_int_hash(keys[0])], medium="CPU", locality="REMOTE", ownership="lunakv")]

        # remove_all: cleared / AllBlocksCleared.
        assert s.remove_all(force=True) == 6
        moon.drain(lambda x: of(mooncake_events(x), "cleared"))
        assert mooncake_events(moon)[-1]["event_type"] == "cleared"
        for pod in PODS:
            t = f"kv@{pod}@{MODEL}"
            vll.drain(lambda x, t=t: any(isinstance(e, AllBlocksCleared) for e in vllm_events(x, t)))

        # Sequences are gap-free per stream and per topic; event ids go up by one.
        seqs = [q for _, q, _ in moon.msgs]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        ids = [e["event_id"] for e in mooncake_events(moon)]
        assert ids == list(range(ids[0], ids[0] + len(ids)))
        for pod in PODS:
            t = f"kv@{pod}@{MODEL}".encode()
            seqs = [q for tp, q, _ in vll.msgs if tp == t]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        st = m.status()
        assert st["published"]["mooncake"] >= 9 and st["dropped"]["queue_full"] == 0
        s.close()
    finally:
        moon.close()
        vll.close()
        store.stop()


def test_the_older_forms_stay_behind_their_settings(ctx):
    """kv_events_mooncake_format=array and kv_events_vllm_format=array with bytes hashes and
    lunakv's own media: the forms older consumers read, unchanged."""
    m = EventsMaster(
        [
            "--kv_events_mooncake_format=array",
            "--kv_events_vllm_format=array",
            "--kv_events_vllm_int_hashes=false",
            "--kv_events_vllm_medium_dram=lunakv_dram",
            "--kv_events_vllm_medium_ssd=lunakv_ssd",
        ]
    )
    store, seg = start_store(m.rpc, "64MB")
    try:
        moon = Sub(ctx, m.events, b"mooncake", "mooncake", m)
        vll = Sub(ctx, m.vllm, b"kv@", "vllm", m)
        s = connect(m.rpc)
        keys = [vllm_key(i, prefix="old") for i in range(1, 4)]
        assert s.put_batch(keys, [b"x" * 4096] * len(keys)) == 0
        assert s.put("not-a-vllm-key", b"y") == 0
        moon.drain(lambda x: sum(e[0] == "BlockStoreEvent" for e in mooncake_array_events(x)) >= 4)
        stored = {e[1]: e for e in mooncake_array_events(moon) if e[0] == "BlockStoreEvent"}
        for k in keys:
            _, key, replicas, model, block_size, block_hash, parent, tokens = stored[k]
            assert replicas == [["memory", seg]]
            assert model == MODEL and block_size == 0
            assert block_hash == "0x" + key_hash(k), "the block hash is the key's"
            assert parent == "" and tokens == []
        assert stored["not-a-vllm-key"][3:] == ["", 0, "", "", []]

        topic = f"kv@{PODS[0]}@{MODEL}"
        vll.drain(lambda x: len(vllm_events(x, topic, OLD_VLLM_DECODER)) >= len(keys))
        evs = vllm_events(vll, topic, OLD_VLLM_DECODER)
        assert sorted(h for e in evs for h in e.block_hashes) == sorted(bytes.fromhex(key_hash(k)) for k in keys)
        assert {e.medium for e in evs} == {"lunakv_dram"}
        payload = next(p for t, _, p in vll.msgs)
        with pytest.raises(msgspec.ValidationError, match="Expected `object`, got `array`"):
            VLLM_DECODER.decode(payload)  # what today's vLLM says of the positional form

        assert s.remove(keys[0], True) == 0
        moon.drain(lambda x: any(e[0] == "BlockUpdateEvent" for e in mooncake_array_events(x)))
        assert [e for e in mooncake_array_events(moon) if e[0] == "BlockUpdateEvent"] == [
            ["BlockUpdateEvent", keys[0], []]
        ]
        vll.drain(lambda x: any(isinstance(e, OldBlockRemoved) for e in vllm_events(x, topic, OLD_VLLM_DECODER)))
        assert s.remove_all(force=True) == 3
        moon.drain(lambda x: any(e[0] == "RemoveAllEvent" for e in mooncake_array_events(x)))
        moon.close()
        vll.close()
        s.close()
    finally:
        store.stop()
        m.stop()


def test_the_served_model_name_names_the_topics(ctx):
    """kv_events_vllm_served_model_name: the engine's --served-model-name (Qwen/Qwen3-8B), not
    the key's last path component, is the topic's model."""
    m = EventsMaster(["--kv_events_vllm_served_model_name=Qwen3-8B=Qwen/Qwen3-8B"])
    store, _ = start_store(m.rpc, "32MB")
    try:
        vll = Sub(ctx, m.vllm, b"kv@", "vllm", m)
        s = connect(m.rpc)
        key = vllm_key(3, prefix="served")
        assert s.put(key, b"v" * 64) == 0
        topic = f"kv@{PODS[0]}@Qwen/Qwen3-8B"
        vll.drain(lambda x: any(isinstance(e, BlockStored) for e in vllm_events(x, topic)))
        assert vllm_events(vll, topic)[0].block_hashes == [3]
        assert not any(t.endswith(b"@" + MODEL.encode()) for t, _, _ in vll.msgs)
        vll.close()
        s.close()
    finally:
        store.stop()
        m.stop()


def test_replay_returns_exactly_the_missed_batches_then_the_end_marker(events_master, ctx):
    m = events_master
    store, _ = start_store(m.rpc, "64MB")
    try:
        s = connect(m.rpc)
        moon = Sub(ctx, m.events, b"", "mooncake", m)
        first = [vllm_key(i, prefix="r1") for i in range(3)]
        assert s.put_batch(first, [b"a"] * 3) == 0
        moon.drain(lambda x: len(of(mooncake_events(x), "stored")) >= 3)
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
        replayed = [e for _, p in got for e in rfc_batch(p)]
        assert [e["object_key"] for e in replayed] == missed, "exactly the missed events, in order"
        assert all(e["event_type"] == "stored" for e in replayed)

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
        assert stored[0].block_hashes == [vllm_int_hash(key)]
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
        moon.drain(lambda x: of(mooncake_events(x), "removed", "cpu"))
        gone = {e["object_key"] for e in of(mooncake_events(moon), "removed", "cpu")}
        assert gone and gone <= set(keys)
        for k in gone:
            assert s.is_exist(k) == 0, "an evicted key is reported gone"
        topic = f"kv@{PODS[1]}@{MODEL}"
        vll.drain(lambda x: any(isinstance(e, BlockRemoved) for e in vllm_events(x, topic)))
        removed = {h for e in vllm_events(vll, topic) if isinstance(e, BlockRemoved) for h in e.block_hashes}
        assert removed <= {vllm_int_hash(k) for k in gone}
        moon.close()
        vll.close()
        s.close()
    finally:
        store.stop()
        m.stop()


def test_offload_and_promotion_move_blocks_between_tiers(ctx, tmp_path, monkeypatch):
    # Promoted on its first get (upstream's default admission waits for a second request).
    m = EventsMaster(
        ["--enable_offload=true", "--promotion_on_hit=true", "--promotion_admission_threshold=1", *SMALL_POOL]
    )
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
    store.wait_for("listening")
    try:
        moon = Sub(ctx, m.events, b"mooncake", "mooncake", m)
        vll = Sub(ctx, m.vllm, b"kv@", "vllm", m)
        s = connect(m.rpc)
        obj = np.full(MB, 9, dtype=np.uint8)
        keys = [vllm_key(i, prefix="off") for i in range(16)]
        for k in keys:
            assert s.put_from(k, obj.ctypes.data, MB) == 0

        def history(x: Sub, key: str) -> list[tuple[str, str]]:
            return [(e["event_type"], e["medium"]) for e in mooncake_events(x) if e.get("object_key") == key]

        moon.drain(lambda x: of(mooncake_events(x), "stored", "disk"))
        k = of(mooncake_events(moon), "stored", "disk")[0]["object_key"]
        moon.drain(lambda x: ("removed", "cpu") in history(x, k))
        assert history(moon, k)[:3] == [("stored", "cpu"), ("stored", "disk"), ("removed", "cpu")], (
            "in DRAM, then on disk before gone from DRAM"
        )
        topic = f"kv@{PODS[0]}@{MODEL}"
        h = vllm_int_hash(k)
        vll.drain(lambda x: any(isinstance(e, BlockRemoved) and e.block_hashes == [h] for e in vllm_events(x, topic)))
        mine = [e for e in vllm_events(vll, topic) if e.block_hashes == [h]]
        assert [(type(e).__name__, e.medium) for e in mine] == [
            ("BlockStored", "CPU"),
            ("BlockStored", "STORAGE"),
            ("BlockRemoved", "CPU"),
        ], "stored in DRAM, then on SSD before gone from DRAM"

        # A get of the disk-only key promotes it back into DRAM (it keeps its disk copy), given
        # room there: the newest keys are still in DRAM, so removing them makes it.
        for newer in keys[-4:]:
            assert s.remove(newer, True) == 0
        out = np.zeros(MB, dtype=np.uint8)
        assert s.get_into(k, out.ctypes.data, MB) == MB and (out == 9).all()

        moon.drain(lambda x: history(x, k)[3:4] == [("stored", "cpu")])
        vll.drain(lambda x: len([e for e in vllm_events(x, topic) if e.block_hashes == [h]]) >= 4)
        last = [e for e in vllm_events(vll, topic) if e.block_hashes == [h]][3]
        assert isinstance(last, BlockStored) and last.medium == "CPU"
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
        assert [x["event"]["object_key"] for x in lines] == keys
        assert all(x["topic"] == "mooncake" and x["event"]["event_type"] == "stored" for x in lines)
        assert 1.6e9 < lines[0]["ts"] < 1e11, "seconds, from the batch's milliseconds"
        s.close()
    finally:
        store.stop()
