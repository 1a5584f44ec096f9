#!/usr/bin/env python3
"""Batch put/get GB/s of vLLM-like objects through `mooncake.store`: lunakv vs upstream.

The workload is vLLM's MooncakeStoreConnector's: an object is one KV block, one piece per layer
(default 32 layers x 16 KiB = 512 KiB), saved with batch_put_from_multi_buffers and loaded with
batch_get_into_multi_buffers, in batches of 32 objects, ~256 MiB moved each way. Every load is
compared byte for byte. Load buffers are touched before the gets, as vLLM's KV cache is
(--cold-dst: not). Each worker also measures memcpy of the same pieces (the ceiling of a
one-thread memcpy path) and reports the machine's load average next to every row.
GB/s = 1e9 bytes/s over the whole pass; p50/p99 are per batch call.

After the loads, every object is checked with batch_is_exist in calls of --exists-batch keys (4 by
default, as vLLM's lookup of a short prefix), twice: "first" is each key's first check since its
put, "again" the same check repeated at once (vLLM repeats it on every scheduling pass of a
waiting request and for every request sharing the prefix). Both sides ask their master every
time (docs/ARCHITECTURE.md, "Existence checks"). Their ratio is upstream's p50 over lunakv's:
above 1, lunakv answers faster.

Two modes, as vLLM runs them:
  embedded          the benchmark process owns a segment (global_segment_size > 0) and is the
                    requester: puts and gets land in its own segment.
  standalone-store  a separate store process owns the segment (lunakv: lunakv-store; upstream:
                    mooncake_client if the wheel ships it, else a Python process in embedded
                    setup that only serves); the benchmark is a pure requester (size 0).

Each implementation runs in its own process (`--worker`): lunakv with the lunakv wheel's
interpreter (default <repo>/.venv), upstream in a throwaway venv (default /tmp/mc-upstream-venv,
created with `pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 numpy`) inside
`unshare -n` (loopback only: upstream's listeners open 0.0.0.0), with MC_TCP_BIND_ADDRESS=127.0.0.1
and metadata server P2PHANDSHAKE. Upstream is never a dependency of lunakv: `--no-upstream`, or
a failed install, runs lunakv alone.

    bindings/python/build.sh bench                    # release wheel + binaries, then this
    python bench_store.py [--no-upstream] [--pairs 5] [--total-mib 256] [--batch 32] ...

Layer-wise sessions (lunakv only: upstream's 0.3.13 wheel has no session calls; --no-layerwise
skips them): after each mode's pass, the same objects are saved and loaded again two ways,
interleaved batch by batch in one pass, alternating which goes first: whole blocks
(batch_put_from_multi_buffers / batch_get_into_multi_buffers, as above) and a layer-wise session
(batch_put_session_start, one batch_put_from_multi_buffer_ranges call per layer with one range
per object, batch_put_session_end; batch_get_session_start, one
batch_get_into_multi_buffer_ranges call per layer, batch_get_session_end). Each path's GB/s is
over its own time; p50/p99 are per batch (a session's whole sequence of calls). The row's ratio
is session / whole-block per run, median over the runs.

Ratios are paired trials: lunakv, upstream, lunakv, upstream, ... (--pairs N, default 5), each
pair's ratio taken from two back-to-back passes, so a burst of neighbour load skews one pair
rather than one side. The verdict uses the median per-pair ratio, printed with its min-max and
the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
UPSTREAM_PKG = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
MB = 1 << 20


# === child processes ===

class Proc:
    """A child process whose output is read line by line in the background."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, stdin: bool = False):
        self.args = args
        self.p = subprocess.Popen(
            args, stdin=subprocess.PIPE if stdin else None, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.log.append(line)
            self.lines.put(line)

    def wait_for(self, word: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.p.poll() is not None:
                    break
                continue
            if word in line:
                return line
        raise RuntimeError(
            f"{self.args[0]} printed no '{word}' within {timeout}s:\n" + "".join(self.log[-20:])
        )

    def send(self, line: str) -> None:
        """One line to the child's stdin (started with stdin=True)."""
        assert self.p.stdin is not None, "started without stdin=True"
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.p.kill()
        self.p.wait(timeout=10)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


# === the workload (runs in a worker, against whichever `mooncake` is importable) ===

def workload(store, args, tag: str) -> dict:
    import numpy as np

    piece = args.piece_kib * 1024
    obj = args.layers * piece
    n_objects = max(args.batch, (args.total_mib * MB) // obj // args.batch * args.batch)
    # A KV cache as vLLM lays it out: one region per layer, blocks of `piece` bytes in each.
    src = np.random.default_rng(5).integers(0, 256, (args.layers, n_objects, piece), dtype=np.uint8)
    dst = np.zeros_like(src)
    if not args.cold_dst:
        # vLLM's KV cache is allocated and zeroed (touched) at engine start, long before any
        # load: fill it, so a get measures the store, not the kernel zeroing fresh pages on
        # first touch (the same ~25 ms per 256 MiB on both sides). --cold-dst measures that too.
        dst.fill(0)
    for buf in (src, dst):
        rc = store.register_buffer(buf.ctypes.data, buf.nbytes)
        if rc != 0:
            raise RuntimeError(f"register_buffer: {rc}")
    stride = n_objects * piece

    def addrs(base: int, blocks: range):
        ptrs = [[base + layer * stride + b * piece for layer in range(args.layers)] for b in blocks]
        return ptrs, [[piece] * args.layers for _ in blocks]

    put_lat, get_lat = [], []
    put_time = get_time = 0.0
    keys_all = [f"{tag}@bench@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{i:064x}" for i in range(n_objects)]
    for first in range(0, n_objects, args.batch):
        blocks = range(first, first + args.batch)
        keys = keys_all[first : first + args.batch]
        ptrs, sizes = addrs(src.ctypes.data, blocks)
        t = time.perf_counter()
        r = store.batch_put_from_multi_buffers(keys, ptrs, sizes)
        dt = time.perf_counter() - t
        if any(x != 0 for x in r):
            raise RuntimeError(f"batch_put_from_multi_buffers: {r[:4]}...")
        put_lat.append(dt)
        put_time += dt
    for first in range(0, n_objects, args.batch):
        blocks = range(first, first + args.batch)
        keys = keys_all[first : first + args.batch]
        ptrs, sizes = addrs(dst.ctypes.data, blocks)
        t = time.perf_counter()
        r = store.batch_get_into_multi_buffers(keys, ptrs, sizes)
        dt = time.perf_counter() - t
        if any(x != obj for x in r):
            raise RuntimeError(f"batch_get_into_multi_buffers: {r[:4]}... (want {obj})")
        get_lat.append(dt)
        get_time += dt
    if not np.array_equal(src, dst):
        raise RuntimeError("loaded bytes differ from the saved bytes")
    exists_first, exists_again = [], []
    for lat in (exists_first, exists_again):
        for first in range(0, n_objects, args.exists_batch):
            keys = keys_all[first : first + args.exists_batch]
            t = time.perf_counter()
            r = store.batch_is_exist(keys)
            lat.append(time.perf_counter() - t)
            if list(r) != [1] * len(keys):
                raise RuntimeError(f"batch_is_exist: {list(r)[:4]}... (want 1 for every stored key)")
    for buf in (src, dst):
        store.unregister_buffer(buf.ctypes.data)
    moved = n_objects * obj

    def pct(v: list[float], q: float) -> float:
        s = sorted(v)
        return s[min(len(s) - 1, int(q * len(s)))] * 1e6

    return {
        "objects": n_objects,
        "object_bytes": obj,
        "bytes": moved,
        "put_gbps": moved / put_time / 1e9,
        "get_gbps": moved / get_time / 1e9,
        "put_p50_us": pct(put_lat, 0.5),
        "put_p99_us": pct(put_lat, 0.99),
        "get_p50_us": pct(get_lat, 0.5),
        "get_p99_us": pct(get_lat, 0.99),
        "exists_first_p50_us": pct(exists_first, 0.5),
        "exists_first_p99_us": pct(exists_first, 0.99),
        "exists_again_p50_us": pct(exists_again, 0.5),
        "exists_again_p99_us": pct(exists_again, 0.99),
    }


def layerwise_workload(store, args, tag: str) -> dict:
    """The same bytes as `workload`, saved and loaded both as whole blocks and through
    layer-wise sessions, interleaved per batch (see the module docs)."""
    import numpy as np

    piece = args.piece_kib * 1024
    obj = args.layers * piece
    n_objects = max(args.batch, (args.total_mib * MB) // obj // args.batch * args.batch)
    src = np.random.default_rng(8).integers(0, 256, (args.layers, n_objects, piece), dtype=np.uint8)
    dst = {"block": np.zeros_like(src), "session": np.zeros_like(src)}
    for d in dst.values():
        d.fill(0)  # warm, as in `workload`
    for buf in (src, *dst.values()):
        rc = store.register_buffer(buf.ctypes.data, buf.nbytes)
        if rc != 0:
            raise RuntimeError(f"register_buffer: {rc}")
    stride = n_objects * piece

    def addrs(base: int, blocks: range):
        ptrs = [[base + layer * stride + b * piece for layer in range(args.layers)] for b in blocks]
        return ptrs, [[piece] * args.layers for _ in blocks]

    def layer_args(base: int, blocks: range, layer: int):
        return ([[base + layer * stride + b * piece] for b in blocks], [[piece] for _ in blocks],
                [[layer * piece] for _ in blocks])

    def put_block(keys, blocks):
        ptrs, sizes = addrs(src.ctypes.data, blocks)
        r = store.batch_put_from_multi_buffers(keys, ptrs, sizes)
        if any(x != 0 for x in r):
            raise RuntimeError(f"batch_put_from_multi_buffers: {r[:4]}...")

    def put_session(keys, blocks):
        r = store.batch_put_session_start(keys, [obj] * len(keys))
        if any(x != 0 for x in r):
            raise RuntimeError(f"batch_put_session_start: {r[:4]}...")
        for layer in range(args.layers):
            r = store.batch_put_from_multi_buffer_ranges(keys, *layer_args(src.ctypes.data, blocks, layer))
            if any(x != piece for x in r):
                raise RuntimeError(f"batch_put_from_multi_buffer_ranges: {r[:4]}... (want {piece})")
        r = store.batch_put_session_end(keys)
        if any(x != 0 for x in r):
            raise RuntimeError(f"batch_put_session_end: {r[:4]}...")

    def get_block(keys, blocks):
        ptrs, sizes = addrs(dst["block"].ctypes.data, blocks)
        r = store.batch_get_into_multi_buffers(keys, ptrs, sizes)
        if any(x != obj for x in r):
            raise RuntimeError(f"batch_get_into_multi_buffers: {r[:4]}... (want {obj})")

    def get_session(keys, blocks):
        r = store.batch_get_session_start(keys)
        if any(x != 0 for x in r):
            raise RuntimeError(f"batch_get_session_start: {r[:4]}...")
        for layer in range(args.layers):
            r = store.batch_get_into_multi_buffer_ranges(
                keys, *layer_args(dst["session"].ctypes.data, blocks, layer))
            if any(x != piece for x in r):
                raise RuntimeError(f"batch_get_into_multi_buffer_ranges: {r[:4]}... (want {piece})")
        if store.batch_get_session_end(keys) != 0:
            raise RuntimeError("batch_get_session_end failed")

    keys = {p: [f"{tag}-{p}@layerwise@pp_rank:0@group:0@{i:064x}" for i in range(n_objects)]
            for p in ("block", "session")}
    lat: dict[str, list[float]] = {f"{p}_{op}": [] for p in ("block", "session") for op in ("put", "get")}
    phases = (("put", {"block": put_block, "session": put_session}),
              ("get", {"block": get_block, "session": get_session}))
    for op, fns in phases:
        for n, first in enumerate(range(0, n_objects, args.batch)):
            blocks = range(first, first + args.batch)
            # Alternate which path goes first, so neither always runs on a warmer cache.
            order = ("block", "session") if n % 2 == 0 else ("session", "block")
            for p in order:
                t = time.perf_counter()
                fns[p](keys[p][first : first + args.batch], blocks)
                lat[f"{p}_{op}"].append(time.perf_counter() - t)
    for p, d in dst.items():
        if not np.array_equal(src, d):
            raise RuntimeError(f"layer-wise bench: {p} loads differ from the saved bytes")
    for buf in (src, *dst.values()):
        store.unregister_buffer(buf.ctypes.data)
    store.batch_remove(keys["block"] + keys["session"], True)
    moved = n_objects * obj

    def pct(v: list[float], q: float) -> float:
        s = sorted(v)
        return s[min(len(s) - 1, int(q * len(s)))] * 1e6

    out: dict = {"objects": n_objects, "object_bytes": obj, "bytes": moved}
    for k, v in lat.items():
        out[f"{k}_gbps"] = moved / sum(v) / 1e9
        out[f"{k}_p50_us"] = pct(v, 0.5)
        out[f"{k}_p99_us"] = pct(v, 0.99)
    # `median` ranks a run's rows by put + get GB/s: the session path's.
    out["put_gbps"], out["get_gbps"] = out["session_put_gbps"], out["session_get_gbps"]
    return out


def memcpy_ceiling(args) -> dict:
    """The C library's memcpy of the very same pieces, in this process: the KV-cache layout
    (one region per layer) into and out of a page-aligned, warm "segment", batch by batch. This
    is what an in-process put/get costs with nothing else in the way (numpy copies each 16 KiB
    run with memmove), so it is the ceiling for a one-thread memcpy path such as upstream's."""
    import mmap

    import numpy as np

    piece = args.piece_kib * 1024
    obj = args.layers * piece
    n_objects = max(args.batch, (args.total_mib * MB) // obj // args.batch * args.batch)
    kv = np.random.default_rng(6).integers(0, 256, (args.layers, n_objects, piece), dtype=np.uint8)
    back = np.zeros_like(kv)
    back.fill(1)  # warm: the ceiling measures copying, not first-touch page faults
    m = mmap.mmap(-1, n_objects * obj)  # page-aligned, like a segment
    seg = np.frombuffer(m, dtype=np.uint8).reshape(n_objects, args.layers, piece)
    seg.fill(1)
    put_t = get_t = 0.0
    for first in range(0, n_objects, args.batch):
        sl = slice(first, first + args.batch)
        t = time.perf_counter()
        seg[sl] = kv[:, sl, :].transpose(1, 0, 2)
        put_t += time.perf_counter() - t
    for first in range(0, n_objects, args.batch):
        sl = slice(first, first + args.batch)
        t = time.perf_counter()
        back[:, sl, :] = seg[sl].transpose(1, 0, 2)
        get_t += time.perf_counter() - t
    if not np.array_equal(kv, back):
        raise RuntimeError("memcpy ceiling: bytes differ")
    moved = n_objects * obj
    del seg
    m.close()
    return {"put_gbps": moved / put_t / 1e9, "get_gbps": moved / get_t / 1e9}


def start_master(impl: str, bin_dir: str, tmp: str) -> tuple[Proc, str]:
    """The implementation's master on a free loopback port, ready to serve; returns it and its
    address."""
    port = free_port()
    if impl == "lunakv":
        m = Proc([str(Path(bin_dir) / "lunakv-master"), "--rpc_address=127.0.0.1", f"--rpc_port={port}",
                  "--metrics_port=0", f"--data_dir={tmp}"])
        try:
            m.wait_for("listening")
        except RuntimeError:
            m.stop()
            raise
    else:
        exe = shutil.which("mooncake_master", path=str(Path(sys.executable).parent)) or "mooncake_master"
        m = Proc([exe, f"--rpc_port={port}", "--rpc_address=127.0.0.1", f"--metrics_port={free_port()}"])
        try:
            wait_port(port)
        except RuntimeError:
            m.stop()
            raise
    return m, f"127.0.0.1:{port}"


def store_setup(store, gss: int, master: str) -> None:
    # vLLM's positional order: local_hostname, metadata_server, global_segment_size,
    # local_buffer_size, protocol, device_name, master_server_address.
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", gss, 512 * MB, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"setup: {rc}")


def segment_bytes(args) -> int:
    # The layer-wise pass stores the bytes twice (whole-block and session keys); the first
    # pass's objects are removed before it.
    copies = 1 if args.no_layerwise else 2
    need = copies * args.total_mib * MB + 64 * MB
    return max(need * 2, 512 * MB)


def worker(args) -> int:
    """One implementation, every mode; prints one JSON line per mode."""
    from mooncake.store import MooncakeDistributedStore

    impl = args.worker
    procs: list[Proc] = []
    tmp = tempfile.mkdtemp(prefix=f"mc-bench-{impl}-")
    gss = segment_bytes(args)
    try:
        m, master = start_master(impl, args.bin_dir, tmp)
        procs.append(m)
        load = os.getloadavg()[0]
        ceil = memcpy_ceiling(args)
        print("RESULT " + json.dumps({"impl": impl, "mode": "memcpy", "load": load, **ceil}), flush=True)
        for mode in args.modes.split(","):
            load = os.getloadavg()[0]
            owner = None
            if mode == "embedded":
                s = MooncakeDistributedStore()
                store_setup(s, gss, master)
            elif mode == "standalone-store":
                owner = start_owner(impl, args, master, gss, tmp)
                procs.append(owner)
                s = MooncakeDistributedStore()
                store_setup(s, 0, master)
            else:
                raise SystemExit(f"unknown mode {mode}")
            tag = f"{impl}-{'emb' if owner is None else 'sa'}"
            res = workload(s, args, tag)
            print("RESULT " + json.dumps({"impl": impl, "mode": mode, "load": load, **res}), flush=True)
            if not args.no_layerwise and hasattr(s, "batch_put_session_start"):
                s.remove_all(True)
                load = os.getloadavg()[0]
                res = layerwise_workload(s, args, tag)
                print("RESULT " + json.dumps({"impl": impl, "mode": f"{mode} layer-wise", "load": load,
                                              **res}), flush=True)
            s.close()
            if owner is not None:
                owner.stop()
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


OWNER_PY = """
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", "P2PHANDSHAKE", int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[1])
print(f"owner ready rc={rc}", flush=True)
while True:
    time.sleep(3600)
"""


def start_owner(impl: str, args, master: str, gss: int, tmp: str) -> Proc:
    """The standalone store process that owns the segment."""
    if impl == "lunakv":
        p = Proc([str(Path(args.bin_dir) / "lunakv-store"), f"--master_server_address={master}",
                  "--host=127.0.0.1", "--port=0", "--metrics_port=0",
                  f"--global_segment_size={gss // MB}MB"])
        p.wait_for("listening")
        return p
    client = shutil.which("mooncake_client", path=str(Path(sys.executable).parent))
    if client:
        p = Proc([client, "--host=127.0.0.1", f"--port={free_port()}", "--metadata_server=P2PHANDSHAKE",
                  f"--master_server_address={master}", "--protocol=tcp",
                  f"--global_segment_size={gss // MB} MB"])
        time.sleep(3)
        if p.p.poll() is None:
            return p
    # No usable mooncake_client: an embedded-mode Python process that only serves its segment.
    p = Proc([sys.executable, "-c", OWNER_PY, master, str(gss)])
    line = p.wait_for("owner ready")
    if "rc=0" not in line:
        raise RuntimeError(f"upstream owner setup failed: {line}")
    return p


# === the driver ===

def worker_commands(args, me: str, common: list[str]):
    """The two sides' worker command lines and environments: lunakv with its wheel's
    interpreter; upstream from its throwaway venv inside `unshare -n` (None when it cannot run,
    said on stdout). Returns (env, lunakv_cmd, upstream_env, upstream_cmd)."""
    # numpy's OpenBLAS threads spin after numpy calls and take a core from whichever side is
    # measured on a small box; neither side uses BLAS.
    quiet = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    env = dict(os.environ, **quiet)
    env.setdefault("LUNAKV_LOG", "error")
    lunakv_cmd = [args.lunakv_python, me, *common, "--worker", "lunakv"]
    upstream_cmd = None
    uenv: dict[str, str] = {}
    if not args.no_upstream:
        py = ensure_upstream_venv(Path(args.upstream_venv))
        if py is None:
            print("upstream unavailable: lunakv figures only (use --no-upstream to skip the attempt)")
        elif not shutil.which("unshare"):
            print("upstream skipped: `unshare` is missing (it keeps upstream's 0.0.0.0 listeners off the network)")
        else:
            uenv = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", MC_METADATA_SERVER="P2PHANDSHAKE",
                        GLOG_minloglevel="2", MC_LOG_LEVEL="ERROR", **quiet)
            inner = " ".join(["exec", str(py), me, *common, "--worker", "upstream"])
            upstream_cmd = ["unshare", "-n", "sh", "-c", f"ip link set lo up && {inner}"]
    return env, lunakv_cmd, uenv, upstream_cmd


def run_worker(cmd: list[str], env: dict[str, str], timeout: float) -> list[dict]:
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    out = [json.loads(line[7:]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    if r.returncode != 0 or not out:
        tail = "\n".join((r.stdout + r.stderr).splitlines()[-15:])
        raise RuntimeError(f"worker {cmd[-1] if cmd else ''} failed ({r.returncode}):\n{tail}")
    return out


def ensure_upstream_venv(venv: Path) -> Path | None:
    py = venv / "bin" / "python"
    probe = [str(py), "-c", "import mooncake.store, numpy"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return py
    print(f"== installing upstream {UPSTREAM_PKG} into {venv} (throwaway)", flush=True)
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", UPSTREAM_PKG, "numpy"], check=True, timeout=900)
        if subprocess.run(probe, capture_output=True).returncode == 0:
            return py
    except (subprocess.SubprocessError, OSError) as e:
        print(f"upstream install failed: {e}", flush=True)
    return None


def fmt(r: dict) -> str:
    load = f"   load {r['load']:.2f}" if "load" in r else ""
    if r["mode"] == "memcpy":
        return (f"{r['impl']:8} {'memcpy (ceiling)':17} put {r['put_gbps']:6.2f} GB/s"
                f"{'':31}get {r['get_gbps']:6.2f} GB/s{'':31}{load}")
    if "session_put_gbps" in r:
        w = max(17, len(r["mode"]))
        return "\n".join(
            f"{r['impl']:8} {r['mode'] if p == 'block' else '':{w}} {p:7} put {r[f'{p}_put_gbps']:6.2f} GB/s "
            f"(p50 {r[f'{p}_put_p50_us']:8.0f} us, p99 {r[f'{p}_put_p99_us']:8.0f} us)   get "
            f"{r[f'{p}_get_gbps']:6.2f} GB/s (p50 {r[f'{p}_get_p50_us']:8.0f} us, p99 "
            f"{r[f'{p}_get_p99_us']:8.0f} us){load if p == 'block' else ''}"
            for p in ("block", "session"))
    line = (f"{r['impl']:8} {r['mode']:17} put {r['put_gbps']:6.2f} GB/s (p50 {r['put_p50_us']:8.0f} us,"
            f" p99 {r['put_p99_us']:8.0f} us)   get {r['get_gbps']:6.2f} GB/s (p50 {r['get_p50_us']:8.0f} us,"
            f" p99 {r['get_p99_us']:8.0f} us){load}")
    if "exists_first_p50_us" in r:
        line += (f"\n{'':26} exists first p50 {r['exists_first_p50_us']:6.0f} us, p99 "
                 f"{r['exists_first_p99_us']:6.0f} us;   again p50 {r['exists_again_p50_us']:6.0f} us, "
                 f"p99 {r['exists_again_p99_us']:6.0f} us")
    return line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["lunakv", "upstream"], help=argparse.SUPPRESS)
    ap.add_argument("--modes", default="embedded,standalone-store")
    ap.add_argument("--total-mib", type=int, default=256, help="bytes moved each way per mode")
    ap.add_argument("--batch", type=int, default=32, help="objects per batch call")
    ap.add_argument("--layers", type=int, default=32, help="pieces per object")
    ap.add_argument("--piece-kib", type=int, default=16, help="bytes per piece")
    ap.add_argument("--exists-batch", type=int, default=4, help="keys per batch_is_exist call")
    ap.add_argument("--pairs", "--runs", dest="runs", type=int, default=5,
                    help="paired trials (lunakv then upstream, N times); verdicts use the median ratio")
    ap.add_argument("--cold-dst", action="store_true",
                    help="load into never-touched buffers (first-touch page faults inside the gets)")
    ap.add_argument("--no-upstream", action="store_true", help="measure lunakv only")
    ap.add_argument("--no-layerwise", action="store_true",
                    help="skip the layer-wise session rows (whole-block vs session, lunakv only)")
    ap.add_argument("--lunakv-python", default=str(REPO / ".venv" / "bin" / "python"))
    ap.add_argument("--upstream-venv", default="/tmp/mc-upstream-venv")
    ap.add_argument("--bin-dir", default=os.environ.get("LUNAKV_BIN_DIR", str(REPO / "target" / "release")))
    args = ap.parse_args()
    if args.runs < 1:
        ap.error(f"--pairs {args.runs}: use at least 1 (5 or more for a verdict that holds)")
    if args.exists_batch < 1:
        ap.error(f"--exists-batch {args.exists_batch}: use at least 1 key per call")
    if args.worker:
        return worker(args)

    common = ["--modes", args.modes, "--total-mib", str(args.total_mib), "--batch", str(args.batch),
              "--layers", str(args.layers), "--piece-kib", str(args.piece_kib), "--bin-dir", args.bin_dir,
              "--exists-batch", str(args.exists_batch),
              *(["--cold-dst"] if args.cold_dst else []),
              *(["--no-layerwise"] if args.no_layerwise else [])]
    me = str(Path(__file__).resolve())
    print(f"== workload: objects of {args.layers} x {args.piece_kib} KiB, batches of {args.batch}, "
          f"~{args.total_mib} MiB each way, modes {args.modes}, "
          f"{'cold' if args.cold_dst else 'warm'} load buffers", flush=True)

    def median(runs: list[list[dict]]) -> list[dict]:
        """Per mode, the run whose put + get is the median (put and get stay from one run)."""
        out = []
        for i in range(len(runs[0])):
            rs = sorted((r[i] for r in runs), key=lambda r: r["put_gbps"] + r["get_gbps"])
            out.append(rs[len(rs) // 2])
        return out

    env, lunakv_cmd, uenv, upstream_cmd = worker_commands(args, me, common)

    # Runs alternate between the two sides, so background load hits both alike.
    lruns: list[list[dict]] = []
    uruns: list[list[dict]] = []
    load_start = os.getloadavg()
    for i in range(args.runs):
        lruns.append(run_worker(lunakv_cmd, env, 900))
        print(f"== pair {i + 1}/{args.runs}: lunakv pass done (load {os.getloadavg()[0]:.2f})", flush=True)
        if upstream_cmd:
            try:
                uruns.append(run_worker(upstream_cmd, uenv, 1800))
                print(f"== pair {i + 1}/{args.runs}: upstream pass done (load {os.getloadavg()[0]:.2f})",
                      flush=True)
            except (RuntimeError, subprocess.SubprocessError) as e:
                print(f"upstream run failed: {e}")
                upstream_cmd = None
    lunakv = median(lruns)
    upstream = median(uruns) if uruns else []
    if args.runs > 1:
        print(f"== medians of {args.runs} alternating runs")
    for r in lunakv + upstream:
        print(fmt(r), flush=True)
    for mode in [r["mode"] for r in lunakv if r["mode"].endswith("layer-wise")]:
        ratios = layerwise_ratios(lruns, mode)
        put, get = summarize(ratios["put"]), summarize(ratios["get"])
        print(f"== {mode}: session / whole-block, median of {len(ratios['put'])} runs [min-max]: "
              f"put {put['median']:.2f}x [{put['min']:.2f}-{put['max']:.2f}]   "
              f"get {get['median']:.2f}x [{get['min']:.2f}-{get['max']:.2f}]")

    if upstream:
        load_end = os.getloadavg()
        n = len(uruns)
        print(f"== lunakv / upstream, median of {n} paired ratios [min-max] (target >= 2x); "
              f"load {load_start[0]:.2f} at start, {load_end[0]:.2f} at end")
        for mode in [r["mode"] for r in lunakv if r["mode"] != "memcpy"]:
            ratios = paired_ratios(lruns[:n], uruns, mode)
            if not ratios["put"]:
                continue
            put, get = summarize(ratios["put"]), summarize(ratios["get"])
            verdict = "ok" if min(put["median"], get["median"]) >= 2 else "BELOW 2x"
            print(f"{mode:17} put {put['median']:5.2f}x [{put['min']:.2f}-{put['max']:.2f}]   "
                  f"get {get['median']:5.2f}x [{get['min']:.2f}-{get['max']:.2f}]   {verdict}")
            print(f"{'':17} per pair: put {' '.join(f'{x:.2f}' for x in ratios['put'])}; "
                  f"get {' '.join(f'{x:.2f}' for x in ratios['get'])}")
            if ratios["exists_first"]:
                first, again = summarize(ratios["exists_first"]), summarize(ratios["exists_again"])
                verdict = "ok" if min(first["median"], again["median"]) >= 1 else "SLOWER than upstream"
                print(f"{'':17} exists p50, upstream / lunakv (target >= 1x): first "
                      f"{first['median']:5.2f}x [{first['min']:.2f}-{first['max']:.2f}]   again "
                      f"{again['median']:5.2f}x [{again['min']:.2f}-{again['max']:.2f}]   {verdict}")
    return 0


def paired_ratios(lruns: list[list[dict]], uruns: list[list[dict]], mode: str) -> dict[str, list[float]]:
    """Per pair (the i-th lunakv run and the i-th upstream run, back to back): lunakv / upstream
    for put and get GB/s, upstream / lunakv for the exists p50 latencies (so above 1 is lunakv
    faster in every ratio)."""
    out: dict[str, list[float]] = {"put": [], "get": [], "exists_first": [], "exists_again": []}
    for lr, ur in zip(lruns, uruns):
        lm = next((r for r in lr if r["mode"] == mode), None)
        um = next((r for r in ur if r["mode"] == mode), None)
        if lm is None or um is None:
            continue
        for op in ("put", "get"):
            u = um[f"{op}_gbps"]
            out[op].append(lm[f"{op}_gbps"] / u if u > 0 else 0.0)
        for op in ("exists_first", "exists_again"):
            lat = f"{op}_p50_us"
            if lat in lm and lat in um:
                out[op].append(um[lat] / lm[lat] if lm[lat] > 0 else 0.0)
    return out


def layerwise_ratios(runs: list[list[dict]], mode: str) -> dict[str, list[float]]:
    """Per run: the layer-wise session path's GB/s over the whole-block path's, both measured
    interleaved in that run's `mode` row."""
    out: dict[str, list[float]] = {"put": [], "get": []}
    for run in runs:
        r = next((r for r in run if r["mode"] == mode), None)
        if r is None:
            continue
        for op in ("put", "get"):
            b = r[f"block_{op}_gbps"]
            out[op].append(r[f"session_{op}_gbps"] / b if b > 0 else 0.0)
    return out


def summarize(v: list[float]) -> dict[str, float]:
    """Median (mean of the middle two for an even count), min and max."""
    s = sorted(v)
    m = len(s) // 2
    med = s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2
    return {"median": med, "min": s[0], "max": s[-1]}


if __name__ == "__main__":
    sys.exit(main())
