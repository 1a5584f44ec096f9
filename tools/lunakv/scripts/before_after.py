#!/usr/bin/env python3
"""Before/after `lunakv bench`: two builds' CLIs alternate run by run (each starts its own
master and store from its own directory); per row, the median of the per-pair new/old ratios
with min-max. Usage: before_after.py OLD/lunakv NEW/lunakv [PAIRS=6] [MIB_PER_ROW=64]."""
import json, os, subprocess, sys, statistics
OLD, NEW = sys.argv[1], sys.argv[2]
PAIRS = int(sys.argv[3]) if len(sys.argv) > 3 else 6
MIB = sys.argv[4] if len(sys.argv) > 4 else "64"
def pairs_flag(cli):
    """Builds with paired trials take `--pairs 1`, so both sides measure each row once."""
    h = subprocess.run([cli, "bench", "--help"], capture_output=True, text=True).stdout
    return ["--pairs", "1"] if "--pairs" in h else []
EXTRA = {OLD: pairs_flag(OLD), NEW: pairs_flag(NEW)}
def run(cli, extra):
    out = subprocess.run([cli, "bench", "--json", "--mib-per-row", MIB, *extra], capture_output=True, text=True, timeout=900)
    d = json.loads(out.stdout.strip().splitlines()[-1])
    return {r["name"]: r for r in d["rows"]}
pairs = []
load0 = os.getloadavg()[0]
for i in range(PAIRS):
    a, b = (OLD, NEW) if i % 2 == 0 else (NEW, OLD)
    ra = run(a, EXTRA[a])
    rb = run(b, EXTRA[b])
    old, new = (ra, rb) if a == OLD else (rb, ra)
    pairs.append((old, new))
    print(f"pair {i+1}/{PAIRS} done, load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
load1 = os.getloadavg()[0]
print(f"before/after: {PAIRS} pairs, {MIB} MiB per row, load {load0:.2f} -> {load1:.2f}")
print(f"{'row':24} {'old GB/s':>9} {'new GB/s':>9}  new/old GB/s median [min-max]   p50 old/new us   new/old p50 median")
for name in pairs[0][0]:
    if name not in pairs[0][1]:
        continue
    g = [n[name]["gbps"] / o[name]["gbps"] for o, n in pairs if o[name]["gbps"] > 0]
    p = [n[name]["p50_us"] / o[name]["p50_us"] for o, n in pairs if o[name]["p50_us"] > 0]
    og = statistics.median(o[name]["gbps"] for o, _ in pairs); ng = statistics.median(n[name]["gbps"] for _, n in pairs)
    op = statistics.median(o[name]["p50_us"] for o, _ in pairs); np_ = statistics.median(n[name]["p50_us"] for _, n in pairs)
    print(f"{name:24} {og:9.2f} {ng:9.2f}  {statistics.median(g):5.2f}x [{min(g):.2f}-{max(g):.2f}]   {op:8.0f} / {np_:8.0f}   {statistics.median(p):5.2f}x [{min(p):.2f}-{max(p):.2f}]")
allg = [statistics.median([n[k]["gbps"] / o[k]["gbps"] for o, n in pairs]) for k in pairs[0][0] if k in pairs[0][1]]
print(f"median over rows of the median new/old GB/s: {statistics.median(allg):.3f}")
