#!/usr/bin/env python3
"""vLLM's save and load on a busy CPU (issue 34 item 4): lunakv vs upstream, paired.

A miss request makes vLLM's store connector save its new blocks with one
batch_put_from_multi_buffers call (one piece per layer per block), and a hit loads them with
batch_get_into_multi_buffers. Both are small batches on the engine's own thread, so what decides
their latency on a loaded machine is the client inside the engine process: how many threads it
runs, how often a call hands work to another thread and waits for it to be scheduled, and
locks. This measures per-call latency (p50/p99) of such saves and loads, plus the process's
thread count and context switches per call (voluntary: the call slept waiting for another
thread or the network; nonvoluntary: it was preempted), summed over every thread from
/proc/self/task/*/status:

  quiet   nothing else running
  busy    beside two busy-loop processes (`python3 -c 'while 1: pass'` x2), started and
          stopped by the worker around the phase, so both sides get the same neighbours

Each implementation runs in its own worker process, lunakv and upstream alternately (--pairs),
as bench_store.py runs them (upstream from its throwaway venv inside `unshare -n`; skipped
cleanly when it cannot install). --device runs lunakv alone with the device test double
(LUNAKV_DEVICE=fake): the same calls on fake GPU memory, with the time inside the double's
copies subtracted, the Python path of `lunakv bench --device` (docs/GPU.md).

    bindings/python/build.sh bench-busy          # release wheel + binaries, then this
    python bench_busy.py [--no-upstream] [--pairs 3] [--calls 300] [--batch 4] ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_store as bs  # noqa: E402  (the shared worker plumbing)

MB = 1 << 20


def proc_counts() -> dict:
    """Threads, and context switches summed over every thread of this process."""
    vol = nonvol = threads = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        vol += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        nonvol += int(line.split()[1])
            threads += 1
        except OSError:
            pass  # a thread that ended meanwhile
    return {"threads": threads, "vol": vol, "nonvol": nonvol}


def thread_names() -> dict:
    names: dict[str, int] = {}
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n = f.read().strip()
        except OSError:
            continue
        names[n] = names.get(n, 0) + 1
    return names


def pct(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e6 if s else 0.0


def phase(store, args, src, dst, tag: str, device) -> dict:
    """`args.calls` saves of `args.batch` blocks, then as many loads of them, each timed. With
    the device double (256 MiB batches): one untimed warm-up save and load, then per call a
    save, its load and an untimed removal, so the segment holds one batch at a time."""
    layers, piece, batch = args.layers, args.piece_kib * 1024, args.batch
    stride = cache_blocks(args) * piece

    def addrs(base: int, first: int):
        first %= cache_blocks(args)
        ptrs = [[base + layer * stride + (first + b) * piece for layer in range(layers)] for b in range(batch)]
        return ptrs, [[piece] * layers for _ in range(batch)]

    calls = args.calls + (1 if device else 0)
    keys = [f"{tag}@busy@tp_rank:0@pp_rank:0@group:0@{i:064x}" for i in range(calls * batch)]

    def remove(k: list[str]) -> None:
        if hasattr(store, "batch_remove"):
            store.batch_remove(k, True)
        else:
            for key in k:
                store.remove(key)

    def call(op: str, c: int) -> tuple[float, float]:
        """One save or load: (seconds, seconds inside the double's copies)."""
        k = keys[c * batch:(c + 1) * batch]
        c0 = device.device_stats()["copy_ns"] if device else 0
        if op == "put":
            ptrs, sizes = addrs(src, c * batch)
            t = time.perf_counter()
            r = store.batch_put_from_multi_buffers(k, ptrs, sizes)
            dt = time.perf_counter() - t
            if any(x != 0 for x in r):
                raise RuntimeError(f"batch_put_from_multi_buffers: {list(r)[:4]}")
        else:
            ptrs, sizes = addrs(dst, c * batch)
            t = time.perf_counter()
            r = store.batch_get_into_multi_buffers(k, ptrs, sizes)
            dt = time.perf_counter() - t
            if any(x != layers * piece for x in r):
                raise RuntimeError(f"batch_get_into_multi_buffers: {list(r)[:4]}")
        return dt, ((device.device_stats()["copy_ns"] - c0) / 1e9 if device else 0.0)

    if device:
        schedule = [[("put", c), ("get", c), ("remove", c)] for c in range(calls)]
        schedule = [x for xs in schedule for x in xs]
    else:
        schedule = [("put", c) for c in range(calls)] + [("get", c) for c in range(calls)]
    lat: dict[str, list[float]] = {"put": [], "get": []}
    copy_s: dict[str, list[float]] = {"put": [], "get": []}
    ctx: dict[str, list[int]] = {"put": [0, 0], "get": [0, 0]}
    for op, c in schedule:
        if op == "remove":
            remove(keys[c * batch:(c + 1) * batch])
            continue
        before = proc_counts()
        dt, cp = call(op, c)
        after = proc_counts()
        if device and c == 0:
            continue  # warm-up: pins the segment, faults pages in
        lat[op].append(dt)
        copy_s[op].append(cp)
        ctx[op][0] += after["vol"] - before["vol"]
        ctx[op][1] += after["nonvol"] - before["nonvol"]
    out: dict = {"threads": proc_counts()["threads"]}
    for op in ("put", "get"):
        out[f"{op}_p50_us"] = pct(lat[op], 0.5)
        out[f"{op}_p99_us"] = pct(lat[op], 0.99)
        out[f"{op}_vol_per_call"] = ctx[op][0] / args.calls
        out[f"{op}_nonvol_per_call"] = ctx[op][1] / args.calls
        if device:
            over = [a - b for a, b in zip(lat[op], copy_s[op])]
            out[f"{op}_copy_p50_us"] = pct(copy_s[op], 0.5)
            out[f"{op}_overhead_p50_us"] = pct(over, 0.5)
            out[f"{op}_overhead_p99_us"] = pct(over, 0.99)
    if not device:
        remove(keys)
    return out


def cache_blocks(args) -> int:
    """Blocks of the KV cache: one per saved block, or --distinct-batches batches reused."""
    n = args.calls if args.distinct_batches <= 0 else min(args.calls, args.distinct_batches)
    return n * args.batch


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]


def worker(args) -> int:
    from mooncake.store import MooncakeDistributedStore

    impl = args.worker
    device = None
    if args.device:
        from mooncake import _lunakv_testing as device  # noqa: F811 - the fake device helpers
    procs: list = []
    tmp = tempfile.mkdtemp(prefix=f"mc-busy-{impl}-")
    layers, piece = args.layers, args.piece_kib * 1024
    region = layers * cache_blocks(args) * piece
    # Every call's objects stay stored until the phase ends (then removed); with the device
    # double one batch at a time.
    stored = (1 if args.device else args.calls) * args.batch * layers * piece
    gss = max(4 * region, stored * 5 // 4, 256 * MB)
    try:
        m, master = bs.start_master(impl, args.bin_dir, tmp)
        procs.append(m)
        for mode in args.modes.split(","):
            owner = None
            s = MooncakeDistributedStore()
            if mode == "embedded":
                bs.store_setup(s, gss, master)
            else:
                owner = bs.start_owner(impl, args, master, gss, tmp)
                procs.append(owner)
                bs.store_setup(s, 0, master)
            if device:
                src, dst = device.device_alloc(region), device.device_alloc(region)
                pattern = bytes(range(256)) * (region // 256)
                device.device_write(src, pattern)
            else:
                import numpy as np
                a = np.random.default_rng(3).integers(0, 256, region, dtype=np.uint8)
                b = np.zeros_like(a)
                b.fill(0)
                src, dst = a.ctypes.data, b.ctypes.data
            for buf in (src, dst):
                if s.register_buffer(buf, region) != 0:
                    raise RuntimeError("register_buffer failed")
            for cond in ("quiet", "busy"):
                loops = busy_loops(2) if cond == "busy" else []
                try:
                    time.sleep(0.3 if loops else 0.0)
                    res = phase(s, args, src, dst, f"{impl}-{mode}-{cond}", device)
                finally:
                    for p in loops:
                        p.kill()
                        p.wait()
                ok = (device.device_read(dst, region) == device.device_read(src, region)) if device \
                    else bool((a == b).all())
                if not ok:
                    raise RuntimeError(f"{mode} {cond}: loaded bytes differ from the saved bytes")
                res.update(impl=impl, mode=mode, cond=cond, load=os.getloadavg()[0],
                           thread_names=thread_names())
                print("RESULT " + json.dumps(res), flush=True)
                if not device:
                    b.fill(0)
            for buf in (src, dst):
                s.unregister_buffer(buf)
            s.close()
            if device:
                device.device_free(src)
                device.device_free(dst)
            if owner is not None:
                owner.stop()
    finally:
        for p in reversed(procs):
            p.stop()
    return 0


def fmt(r: dict) -> str:
    line = (f"{r['impl']:8} {r['mode']:16} {r['cond']:5} put p50 {r['put_p50_us']:7.0f} p99 {r['put_p99_us']:7.0f} us"
            f" (ctx {r['put_vol_per_call']:5.1f}+{r['put_nonvol_per_call']:4.1f}/call)   get p50 {r['get_p50_us']:7.0f}"
            f" p99 {r['get_p99_us']:7.0f} us (ctx {r['get_vol_per_call']:5.1f}+{r['get_nonvol_per_call']:4.1f}/call)"
            f"   threads {r['threads']:3}  load {r['load']:.1f}")
    if "put_overhead_p50_us" in r:
        line += (f"\n{'':31} device: put copy p50 {r['put_copy_p50_us']:.0f} us, overhead p50 "
                 f"{r['put_overhead_p50_us']:.0f} p99 {r['put_overhead_p99_us']:.0f} us; get copy p50 "
                 f"{r['get_copy_p50_us']:.0f} us, overhead p50 {r['get_overhead_p50_us']:.0f} p99 "
                 f"{r['get_overhead_p99_us']:.0f} us")
    return line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["lunakv", "upstream"], help=argparse.SUPPRESS)
    ap.add_argument("--bin-dir", default=str(bs.REPO / "target" / "release"))
    ap.add_argument("--lunakv-python", default=str(bs.REPO / ".venv" / "bin" / "python"))
    ap.add_argument("--upstream-venv", default="/tmp/mc-upstream-venv")
    ap.add_argument("--no-upstream", action="store_true")
    ap.add_argument("--device", action="store_true", help="lunakv only, on the device test double")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--modes", default="embedded,standalone-store")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--piece-kib", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4, help="blocks per save/load call")
    ap.add_argument("--calls", type=int, default=300, help="timed calls per phase")
    ap.add_argument("--distinct-batches", type=int, default=0,
                    help="KV cache blocks for this many batches, reused by later calls (0: one per call)")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.device:
        args.no_upstream = True
    me = str(Path(__file__).resolve())
    common = ["--bin-dir", args.bin_dir, "--modes", args.modes, "--layers", str(args.layers),
              "--piece-kib", str(args.piece_kib), "--batch", str(args.batch), "--calls", str(args.calls),
              "--distinct-batches", str(args.distinct_batches)]
    if args.device:
        common.append("--device")
    env, lcmd, uenv, ucmd = bs.worker_commands(args, me, common)
    if args.device:
        env["LUNAKV_DEVICE"] = "fake"
    print(f"bench_busy: {args.batch} blocks x {args.layers} layers x {args.piece_kib} KiB per call, "
          f"{args.calls} calls per phase, {args.pairs} pairs; ctx = voluntary+nonvoluntary switches "
          "per call, all threads", flush=True)
    rows: list[dict] = []
    for i in range(args.pairs):
        for cmd, e in ((lcmd, env), (ucmd, uenv)):
            if cmd is None:
                continue
            try:
                for r in bs.run_worker(cmd, e, timeout=900):
                    rows.append(r)
                    print(fmt(r), flush=True)
            except (RuntimeError, subprocess.SubprocessError) as ex:
                print(f"pair {i + 1}: {ex}", flush=True)
    print("\nmedians over pairs (us):")
    keys = sorted({(r["mode"], r["cond"]) for r in rows})
    for mode, cond in keys:
        for impl in ("lunakv", "upstream"):
            rs = [r for r in rows if r["impl"] == impl and r["mode"] == mode and r["cond"] == cond]
            if not rs:
                continue
            med = {k: statistics.median(r[k] for r in rs)
                   for k in ("put_p50_us", "put_p99_us", "get_p50_us", "get_p99_us", "threads",
                             "put_vol_per_call", "get_vol_per_call")}
            print(f"  {impl:8} {mode:16} {cond:5} put p50 {med['put_p50_us']:7.0f} p99 {med['put_p99_us']:7.0f}"
                  f"   get p50 {med['get_p50_us']:7.0f} p99 {med['get_p99_us']:7.0f}   threads {med['threads']:.0f}"
                  f"   vol ctx/call put {med['put_vol_per_call']:.1f} get {med['get_vol_per_call']:.1f}")
    print("\nthreads by name at the end of each phase (the bench's own Python threads included):")
    seen = set()
    for r in rows:
        k = (r["impl"], r["mode"], r["cond"])
        if k not in seen:
            seen.add(k)
            print(f"  {r['impl']:8} {r['mode']:16} {r['cond']:5} {r['thread_names']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
