#!/usr/bin/env python3
"""Metadata scale: the master's memory per key and its batch ops per CPU-second, lunakv vs upstream.

Upstream's master runs out of memory as keys grow (Mooncake #3452); this measures both masters
under the same load. N keys (default 1,000,000) shaped like vLLM's MooncakeStoreConnector keys
(~115 bytes: model, ranks, group and a 64-hex-digit block hash) go through each master's batch
RPCs from --clients client processes (default 2), in batches of --batch keys (32, as vLLM's
batch_is_exist and batch puts), through the same `mooncake.store` calls vLLM and SGLang make:

  put       batch_put_from        one BatchPutStart + BatchPutEnd per batch (values are
                                  --value-bytes bytes, default 64, from a registered buffer)
  exists    batch_is_exist        one BatchExistKey per batch
  replicas  batch_get_replica_desc  one BatchGetReplicaList per batch

Each client is embedded (owns a segment big enough for its values), so the objects are real. For
each phase the master's CPU-seconds (its threads' run time, /proc/<pid>/task/*/schedstat) and the
wall time are read around it; a row reports ops/s (keys per second, all clients together),
p50/p99 per batch call, and the master's CPU-seconds per million keys. Its RSS is read before the puts and after them:
bytes per key = (RSS after - RSS before) / N.

The two sides run as bench_store.py runs them: lunakv with the wheel's interpreter (<repo>/.venv)
and target/release binaries; upstream (mooncake-transfer-engine-non-cuda, in the throwaway venv
/tmp/mc-upstream-venv) inside `unshare -n`. --pairs N alternates them, lunakv first; ratios are
per pair, their median is the verdict. The issue's targets: lunakv's bytes per key at most 0.5x
upstream's, and its ops per master CPU-second at least 2x upstream's.

    bindings/python/build.sh bench-meta             # release wheel + binaries, then this
    python bench_meta.py [--keys 1000000] [--clients 2] [--pairs 1] [--no-upstream]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_store import (  # noqa: E402
    MB,
    Proc,
    run_worker,
    start_master,
    store_setup,
    worker_commands,
)

PHASES = ("put", "exists", "replicas")
MODEL = "Qwen/Qwen3-8B"


def vllm_key(client: int, i: int) -> str:
    """A key as vLLM's MooncakeStoreConnector builds it (~115 bytes; the model and ranks are a
    prefix every key of one engine shares)."""
    return f"{MODEL}@tp_rank:{client}@pcp0@dcp0@pp_rank:0@group:0@{i:064x}"


def pct(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


# === a client process: one embedded store, phases on command ===

def client(args) -> int:
    import numpy as np
    from mooncake.store import MooncakeDistributedStore

    n = args.keys_per_client
    keys = [vllm_key(args.index, i) for i in range(n)]
    # Each value takes at least an allocation granule in a segment; leave room for any rounding.
    gss = max(64 * MB, n * max(args.value_bytes, 64) * 4)
    s = MooncakeDistributedStore()
    store_setup(s, gss, args.master)
    buf = np.full(args.batch * args.value_bytes, 7, dtype=np.uint8)
    if s.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
        raise RuntimeError("register_buffer failed")
    ptrs = [buf.ctypes.data + j * args.value_bytes for j in range(args.batch)]
    print("READY", flush=True)
    for line in sys.stdin:
        phase = line.strip()
        if phase == "quit":
            break
        lat: list[float] = []
        t0 = time.perf_counter()
        for first in range(0, n, args.batch):
            chunk = keys[first : first + args.batch]
            t = time.perf_counter()
            if phase == "put":
                r = s.batch_put_from(chunk, ptrs[: len(chunk)], [args.value_bytes] * len(chunk))
                bad = [x for x in r if x != 0]
            elif phase == "exists":
                r = s.batch_is_exist(chunk)
                bad = [x for x in r if x != 1]
            elif phase == "replicas":
                r = s.batch_get_replica_desc(chunk)
                bad = [k for k in chunk if not r.get(k)]
            else:
                raise SystemExit(f"unknown phase {phase}")
            lat.append(time.perf_counter() - t)
            if bad:
                raise RuntimeError(f"{phase}: {len(bad)} of {len(chunk)} keys failed, e.g. {bad[0]!r}")
        wall = time.perf_counter() - t0
        print("DONE " + json.dumps({"phase": phase, "keys": n, "wall_s": wall,
                                    "lat_us": [round(x * 1e6, 1) for x in lat]}), flush=True)
    s.unregister_buffer(buf.ctypes.data)
    s.close()
    return 0


# === a worker: one implementation's master and its clients ===

def proc_cpu_s(pid: int) -> float:
    """The CPU time `pid` has used, all its threads together, in seconds: the nanosecond run
    times of /proc/<pid>/task/*/schedstat (a thread that exited between two reads drops out, so
    this reads a phase of a long-lived server, not a process whose threads come and go)."""
    total = 0
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((t / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def proc_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def worker(args) -> int:
    impl = args.worker
    tmp = tempfile.mkdtemp(prefix=f"mc-meta-{impl}-")
    procs: list[Proc] = []
    try:
        m, master = start_master(impl, args.bin_dir, tmp)
        procs.append(m)
        pid = m.p.pid
        per = args.keys // args.clients
        me = str(Path(__file__).resolve())
        clients = []
        for i in range(args.clients):
            c = subprocess.Popen(
                [sys.executable, me, "--client", "--index", str(i), "--master", master,
                 "--keys-per-client", str(per), "--batch", str(args.batch),
                 "--value-bytes", str(args.value_bytes)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs.append(_Popen(c))
            clients.append(c)
        for c in clients:
            _expect(c, "READY")
        time.sleep(0.5)  # let the master settle after the mounts
        rss0 = proc_rss(pid)
        out = {"impl": impl, "keys": per * args.clients, "clients": args.clients,
               "batch": args.batch, "load": os.getloadavg()[0], "rss_before": rss0}
        for phase in PHASES:
            cpu0 = proc_cpu_s(pid)
            t0 = time.perf_counter()
            for c in clients:
                assert c.stdin is not None
                c.stdin.write(phase + "\n")
                c.stdin.flush()
            done = [json.loads(_expect(c, "DONE ")[5:]) for c in clients]
            wall = time.perf_counter() - t0
            cpu = proc_cpu_s(pid) - cpu0
            lat = [x for d in done for x in d["lat_us"]]
            keys = sum(d["keys"] for d in done)
            out[phase] = {"ops_s": keys / wall, "p50_us": pct(lat, 0.5), "p99_us": pct(lat, 0.99),
                          "cpu_s": cpu, "cpu_s_per_mop": cpu / keys * 1e6,
                          "ops_per_cpu_s": keys / cpu if cpu > 0 else float("inf")}
            if phase == "put":
                time.sleep(0.5)
                out["rss_after"] = proc_rss(pid)
                out["bytes_per_key"] = (out["rss_after"] - rss0) / out["keys"]
            print(f"   {impl}: {phase} done ({keys} keys, {wall:.1f} s)", file=sys.stderr, flush=True)
        for c in clients:
            assert c.stdin is not None
            c.stdin.write("quit\n")
            c.stdin.flush()
        print("RESULT " + json.dumps(out), flush=True)
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


class _Popen:
    """A plain Popen with Proc's stop(), so the worker's cleanup treats both alike."""

    def __init__(self, p: subprocess.Popen):
        self.p = p

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(timeout=10)


def _expect(c: subprocess.Popen, prefix: str) -> str:
    assert c.stdout is not None
    for line in c.stdout:
        if line.startswith(prefix):
            return line
    raise RuntimeError(f"client exited ({c.wait()}) before printing {prefix.strip()}")


# === the driver ===

def fmt(r: dict) -> list[str]:
    lines = [f"{r['impl']:8} {r['keys']} keys, {r['clients']} clients, batches of {r['batch']}: "
             f"master RSS {r['rss_before'] / MB:.0f} -> {r['rss_after'] / MB:.0f} MiB, "
             f"{r['bytes_per_key']:.0f} B/key   load {r['load']:.2f}"]
    for phase in PHASES:
        p = r[phase]
        lines.append(f"{'':8} {phase:8} {p['ops_s']:9.0f} keys/s  batch p50 {p['p50_us']:7.0f} us "
                     f"p99 {p['p99_us']:7.0f} us  master {p['cpu_s_per_mop']:6.2f} CPU-s/Mkeys "
                     f"({p['ops_per_cpu_s']:9.0f} keys per CPU-s)")
    return lines


def ratios(lruns: list[dict], uruns: list[dict]) -> dict[str, list[float]]:
    """Per pair: lunakv's bytes per key over upstream's (lower is better), and per phase lunakv's
    keys per master CPU-second and keys per second over upstream's (higher is better)."""
    out: dict[str, list[float]] = {"bytes_per_key": []}
    for lr, ur in zip(lruns, uruns):
        out["bytes_per_key"].append(lr["bytes_per_key"] / ur["bytes_per_key"])
        for phase in PHASES:
            for what in ("ops_per_cpu_s", "ops_s"):
                out.setdefault(f"{phase}_{what}", []).append(lr[phase][what] / ur[phase][what])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["lunakv", "upstream"], help=argparse.SUPPRESS)
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--keys-per-client", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--keys", type=int, default=1_000_000, help="keys in all (split over the clients)")
    ap.add_argument("--clients", type=int, default=2, help="client processes")
    ap.add_argument("--batch", type=int, default=32, help="keys per batch call")
    ap.add_argument("--value-bytes", type=int, default=64, help="bytes per object")
    ap.add_argument("--pairs", type=int, default=1, help="paired trials (lunakv then upstream, N times)")
    ap.add_argument("--no-upstream", action="store_true", help="measure lunakv only")
    ap.add_argument("--json", action="store_true", help="print every run and the ratios as one JSON object")
    ap.add_argument("--lunakv-python", default=str(Path(HERE).parents[2] / ".venv" / "bin" / "python"))
    ap.add_argument("--upstream-venv", default="/tmp/mc-upstream-venv")
    ap.add_argument("--bin-dir", default=os.environ.get("LUNAKV_BIN_DIR",
                                                        str(Path(HERE).parents[2] / "target" / "release")))
    args = ap.parse_args()
    if args.client:
        return client(args)
    for name in ("keys", "clients", "batch", "value_bytes", "pairs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: use at least 1")
    if args.keys < args.clients * args.batch:
        ap.error(f"--keys {args.keys}: use at least --clients x --batch ({args.clients * args.batch})")
    if args.worker:
        return worker(args)

    common = ["--keys", str(args.keys), "--clients", str(args.clients), "--batch", str(args.batch),
              "--value-bytes", str(args.value_bytes), "--bin-dir", args.bin_dir]
    me = str(Path(__file__).resolve())
    env, lunakv_cmd, uenv, upstream_cmd = worker_commands(args, me, common)

    print(f"== metadata: {args.keys} vLLM-shaped keys, {args.clients} clients, batches of {args.batch}, "
          f"{args.value_bytes}-byte values, {args.pairs} pair(s)", flush=True)
    timeout = 600 + args.keys / 200
    lruns: list[dict] = []
    uruns: list[dict] = []
    for i in range(args.pairs):
        (r,) = run_worker(lunakv_cmd, env, timeout)
        lruns.append(r)
        print("\n".join(fmt(r)), flush=True)
        if upstream_cmd:
            try:
                (r,) = run_worker(upstream_cmd, uenv, timeout)
            except (RuntimeError, subprocess.SubprocessError, ValueError) as e:
                print(f"upstream run failed: {e}")
                upstream_cmd = None
                continue
            uruns.append(r)
            print("\n".join(fmt(r)), flush=True)
        print(f"== pair {i + 1}/{args.pairs} done (load {os.getloadavg()[0]:.2f})", flush=True)

    rat = ratios(lruns, uruns) if uruns else {}
    if rat:
        print("== lunakv / upstream, median [min-max] over pairs:")
        targets = {"bytes_per_key": (0.5, "<="), "put_ops_per_cpu_s": (2.0, ">="),
                   "exists_ops_per_cpu_s": (2.0, ">="), "replicas_ops_per_cpu_s": (2.0, ">=")}
        for name, v in rat.items():
            med = statistics.median(v)
            verdict = ""
            if name in targets:
                goal, op = targets[name]
                ok = med <= goal if op == "<=" else med >= goal
                verdict = f"  target {op} {goal}x: {'PASS' if ok else 'MISS'}"
            print(f"   {name:24} {med:6.2f}x [{min(v):.2f}-{max(v):.2f}]{verdict}")
    if args.json:
        print(json.dumps({"lunakv": lruns, "upstream": uruns, "ratios": rat}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
