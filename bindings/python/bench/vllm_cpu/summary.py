#!/usr/bin/env python3
"""Summary of pairs.sh runs: RUNDIR/pairI-IMPL/result.json (client.py) and serve.log (vLLM).

  1. per pair and phase (quiet, busy) and request kind (miss: computed and saved; hit: loaded
     from the store), each arm's TTFT p50 and their ratio A/B, with the CPU the rest of the
     machine used meanwhile (foreign cores); then the median ratio over pairs.
  2. TTFT p50/p90/p99 pooled over the pairs, and the cached_tokens vLLM reported (hits should
     say 512: the connector loaded the blocks).
  3. the Worker process's threads (where the connector and the store client run) and the
     EngineCore's, medians over runs: count, CPU ms, voluntary and nonvoluntary context switches
     per request, grouped.
  4. vLLM's own "KV Transfer metrics" log lines: per store op, count-weighted mean latency and
     the median of the per-window p90s.

Usage: summary.py [--impls A,B] RUNDIR...   (stdlib only)
"""
import argparse
import collections
import glob
import json
import os
import statistics

ap = argparse.ArgumentParser()
ap.add_argument("--impls", default="lunakv,upstream", help="A,B: the ratio is A/B")
ap.add_argument("rundirs", nargs="+")
args = ap.parse_args()
A, B = args.impls.split(",")

res = []
for d in args.rundirs:
    for f in sorted(glob.glob(os.path.join(d, "pair*", "result.json"))):
        with open(f) as fh:
            r = json.load(fh)
        r["pair"] = os.path.basename(os.path.normpath(d)) + "/" + os.path.basename(os.path.dirname(f)).split("-")[0]
        res.append(r)
if not res:
    raise SystemExit(f"no pair*/result.json under {' '.join(args.rundirs)}")


def ms(v, q):
    v = sorted(x for x in v if x is not None)
    return v[min(len(v) - 1, int(q * len(v)))] * 1000 if v else float("nan")


def p50(v):
    v = [x for x in v if x is not None]
    return statistics.median(v) * 1000 if v else float("nan")


phases = sorted({p for r in res for p in r["phases"]}, key=lambda p: p != "quiet")

print(f"== 1. TTFT p50 per pair, {A} / {B} (foreign cores {A}/{B})")
pairs = collections.OrderedDict()
for r in res:
    pairs.setdefault(r["pair"], {})[r["impl"]] = r
for ph in phases:
    for kind in ("miss", "hit"):
        ratios = []
        print(f"  {ph} {kind}:")
        for pair, d in pairs.items():
            if A not in d or B not in d or ph not in d[A]["phases"] or ph not in d[B]["phases"]:
                continue
            pa, pb = d[A]["phases"][ph], d[B]["phases"][ph]
            a, b = p50(pa[f"{kind}_ttft"]), p50(pb[f"{kind}_ttft"])
            ratios.append(a / b)
            print(f"    {pair:28} {a:7.1f} / {b:7.1f} ms  ratio {a / b:5.2f}"
                  f"   ({pa.get('foreign_cores', float('nan')):.2f}/{pb.get('foreign_cores', float('nan')):.2f})")
        if ratios:
            print(f"    median ratio {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}], "
                  f"{A} slower in {sum(1 for x in ratios if x > 1)} of {len(ratios)} pairs")

print("\n== 2. TTFT pooled over pairs (ms)")
for ph in phases:
    for kind in ("miss", "hit"):
        for impl in (A, B):
            rs = [r for r in res if r["impl"] == impl and ph in r["phases"]]
            if not rs:
                continue
            allv = [x for r in rs for x in r["phases"][ph][f"{kind}_ttft"] if x is not None]
            cached = sorted({c for r in rs for c in r["phases"][ph][f"{kind}_cached"]}, key=str)
            print(f"  {ph:5} {kind:4} {impl:9} n={len(allv):4}  p50 {ms(allv, .5):6.1f}  p90 {ms(allv, .9):6.1f}"
                  f"  p99 {ms(allv, .99):6.1f}  cached_tokens {cached}")

print("\n== 3. threads, medians over runs: count, CPU ms / voluntary / nonvoluntary switches per request")
print("   main: the busiest VLLM::Worker thread; omp1: the 2nd; other VLLM::Worker: vLLM's Python")
print("   threads and upstream's unnamed C++ threads; lunakv-*: lunakv's named threads")
acc = collections.defaultdict(lambda: collections.defaultdict(list))
for r in res:
    for ph, P in r["phases"].items():
        nreq = len(P["miss_ttft"]) + len(P["hit_ttft"])
        rows = sorted(P["per_thread"].get("worker", []), key=lambda x: -x["cpu_ms"])
        vw = [x for x in rows if x["name"] == "VLLM::Worker"]
        groups = {"worker, all": rows, "  main": vw[:1], "  omp1": vw[1:2], "  other VLLM::Worker": vw[2:],
                  "  lunakv-*": [x for x in rows if x["name"].startswith("lunakv")],
                  "  gloo/zmq/pt": [x for x in rows if x["name"].startswith(("gloo", "pt_", "ZMQ"))],
                  "engine core, all": P["per_thread"].get("engine", [])}
        for g, xs in groups.items():
            acc[(r["impl"], ph)][g].append((len(xs), sum(x["cpu_ms"] for x in xs) / nreq,
                                            sum(x["vol"] for x in xs) / nreq, sum(x["nonvol"] for x in xs) / nreq))
for k in sorted(acc, key=lambda k: (k[1] != "quiet", k[0] != A)):
    print(f"  {k[0]} {k[1]} ({len(acc[k]['worker, all'])} runs)")
    for g, v in acc[k].items():
        m = [statistics.median(c) for c in zip(*v)]
        print(f"    {g:22} n={m[0]:3.0f}  cpu {m[1]:6.2f} ms  vol {m[2]:6.1f}  nonvol {m[3]:6.1f}")

print("\n== 4. vLLM's KV Transfer metrics (serve.log): count, mean of averages, median window p90")
kv = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0, []]))
for d in args.rundirs:
    for f in sorted(glob.glob(os.path.join(d, "pair*", "serve.log"))):
        impl = os.path.basename(os.path.dirname(f)).split("-", 1)[1]
        with open(f, errors="replace") as fh:
            for line in fh:
                if "KV Transfer metrics:" not in line:
                    continue
                m = dict(x.strip().split("=", 1) for x in line.split("KV Transfer metrics:")[1].split(",") if "=" in x)
                for op in ("lookup_exists", "save_exists", "save_put", "load_get"):
                    n = int(m.get(f"{op}_count", 0))
                    if n:
                        a = kv[impl][op]
                        a[0] += n
                        a[1] += n * float(m[f"{op}_avg_ms"])
                        a[2].append(float(m[f"{op}_p90_ms"]))
for impl, ops in sorted(kv.items()):
    for op, a in ops.items():
        print(f"  {impl:9} {op:14} n={a[0]:5}  avg {a[1] / a[0]:7.2f} ms  p90 {statistics.median(a[2]):7.2f} ms")
if not kv:
    print("  (none logged)")
