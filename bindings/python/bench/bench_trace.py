#!/usr/bin/env python3
"""Hits on real traffic from Python, lunakv vs upstream in the same run (issue 31).

Replays a Mooncake-format request trace (one JSON object per line: `input_length`, `hash_ids`,
one id per 512-token block) through the `mooncake.store` calls vLLM's MooncakeStoreConnector
makes per request, against each implementation's own master and one embedded segment of the
pool's size, with every master setting at its default:

  batch_is_exist   over the request's block keys; the leading run of hits is the prefix hit
  batch_get_into   of that run, every byte compared with what was put (a block is a function
                   of its id)
  batch_put_from   of every block after the usable run that the pool does not hold

A request's hit tokens are min(512 x the run read back, input_length); the hit rate is hit
tokens over input tokens. Beside both, computed here for the same capacity: the maximum (an
infinite cache) and offline LRU (as `lunakv bench --trace` computes them; Belady is there).

The two sides run as bench_meta.py runs them: lunakv with the wheel's interpreter (<repo>/.venv)
and target/release binaries; upstream (mooncake-transfer-engine-non-cuda, in the throwaway venv
/tmp/mc-upstream-venv) inside `unshare -n`. --pairs N alternates them, lunakv first; the verdict
is the median per-pair ratio of hit rates. The issue's target: >= 1.3x upstream's at 3M tokens.

    bindings/python/build.sh bench-trace        # release wheel + binaries, then this
    python bench_trace.py [--trace FILE] [--capacity-tokens 3000000] [--first N] [--pairs 1]
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
from collections import OrderedDict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_store import (  # noqa: E402
    run_worker,
    start_master,
    store_setup,
    worker_commands,
)

REPO = HERE.parents[2]
BLOCK_TOKENS = 512
DEFAULT_TRACE = REPO.parent / "shared" / "data" / "mooncake-traces" / "conversation_trace.jsonl"


def load(path: str, first: int) -> list[dict]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                out.append({"input_length": int(r["input_length"]),
                            "hash_ids": [int(h) for h in r["hash_ids"]]})
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"{path}:{n}: not a Mooncake trace line ({e}); each line needs "
                                 "input_length and hash_ids")
            if first and len(out) >= first:
                break
    return out


def hit_tokens(r: dict, run: int) -> int:
    return min(run * BLOCK_TOKENS, r["input_length"])


def offline(trace: list[dict], capacity: int) -> dict:
    """The maximum (infinite cache) and LRU holding `capacity` blocks, in request order."""
    total = sum(r["input_length"] for r in trace) or 1
    seen: set[int] = set()
    lru: OrderedDict[int, None] = OrderedDict()
    hit_max = hit_lru = 0
    for r in trace:
        ids = r["hash_ids"]
        run = 0
        while run < len(ids) and ids[run] in seen:
            run += 1
        hit_max += hit_tokens(r, run)
        seen.update(ids)
        run = 0
        while run < len(ids) and ids[run] in lru:
            run += 1
        hit_lru += hit_tokens(r, run)
        for h in ids:
            lru[h] = None
            lru.move_to_end(h)
            if len(lru) > capacity:
                lru.popitem(last=False)
    return {"max": hit_max / total, "lru": hit_lru / total}


# === a worker: one master, one embedded segment, the replay ===

def worker(args) -> int:
    import numpy as np
    from mooncake.store import MooncakeDistributedStore

    trace = load(args.trace, args.first)
    bb = args.block_bytes
    blocks = args.capacity_tokens // BLOCK_TOKENS
    tmp = tempfile.mkdtemp(prefix=f"mc-trace-{args.worker}-")
    m = None
    try:
        m, master = start_master(args.worker, args.bin_dir, tmp)
        s = MooncakeDistributedStore()
        store_setup(s, blocks * bb, master)
        widest = max(len(r["hash_ids"]) for r in trace)
        src = np.zeros((widest, bb), dtype=np.uint8)
        dst = np.zeros((widest, bb), dtype=np.uint8)
        for buf in (src, dst):
            if s.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
                raise RuntimeError("register_buffer failed")

        def fill(row: np.ndarray, h: int) -> None:
            # A function of the id only: the id in every 8-byte word, mixed with its position.
            words = row.view(np.uint64)
            words[:] = np.arange(len(words), dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            words ^= np.uint64(h & 0xFFFFFFFFFFFFFFFF)

        want = np.zeros(bb, dtype=np.uint8)
        out = {"impl": args.worker, "requests": len(trace), "hit_tokens": 0, "blocks_read": 0,
               "blocks_put": 0, "false_present": 0, "wrong_bytes": 0, "put_errors": {}}
        t0 = time.perf_counter()
        for r in trace:
            ids = r["hash_ids"]
            keys = [f"trace-block-{h:016x}" for h in ids]
            present = s.batch_is_exist(keys)
            run = 0
            while run < len(ids) and present[run] == 1:
                run += 1
            read = 0
            if run:
                got = s.batch_get_into(keys[:run], [dst.ctypes.data + i * bb for i in range(run)],
                                       [bb] * run)
                for i, g in enumerate(got):
                    if g != bb:
                        out["false_present"] += 1
                        break
                    fill(want, ids[i])
                    if not np.array_equal(dst[i], want):
                        out["wrong_bytes"] += 1
                        break
                    read += 1
            out["blocks_read"] += read
            out["hit_tokens"] += hit_tokens(r, read)
            missing = [i for i in range(read, len(ids)) if i < run or present[i] != 1]
            if missing:
                for j, i in enumerate(missing):
                    fill(src[j], ids[i])
                rcs = s.batch_put_from([keys[i] for i in missing],
                                       [src.ctypes.data + j * bb for j in range(len(missing))],
                                       [bb] * len(missing))
                for rc in rcs:
                    if rc == 0:
                        out["blocks_put"] += 1
                    elif rc != -705:  # OBJECT_ALREADY_EXISTS: another copy landed first
                        out["put_errors"][str(rc)] = out["put_errors"].get(str(rc), 0) + 1
        out["seconds"] = time.perf_counter() - t0
        out["requests_s"] = len(trace) / out["seconds"]
        out["hit_rate"] = out["hit_tokens"] / max(1, sum(r["input_length"] for r in trace))
        out["load"] = os.getloadavg()[0]
        s.close()
        print("RESULT " + json.dumps(out), flush=True)
    finally:
        if m is not None:
            m.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


# === the driver ===

def fmt(r: dict, off: dict) -> str:
    errs = ", ".join(f"{k}: {v}" for k, v in sorted(r["put_errors"].items())) or "none"
    return (f"{r['impl']:8} hit rate {r['hit_rate']:.4f} ({r['hit_rate'] / off['max']:.0%} of the max, "
            f"{r['hit_rate'] / off['lru']:.2f}x offline LRU)  {r['requests_s']:6.0f} requests/s  "
            f"false present {r['false_present']}  wrong {r['wrong_bytes']}  put errors {errs}  "
            f"load {r['load']:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["lunakv", "upstream"], help=argparse.SUPPRESS)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE), help="a Mooncake-format trace (JSON lines)")
    ap.add_argument("--capacity-tokens", type=int, default=3_000_000, help="the pool, in tokens")
    ap.add_argument("--block-bytes", type=int, default=16384, help="bytes that stand for 512 tokens")
    ap.add_argument("--first", type=int, default=0, help="only the first N requests (0: all)")
    ap.add_argument("--pairs", type=int, default=1, help="paired trials (lunakv then upstream, N times)")
    ap.add_argument("--no-upstream", action="store_true", help="measure lunakv only")
    ap.add_argument("--json", action="store_true", help="every run, the offline figures and the ratios as JSON")
    ap.add_argument("--lunakv-python", default=str(REPO / ".venv" / "bin" / "python"))
    ap.add_argument("--upstream-venv", default="/tmp/mc-upstream-venv")
    ap.add_argument("--bin-dir", default=os.environ.get("LUNAKV_BIN_DIR", str(REPO / "target" / "release")))
    args = ap.parse_args()
    if args.block_bytes < 8 or args.block_bytes % 8:
        ap.error(f"--block-bytes {args.block_bytes}: use a multiple of 8")
    if args.capacity_tokens < BLOCK_TOKENS:
        ap.error(f"--capacity-tokens {args.capacity_tokens}: use at least one block ({BLOCK_TOKENS})")
    if not Path(args.trace).is_file():
        ap.error(f"--trace {args.trace}: no such file")
    if args.worker:
        return worker(args)

    trace = load(args.trace, args.first)
    off = offline(trace, args.capacity_tokens // BLOCK_TOKENS)
    common = ["--trace", args.trace, "--capacity-tokens", str(args.capacity_tokens),
              "--block-bytes", str(args.block_bytes), "--first", str(args.first),
              "--bin-dir", args.bin_dir]
    me = str(Path(__file__).resolve())
    env, lunakv_cmd, uenv, upstream_cmd = worker_commands(args, me, common)
    print(f"== {Path(args.trace).name}: {len(trace)} requests, pool {args.capacity_tokens} tokens "
          f"({args.capacity_tokens // BLOCK_TOKENS} blocks of {args.block_bytes} bytes), master defaults; "
          f"offline: max {off['max']:.4f}, LRU {off['lru']:.4f}", flush=True)
    timeout = 600 + len(trace) / 10
    lruns: list[dict] = []
    uruns: list[dict] = []
    for i in range(args.pairs):
        (r,) = run_worker(lunakv_cmd, env, timeout)
        lruns.append(r)
        print(fmt(r, off), flush=True)
        if upstream_cmd:
            try:
                (r,) = run_worker(upstream_cmd, uenv, timeout)
            except (RuntimeError, subprocess.SubprocessError, ValueError) as e:
                print(f"upstream run failed: {e}")
                upstream_cmd = None
                continue
            uruns.append(r)
            print(fmt(r, off), flush=True)
    ratio = [lr["hit_rate"] / ur["hit_rate"] for lr, ur in zip(lruns, uruns) if ur["hit_rate"] > 0]
    if ratio:
        print(f"== lunakv / upstream hit rate: {statistics.median(ratio):.2f}x "
              f"[{min(ratio):.2f}-{max(ratio):.2f}] over {len(ratio)} pair(s)")
    if args.json:
        print(json.dumps({"offline": off, "lunakv": lruns, "upstream": uruns, "ratio": ratio}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
