#!/usr/bin/env python3
"""Time to first token of miss requests (a prompt never seen: vLLM computes it and the connector
saves its KV blocks) and hit requests (the same prompt again; vLLM's local prefix cache is off, so
the connector loads the blocks from the store) against a running `vllm serve`, first quiet, then
beside two busy loops; and per phase the threads, context switches and CPU time of the
EngineCore and Worker processes. Writes OUT/result.json (summary.py reads it).
Started by arm.sh."""
import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--impl", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--server-pid", type=int, required=True)
ap.add_argument("--n", type=int, default=30, help="miss (and hit) requests per phase")
ap.add_argument("--tokens", type=int, default=520)
ap.add_argument("--gap", type=float, default=0.2)
ap.add_argument("--phases", default="quiet,busy")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--max-tokens", type=int, default=4)
args = ap.parse_args()
HZ = os.sysconf("SC_CLK_TCK")

def children(pid):
    out = []
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            out += [int(c) for c in open(f"/proc/{pid}/task/{t}/children").read().split()]
        except OSError:
            pass
    return out

def find_procs(pid):
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += children(p)
    found = {}
    for p in seen:
        try:
            cmd = open(f"/proc/{p}/cmdline").read()
            comm = open(f"/proc/{p}/comm").read().strip()
        except OSError:
            continue
        if "EngineCore" in cmd or "EngineCore" in comm:
            found["engine"] = p
        if "Worker" in cmd or "Worker" in comm:
            found["worker"] = p
    return found

def threads(pid):
    """{tid: (name, vol, nonvol, cpu_ticks)}"""
    res = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            st = open(f"/proc/{pid}/task/{t}/status").read().splitlines()
            stat = open(f"/proc/{pid}/task/{t}/stat").read()
        except OSError:
            continue
        d = dict(l.split(":\t", 1) for l in st if ":\t" in l)
        f = stat[stat.rindex(")") + 2:].split()
        res[int(t)] = (d["Name"].strip(), int(d["voluntary_ctxt_switches"]), int(d["nonvoluntary_ctxt_switches"]),
                       int(f[11]) + int(f[12]))
    return res

def proc_cpu_ticks(pid):
    try:
        f = open(f"/proc/{pid}/stat").read()
        f = f[f.rindex(")") + 2:].split()
        return int(f[11]) + int(f[12])
    except (OSError, ValueError):
        return 0

def tree(pid):
    todo, seen = [pid], []
    while todo:
        p = todo.pop(); seen.append(p)
        try:
            todo += children(p)
        except OSError:
            pass
    return seen

def sys_busy_ticks():
    f = open("/proc/stat").readline().split()[1:]
    v = [int(x) for x in f]
    return sum(v) - v[3] - v[4]  # minus idle, iowait

def delta(a, b):
    rows = []
    for tid, (name, v, nv, cpu) in b.items():
        a0 = a.get(tid, (name, 0, 0, 0))
        rows.append({"tid": tid, "name": name, "vol": v - a0[1], "nonvol": nv - a0[2], "cpu_ms": (cpu - a0[3]) * 1000 / HZ})
    return rows

def prompt(tag):
    r = random.Random(tag)
    return " ".join(f"w{r.randrange(3, 2048)}" for _ in range(args.tokens))

def request(p):
    c = http.client.HTTPConnection("127.0.0.1", 8000, timeout=60)
    body = json.dumps({"model": "tiny", "prompt": p, "max_tokens": args.max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    global last_t0_ns
    t0 = time.perf_counter()
    last_t0_ns = time.monotonic_ns()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    ttft = None
    cached = None
    while True:
        line = r.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            d = line[6:].strip()
            if d == b"[DONE]":
                break
            j = json.loads(d)
            if ttft is None and j.get("choices") and j["choices"][0].get("text") is not None:
                ttft = time.perf_counter() - t0
            u = j.get("usage")
            if u:
                cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    total = time.perf_counter() - t0
    c.close()
    return ttft, total, cached

procs = find_procs(args.server_pid)
print("procs", procs, flush=True)
run_id = f"{args.impl}-{args.seed}-{time.time_ns()}"
# warm-up: a few misses and hits, not recorded
for i in range(4):
    request(prompt(f"{run_id}-warm{i}"))
    time.sleep(args.gap)
for i in range(4):
    request(prompt(f"{run_id}-warm{i}"))
    time.sleep(args.gap)

results = {"impl": args.impl, "procs": procs, "phases": {}}
for phase in args.phases.split(","):
    busy = []
    if phase == "busy":
        busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(2)]
        time.sleep(1.0)
    load0 = os.getloadavg()[0]
    t_before = {k: threads(p) for k, p in procs.items()}
    ours = tree(args.server_pid) + [os.getpid()] + [b.pid for b in busy]
    ours_cpu0 = sum(proc_cpu_ticks(p) for p in ours); sys0 = sys_busy_ticks()
    t0 = time.perf_counter()
    miss, hit, miss_tot, hit_tot, hit_cached, miss_cached = [], [], [], [], [], []
    events = []
    for i in range(args.n + 1):
        if i < args.n:
            ttft, tot, cached = request(prompt(f"{run_id}-{phase}-{i}"))
            miss.append(ttft); miss_tot.append(tot); miss_cached.append(cached)
            events.append(("miss", i, last_t0_ns, ttft, tot))
            time.sleep(args.gap)
        if i > 0:
            ttft, tot, cached = request(prompt(f"{run_id}-{phase}-{i-1}"))
            hit.append(ttft); hit_tot.append(tot); hit_cached.append(cached)
            events.append(("hit", i - 1, last_t0_ns, ttft, tot))
            time.sleep(args.gap)
    wall = time.perf_counter() - t0
    t_after = {k: threads(p) for k, p in procs.items()}
    ours_cpu1 = sum(proc_cpu_ticks(p) for p in ours); sys1 = sys_busy_ticks()
    foreign_cores = ((sys1 - sys0) - (ours_cpu1 - ours_cpu0)) / HZ / wall
    load1 = os.getloadavg()[0]
    for b in busy:
        b.kill(); b.wait()
    results["phases"][phase] = {"miss_ttft": miss, "hit_ttft": hit, "miss_total": miss_tot, "hit_total": hit_tot,
                                "miss_cached": miss_cached, "hit_cached": hit_cached, "events": events, "wall_s": wall, "foreign_cores": foreign_cores,
                                "load": [load0, load1], "threads_before": {k: len(v) for k, v in t_before.items()},
                                "threads_after": {k: len(v) for k, v in t_after.items()},
                                "per_thread": {k: delta(t_before[k], t_after[k]) for k in procs}}
    def pct(v, q):
        v = sorted(v); return v[min(len(v) - 1, int(q * len(v)))] * 1000
    print(f"{args.impl} {phase}: miss p50 {pct(miss,.5):.1f} p99 {pct(miss,.99):.1f} ms; hit p50 {pct(hit,.5):.1f} "
          f"p99 {pct(hit,.99):.1f} ms; hit cached {hit_cached[:3]} miss cached {miss_cached[:3]}; threads {dict((k, len(v)) for k, v in t_after.items())}; load {load0:.1f}-{load1:.1f}; foreign cores {foreign_cores:.2f}", flush=True)
json.dump(results, open(os.path.join(args.out, "result.json"), "w"))
