#!/usr/bin/env python3
"""Many nodes on one machine: K store hosts and J requester hosts, each in its own network
namespace, joined by veth pairs to one bridge. Every byte crosses a real TCP connection between
two "hosts"; no shm shortcut (each host has its own LUNAKV_NODE_NAME, so no two share a host id).

    make bench-cluster                      # release wheel + binaries, then this
    python bench_cluster.py [--stores 1,2,4] [--requesters 2] [--pairs 3] [--total-mib 128] [--json]

Topology (all namespaces are this run's own; the host's network and firewall are not touched):

    <id>-sw   the switch: a bridge, and one veth end per host
    <id>-m    lunakv-master, --allocation_strategy (default free_ratio_first)
    <id>-sN   lunakv-store N, a segment sized for its share of the data
    <id>-rN   a requester: `mooncake.store` with global_segment_size 0, as vLLM's standalone mode

For each K in --stores, a fresh master and K stores. Each requester puts --total-mib / J of
objects (--object-kib each) twice, once with replica_num 1 and once with replica_num 2. Then, in
--pairs paired trials, two things alternate:
  limit  raw TCP over the same veths: each requester streams to a store host (a Python socket
         loop, sendall/recv_into of 4 MiB; the machine's ceiling for moving bytes between two
         namespaces here);
  row    every requester gets all its objects (batch_get_into, 8 per call) and compares every
         byte with what it put.
The row's figure is aggregate get GB/s (all requesters' bytes over the slowest one's time); the
ratio to the limit is taken per pair and the median reported with its min-max, as the other
benches do. Balance is the objects per store, max/min, from the master's /get_all_segments.
Last, with K >= 2, one store is killed (SIGKILL) and every requester gets every object once:
with replica_num 2 every get must still succeed; with replica_num 1 about 1/K of them cannot.

--restart runs a different scenario instead (issue 32's placement ramp): 3 stores of
--restart-seg-mib, filled past full by two requesters; once the stores have run longer than the
ramp, one is killed and restarted empty on its own port (its segment mounts again under the
same name); then one requester puts a pool's worth of new objects paced over --restart-seconds
while the other reads what it put. Printed: the newcomer's objects against the puts made after
1, 2 and 5 seconds and in all, put and get latency p50/p99 per batch of 8, gets ok/missed/wrong.
The master's --placement_ramp_ms is 0 and --ramp-ms (30000, the default) in alternating pairs.

On 2 cores the aggregate cannot grow with K: every host shares the same two cores. What the run
shows is the per-store share, the balance and the survival of replicated objects; docs/BENCH.md
says what it cannot show. Needs root (network namespaces) and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_store import Proc  # noqa: E402

REPO = HERE.parents[2]
MB = 1 << 20
MASTER_PORT = 50051
SINK_PORT = 7000
GET_BATCH = 8


# === the network ===

def sh(*args: str) -> None:
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip() or r.returncode}")


class Net:
    """This run's namespaces: a switch with a bridge, and hosts joined to it by veth pairs."""

    def __init__(self) -> None:
        n = os.getpid() % 100000
        self.id = f"lkv{n}"
        # One /24 per run, away from Docker's 172.16/12 and the usual 10.0/16 and 10.96/12.
        self.prefix = f"10.{213 + n % 40}.{n % 250}"
        self.hosts: dict[str, str] = {}
        self.sw = f"{self.id}-sw"
        sh("ip", "netns", "add", self.sw)
        self.exec(self.sw, "ip", "link", "add", "br0", "type", "bridge")
        self.exec(self.sw, "ip", "link", "set", "br0", "up")

    def exec(self, ns: str, *args: str) -> None:
        sh("ip", "netns", "exec", ns, *args)

    def add_host(self, name: str, last_octet: int) -> str:
        """A namespace joined to the bridge; returns its address."""
        ns = f"{self.id}-{name}"
        ip = f"{self.prefix}.{last_octet}"
        port = self.port(name)
        sh("ip", "netns", "add", ns)
        self.hosts[name] = ip
        sh("ip", "link", "add", port, "netns", self.sw, "type", "veth", "peer", "name", "eth0",
           "netns", ns)
        self.exec(self.sw, "ip", "link", "set", port, "master", "br0")
        self.exec(self.sw, "ip", "link", "set", port, "up")
        self.exec(ns, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
        self.exec(ns, "ip", "link", "set", "eth0", "up")
        self.exec(ns, "ip", "link", "set", "lo", "up")
        return ip

    def ns(self, name: str) -> str:
        return f"{self.id}-{name}"

    def port(self, name: str) -> str:
        """The switch's end of host `name`'s veth pair (interface names are at most 15 bytes)."""
        return f"{self.id}{name}"[:15]

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None,
              stdin: bool = False) -> Proc:
        """`args` on host `name`, its own node as far as lunakv can tell."""
        e = dict(env or os.environ, LUNAKV_NODE_NAME=name)
        return Proc(["ip", "netns", "exec", self.ns(name), *args], env=e, stdin=stdin)

    def remove_host(self, name: str) -> None:
        # The switch's end first: a deleted namespace takes its veth pair down asynchronously,
        # and the next cluster reuses the port's name.
        subprocess.run(["ip", "-n", self.sw, "link", "del", self.port(name)], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns(name)], capture_output=True)
        self.hosts.pop(name, None)

    def close(self) -> None:
        for name in list(self.hosts):
            self.remove_host(name)
        subprocess.run(["ip", "netns", "del", self.sw], capture_output=True)


def preflight() -> str | None:
    """Why this machine cannot run the bench, or None."""
    if os.geteuid() != 0:
        return "bench-cluster needs root: it creates network namespaces (run it as root, or skip it)"
    if not shutil.which("ip"):
        return "bench-cluster needs iproute2's `ip` (apt-get install iproute2)"
    probe = f"lkvprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


# === requester and sink (run inside a host's namespace) ===

def requester(args) -> int:
    """Answers one JSON command per stdin line with one `RESULT {...}` line."""
    import numpy as np
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    s = MooncakeDistributedStore()
    rc = s.setup(args.host, "P2PHANDSHAKE", 0, 64 * MB, "tcp", "", args.master)
    if rc != 0:
        print(f"RESULT {json.dumps({'error': f'setup: {rc}'})}", flush=True)
        return 1
    size = args.object_kib * 1024
    n = max(GET_BATCH, args.objects // GET_BATCH * GET_BATCH)
    src = np.random.default_rng(args.seed).integers(0, 256, (n, size), dtype=np.uint8)
    dst = np.zeros_like(src)
    dst.fill(1)
    for buf in (src, dst):
        if s.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
            raise RuntimeError("register_buffer failed")
    keys = {r: [f"cluster@{args.name}@r{r}@{i:064x}" for i in range(n)] for r in (1, 2)}
    print("RESULT " + json.dumps({"ready": True, "objects": n}), flush=True)

    def ptrs(buf, rows: range) -> list[int]:
        return [buf.ctypes.data + i * size for i in rows]

    def tagged(tag: str, i: int) -> str:
        return f"cluster@{args.name}@{tag}@{i:064x}"

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        t0 = time.perf_counter()
        if op == "put":
            cfg = ReplicateConfig()
            cfg.replica_num = cmd["replicas"]
            bad = 0
            for first in range(0, n, GET_BATCH):
                rows = range(first, first + GET_BATCH)
                r = s.batch_put_from(keys[cmd["replicas"]][first:first + GET_BATCH],
                                     ptrs(src, rows), [size] * GET_BATCH, cfg)
                bad += sum(1 for x in r if x != 0)
            out = {"seconds": time.perf_counter() - t0, "failed": bad}
        elif op == "get":
            # Every object once per round; `survive` counts instead of stopping at a failure.
            ok = failed = wrong = 0
            for _ in range(cmd.get("rounds", 1)):
                if cmd.get("survive"):
                    dst.fill(1)  # so a get that wrote nothing cannot pass the comparison
                for first in range(0, n, GET_BATCH):
                    rows = range(first, first + GET_BATCH)
                    r = s.batch_get_into(keys[cmd["replicas"]][first:first + GET_BATCH],
                                         ptrs(dst, rows), [size] * GET_BATCH)
                    for i, got in zip(rows, r):
                        if got != size:
                            failed += 1
                        elif not np.array_equal(src[i], dst[i]):
                            wrong += 1
                        else:
                            ok += 1
            out = {"seconds": time.perf_counter() - t0, "ok": ok, "failed": failed,
                   "wrong": wrong, "bytes": ok * size}
        elif op == "fill":
            # `count` objects under `tag` (rows reused modulo n), replica_num 1, each batch timed.
            cfg = ReplicateConfig()
            cfg.replica_num = 1
            lat, bad = [], 0
            # Paced over `seconds` when given, as engines save blocks while they serve.
            per_batch = cmd.get("seconds", 0) * GET_BATCH / max(1, cmd["count"])
            for first in range(0, cmd["count"], GET_BATCH):
                ids = range(first, min(first + GET_BATCH, cmd["count"]))
                due = t0 + per_batch * (first // GET_BATCH)
                if due > time.perf_counter():
                    time.sleep(due - time.perf_counter())
                t1 = time.perf_counter()
                r = s.batch_put_from([tagged(cmd["tag"], i) for i in ids],
                                     [src.ctypes.data + (i % n) * size for i in ids],
                                     [size] * len(ids), cfg)
                lat.append(time.perf_counter() - t1)
                bad += sum(1 for x in r if x != 0)
            out = {"seconds": time.perf_counter() - t0, "failed": bad, "latencies": lat}
        elif op == "getlat":
            # Every object of `tag` once per round, each batch timed; a miss (evicted, or on the
            # restarted store) is counted, a wrong byte is an error.
            lat, ok, missed, wrong = [], 0, 0, 0
            rounds = cmd.get("rounds", 1)
            until = t0 + cmd.get("seconds", 0)
            r_done = 0
            while r_done < rounds or time.perf_counter() < until:
                r_done += 1
                for first in range(0, cmd["count"], GET_BATCH):
                    ids = list(range(first, min(first + GET_BATCH, cmd["count"])))
                    dst[:len(ids)].fill(1)
                    t1 = time.perf_counter()
                    r = s.batch_get_into([tagged(cmd["tag"], i) for i in ids],
                                         ptrs(dst, range(len(ids))), [size] * len(ids))
                    lat.append(time.perf_counter() - t1)
                    for j, (i, got) in enumerate(zip(ids, r)):
                        if got != size:
                            missed += 1
                        elif not np.array_equal(src[i % n], dst[j]):
                            wrong += 1
                        else:
                            ok += 1
            out = {"seconds": time.perf_counter() - t0, "latencies": lat, "ok": ok,
                   "missed": missed, "wrong": wrong}
        elif op == "limit":
            total = cmd["mib"] * MB
            chunk = bytes(4 * MB)
            with socket.create_connection((cmd["addr"], SINK_PORT)) as c:
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                c.sendall(total.to_bytes(8, "little"))
                t0 = time.perf_counter()
                sent = 0
                while sent < total:
                    c.sendall(chunk)
                    sent += len(chunk)
                if c.recv(1) != b"k":
                    raise RuntimeError("sink did not acknowledge")
            out = {"seconds": time.perf_counter() - t0, "bytes": total}
        elif op == "quit":
            break
        else:
            out = {"error": f"unknown op {op}"}
        print("RESULT " + json.dumps(out), flush=True)
    s.close()
    return 0


def sink(args) -> int:
    """Reads whatever requesters stream and acknowledges each whole stream (the TCP limit)."""
    import threading

    srv = socket.create_server((args.host, SINK_PORT), backlog=64)
    print("sink listening", flush=True)

    def serve(c: socket.socket) -> None:
        with c:
            head = c.recv(8, socket.MSG_WAITALL)
            left = int.from_bytes(head, "little")
            buf = bytearray(4 * MB)
            view = memoryview(buf)
            while left > 0:
                got = c.recv_into(view, min(left, len(buf)))
                if got == 0:
                    return
                left -= got
            c.sendall(b"k")

    while True:
        c, _ = srv.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()


# === the driver ===

class Requester:
    """A requester host's process, driven one command at a time."""

    def __init__(self, net: Net, name: str, args, master: str, seed: int):
        self.name = name
        cmd = [args.lunakv_python, str(Path(__file__).resolve()), "--requester", "--name", name,
               "--host", net.hosts[name], "--master", master, "--object-kib", str(args.object_kib),
               "--objects", str(args.objects), "--seed", str(seed)]
        # numpy's BLAS threads would spin on the shared cores; nothing here uses BLAS.
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        env.setdefault("LUNAKV_LOG", "error")
        self.p = net.spawn(name, cmd, env=env, stdin=True)
        self.ready = self.result(timeout=120)

    def send(self, **cmd) -> None:
        self.p.send(json.dumps(cmd))

    def result(self, timeout: float = 600) -> dict:
        line = self.p.wait_for("RESULT ", timeout=timeout)
        out = json.loads(line.split("RESULT ", 1)[1])
        if "error" in out:
            raise RuntimeError(f"requester {self.name}: {out['error']}")
        return out

    def stop(self) -> None:
        try:
            self.send(op="quit")
        except (OSError, ValueError):
            pass
        self.p.stop()


def all_do(reqs: list[Requester], **cmd) -> list[dict]:
    """The same command on every requester at once; their answers."""
    for r in reqs:
        r.send(**cmd)
    return [r.result() for r in reqs]


def ns_get_json(net: Net, host: str, url: str) -> object:
    """GET `url` from inside host's namespace (the master's admin port is only reachable there)."""
    code = "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
    r = subprocess.run(["ip", "netns", "exec", net.ns(host), sys.executable, "-c", code, url],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"GET {url}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def median_spread(v: list[float]) -> dict:
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "pairs": v}


def run_k(net: Net, k: int, args, tmp: str) -> dict:
    """One cluster of k stores: puts, paired limit/row trials, balance, then one store killed."""
    procs: list[Proc] = []
    reqs: list[Requester] = []
    names = [f"s{i}" for i in range(k)] + [f"r{j}" for j in range(args.requesters)]
    try:
        net.add_host("m", 1)
        for i in range(k):
            net.add_host(f"s{i}", 10 + i)
        for j in range(args.requesters):
            net.add_host(f"r{j}", 100 + j)
        master = f"{net.hosts['m']}:{MASTER_PORT}"
        m = net.spawn("m", [str(Path(args.bin_dir) / "lunakv-master"),
                            f"--rpc_address={net.hosts['m']}", f"--rpc_port={MASTER_PORT}",
                            "--metrics_port=9003", f"--data_dir={tmp}/m{k}",
                            f"--allocation_strategy={args.strategy}"])
        procs.append(m)
        m.wait_for("listening")
        # Every object stored once with replica_num 1 and twice with 2, spread over k stores,
        # with room to spare for the allocator.
        data = args.requesters * args.objects * args.object_kib * 1024
        seg_mib = max(64, int(data * 3 / k * 1.5) // MB + 16)
        stores = []
        for i in range(k):
            s = net.spawn(f"s{i}", [str(Path(args.bin_dir) / "lunakv-store"),
                                    f"--master_server_address={master}", f"--host={net.hosts[f's{i}']}",
                                    "--port=0", "--metrics_port=0", f"--global_segment_size={seg_mib}MB"])
            procs.append(s)
            stores.append(s)
        for s in stores:
            s.wait_for("listening")
        sinks = []
        for i in range(k):
            sk = net.spawn(f"s{i}", [sys.executable, str(Path(__file__).resolve()), "--sink",
                                     "--host", net.hosts[f"s{i}"]])
            procs.append(sk)
            sinks.append(sk)
        for sk in sinks:
            sk.wait_for("sink listening")
        for j in range(args.requesters):
            reqs.append(Requester(net, f"r{j}", args, master, seed=j))
        row: dict = {"stores": k, "requesters": args.requesters, "strategy": args.strategy,
                     "object_bytes": args.object_kib * 1024, "segment_mib": seg_mib}
        for rep in (1, 2):
            res = all_do(reqs, op="put", replicas=rep)
            failed = sum(r["failed"] for r in res)
            if failed:
                raise RuntimeError(f"{failed} puts with replica_num {rep} failed")
        segs = ns_get_json(net, "m", f"http://{net.hosts['m']}:9003/get_all_segments")
        objs = [s["objects"] for s in segs]
        row["objects_per_store"] = objs
        row["balance_max_min"] = max(objs) / max(1, min(objs))
        for rep in (1, 2):
            gbps, limit, ratio = [], [], []
            for p in range(args.pairs):
                lim = all_do(reqs, op="limit", mib=args.limit_mib,
                             addr=net.hosts[f"s{(p + 1) % k}"])
                lim_gbps = sum(r["bytes"] for r in lim) / max(r["seconds"] for r in lim) / 1e9
                got = all_do(reqs, op="get", replicas=rep, rounds=args.rounds)
                bad = [r for r in got if r["failed"] or r["wrong"]]
                if bad:
                    raise RuntimeError(f"gets with every store up failed: {bad}")
                g = sum(r["bytes"] for r in got) / max(r["seconds"] for r in got) / 1e9
                gbps.append(g)
                limit.append(lim_gbps)
                ratio.append(g / lim_gbps)
                progress(f"K={k} replica_num={rep} pair {p + 1}/{args.pairs}: get {g:.2f} GB/s, "
                         f"veth tcp {lim_gbps:.2f} GB/s")
            row[f"r{rep}"] = {"get_gbps": median_spread(gbps), "tcp_limit_gbps": median_spread(limit),
                              "ratio": median_spread(ratio),
                              # Every object is read equally often: a store serves its share of
                              # the objects' copies (one copy of each is read).
                              "per_store_gbps": statistics.median(gbps) / k}
        row["load"] = os.getloadavg()[0]
        if k >= 2:
            victim = stores[-1]
            victim.p.send_signal(signal.SIGKILL)
            victim.p.wait(timeout=10)
            row["killed"] = f"s{k - 1}"
            for rep in (1, 2):
                got = all_do(reqs, op="get", replicas=rep, survive=True)
                row[f"r{rep}"]["after_kill"] = {
                    key: sum(r[key] for r in got) for key in ("ok", "failed", "wrong")
                }
        progress(f"done K={k}")
        return row
    finally:
        for r in reqs:
            r.stop()
        for p in reversed(procs):
            p.stop()
        for name in ["m", *names]:
            net.remove_host(name)


def pct(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))] if v else 0.0


def run_restart(net: Net, k: int, args, tmp: str, ramp_ms: int) -> dict:
    """A full pool of k stores, then one restarted empty on its own port (its segment mounts
    again under the same name): the newcomer's share of the puts in its first seconds, the
    puts' latency, and the latency of gets of what the pool held, served by the others."""
    procs: list[Proc] = []
    reqs: list[Requester] = []
    names = [f"s{i}" for i in range(k)] + ["r0", "r1"]
    opened = time.monotonic()
    try:
        net.add_host("m", 1)
        for i in range(k):
            net.add_host(f"s{i}", 10 + i)
        for j in range(2):
            net.add_host(f"r{j}", 100 + j)
        master = f"{net.hosts['m']}:{MASTER_PORT}"
        m = net.spawn("m", [str(Path(args.bin_dir) / "lunakv-master"),
                            f"--rpc_address={net.hosts['m']}", f"--rpc_port={MASTER_PORT}",
                            "--metrics_port=9003", f"--data_dir={tmp}/restart{ramp_ms}",
                            f"--allocation_strategy={args.strategy}",
                            f"--placement_ramp_ms={ramp_ms}"])
        procs.append(m)
        m.wait_for("listening")

        def store(i: int) -> Proc:
            s = net.spawn(f"s{i}", [str(Path(args.bin_dir) / "lunakv-store"),
                                    f"--master_server_address={master}",
                                    f"--host={net.hosts[f's{i}']}", "--port=50052",
                                    "--metrics_port=0",
                                    f"--global_segment_size={args.restart_seg_mib}MB"])
            procs.append(s)
            return s

        stores = [store(i) for i in range(k)]
        for s in stores:
            s.wait_for("listening")
        pool = k * args.restart_seg_mib * MB // (args.object_kib * 1024)
        for j in range(2):
            reqs.append(Requester(net, f"r{j}", args, master, seed=j))
        # 1.2 pools between the two: full, with evictions behind it.
        fill = int(pool * 0.6)
        # A full pool may refuse a put now and then (every candidate for eviction in flight):
        # counted, as an engine would skip saving that block.
        fill_failed = sum(res["failed"] for res in all_do(reqs, op="fill", tag="fill", count=fill))
        # The others settle (a pool that has run for a while): their own ramps end first.
        settle = opened + args.ramp_ms / 1000 + 1 - time.monotonic()
        if settle > 0:
            time.sleep(settle)
        victim = stores[-1]
        victim.p.send_signal(signal.SIGKILL)
        victim.p.wait(timeout=10)
        store(k - 1).wait_for("listening")
        newcomer = None
        deadline = time.monotonic() + 30
        while newcomer is None:
            segs = ns_get_json(net, "m", f"http://{net.hosts['m']}:9003/get_all_segments")
            fresh = [x for x in segs if x["objects"] == 0]
            if len(segs) == k and fresh:
                newcomer = fresh[0]["name"]
            elif time.monotonic() > deadline:
                raise RuntimeError(f"the restarted store did not mount: {segs}")
            else:
                time.sleep(0.1)
        # A pool's worth of new puts paced over --restart-seconds while the other requester
        # reads what it put; the newcomer's objects sampled as they go.
        new = pool
        secs = args.restart_seconds
        t_start = time.monotonic()
        reqs[0].send(op="fill", tag="new", count=new, seconds=secs)
        reqs[1].send(op="getlat", tag="fill", count=fill, rounds=1, seconds=secs)
        samples = []
        for at in (1, 2, 5):
            wait = t_start + at - time.monotonic()
            if at >= secs or wait < 0:
                continue
            time.sleep(wait)
            segs = ns_get_json(net, "m", f"http://{net.hosts['m']}:9003/get_all_segments")
            took_now = next((x["objects"] for x in segs if x["name"] == newcomer), 0)
            # Batches go out at t = 0, per_batch, 2 per_batch, ... (the requester paces them);
            # counted up to when the answer came back (starting the query takes a while).
            per_batch = secs * GET_BATCH / new
            answered = time.monotonic() - t_start
            samples.append({"seconds": at, "newcomer_objects": took_now,
                            "puts": min(new, (int(answered / per_batch) + 1) * GET_BATCH)})
        put, got = reqs[0].result(), reqs[1].result()
        if got["wrong"]:
            raise RuntimeError(f"restart phase: {got['wrong']} gets returned wrong bytes")
        segs = ns_get_json(net, "m", f"http://{net.hosts['m']}:9003/get_all_segments")
        took = next(x["objects"] for x in segs if x["name"] == newcomer)
        ms = 1000.0
        return {"stores": k, "ramp_ms": ramp_ms, "pool_objects": pool, "new_puts": new,
                "newcomer_objects": took, "newcomer_share": took / max(1, new),
                "fair_share": 1 / k, "put_seconds": put["seconds"],
                "put_p50_ms": pct(put["latencies"], 0.5) * ms,
                "put_p99_ms": pct(put["latencies"], 0.99) * ms,
                "get_p50_ms": pct(got["latencies"], 0.5) * ms,
                "get_p99_ms": pct(got["latencies"], 0.99) * ms,
                "gets_ok": got["ok"], "gets_missed": got["missed"], "gets_wrong": got["wrong"],
                "fill_puts_failed": fill_failed, "puts_failed": put["failed"],
                "samples": samples,
                "load": os.getloadavg()[0]}
    finally:
        for r in reqs:
            r.stop()
        for p in reversed(procs):
            p.stop()
        for name in ["m", *names]:
            net.remove_host(name)


def fmt_restart(rows: list[dict]) -> str:
    out = ["ramp ms  stores  newcomer's objects / new puts after 1 s, 2 s, 5 s, all (fair share)"
           "  put s  put p50/p99 ms  get p50/p99 ms  gets ok/missed/wrong  puts failed (fill, measured)"]
    for r in rows:
        early = "  ".join(f"{s['newcomer_objects']}/{s['puts']}" for s in r["samples"])
        out.append(f"{r['ramp_ms']:>7}  {r['stores']:>6}  {early}  {r['newcomer_objects']}/{r['new_puts']}"
                   f" ({r['fair_share']:.2f})  "
                   f"{r['put_seconds']:5.2f}  {r['put_p50_ms']:6.1f}/{r['put_p99_ms']:<6.1f}"
                   f"  {r['get_p50_ms']:6.1f}/{r['get_p99_ms']:<6.1f}"
                   f"  {r['gets_ok']}/{r['gets_missed']}/{r['gets_wrong']}"
                   f"  {r['fill_puts_failed']}, {r['puts_failed']}")
    return "\n".join(out)


def progress(msg: str) -> None:
    print(f"bench-cluster: {msg}", file=sys.stderr, flush=True)


def fmt(rows: list[dict]) -> str:
    out = ["stores  replicas  get GB/s (median, min-max)  per store  veth tcp GB/s  ratio (median, min-max)"
           "  objects per store (max/min)  after one store is killed"]
    for row in rows:
        for rep in (1, 2):
            r = row[f"r{rep}"]
            g, lim, ratio = r["get_gbps"], r["tcp_limit_gbps"], r["ratio"]
            kill = "-"
            if "after_kill" in r:
                a = r["after_kill"]
                kill = f"{a['ok']} ok, {a['failed']} failed, {a['wrong']} wrong"
            out.append(
                f"{row['stores']:>6}  {rep:>8}  {g['median']:5.2f} ({g['min']:.2f}-{g['max']:.2f})"
                f"{'':11}{r['per_store_gbps']:5.2f}  {lim['median']:13.2f}  "
                f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f}){'':8}"
                f"{'/'.join(map(str, row['objects_per_store']))} ({row['balance_max_min']:.2f})"
                f"{'':6}{kill}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stores", default="1,2,4", help="K values, comma-separated")
    ap.add_argument("--requesters", type=int, default=2)
    ap.add_argument("--total-mib", type=int, default=128, help="data put per replica_num, all requesters")
    ap.add_argument("--object-kib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2, help="get passes over every object per trial")
    ap.add_argument("--limit-mib", type=int, default=256, help="bytes each requester streams per limit trial")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--strategy", default="free_ratio_first", help="the master's --allocation_strategy")
    ap.add_argument("--restart", action="store_true",
                    help="instead: a full pool with one store restarted empty, the master's "
                         "placement ramp off and on in alternating pairs")
    ap.add_argument("--restart-stores", type=int, default=3)
    ap.add_argument("--restart-seg-mib", type=int, default=64, help="each store's segment in --restart")
    ap.add_argument("--ramp-ms", type=int, default=30000, help="--placement_ramp_ms of the ramp-on runs")
    ap.add_argument("--restart-seconds", type=float, default=10.0,
                    help="how long the pool's worth of new puts after the restart takes")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--bin-dir", default=str(REPO / "target" / "release"))
    ap.add_argument("--lunakv-python", default=str(REPO / ".venv" / "bin" / "python"))
    # Internal: the processes this script starts in the namespaces.
    ap.add_argument("--requester", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sink", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--host", help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--objects", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.requester:
        return requester(args)
    if args.sink:
        return sink(args)
    why = preflight()
    if why:
        print(f"bench-cluster: {why}", file=sys.stderr)
        return 2
    args.objects = max(GET_BATCH, args.total_mib * MB // (args.object_kib * 1024) // args.requesters)
    ks = [int(k) for k in args.stores.split(",")]
    tmp = tempfile.mkdtemp(prefix="lkv-cluster-")
    net = Net()
    rows = []
    try:
        if args.restart:
            for p in range(args.pairs):
                # Alternating which goes first, so drift on a shared machine cancels.
                for ramp in ((0, args.ramp_ms) if p % 2 == 0 else (args.ramp_ms, 0)):
                    rows.append(run_restart(net, args.restart_stores, args, tmp, ramp))
                    progress(f"restart pair {p + 1}/{args.pairs}, ramp {ramp} ms: newcomer share "
                             f"{rows[-1]['newcomer_share']:.2f}")
        else:
            for k in ks:
                rows.append(run_k(net, k, args, tmp))
    finally:
        net.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps({"rows": rows}))
    elif args.restart:
        print(f"== one of {args.restart_stores} stores restarted empty in a full pool of "
              f"{args.restart_seg_mib} MiB segments, {args.object_kib} KiB objects, allocation_strategy "
              f"{args.strategy}, {os.cpu_count()} CPUs")
        print(fmt_restart(sorted(rows, key=lambda r: r["ramp_ms"])))
        return 0
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        print(f"== {args.requesters} requesters, {args.total_mib} MiB of {args.object_kib} KiB objects per "
              f"replica_num, allocation_strategy {args.strategy}, {os.cpu_count()} CPUs")
        print(fmt(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
