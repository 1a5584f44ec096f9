"""bench/bench_meta.py: a small real run against the real lunakv-master (lunakv side only), and
the ratio arithmetic. Nothing here judges a timing."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import BIN_DIR

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_meta.py"
_spec = importlib.util.spec_from_file_location("bench_meta", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
sys.path.insert(0, str(SCRIPT.parent))
_spec.loader.exec_module(bench)


def test_keys_are_vllm_shaped():
    k = bench.vllm_key(1, 255)
    assert k.startswith("Qwen/Qwen3-8B@tp_rank:1@pcp0@dcp0@pp_rank:0@group:0@")
    assert k.endswith("0" * 62 + "ff")
    assert 100 <= len(k) <= 130


def test_a_small_run_measures_every_phase_of_the_real_master():
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--no-upstream", "--keys", "640", "--clients", "2", "--batch", "32",
         "--lunakv-python", sys.executable, "--bin-dir", str(BIN_DIR), "--json"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, LUNAKV_LOG="error"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    (run,) = out["lunakv"]
    assert out["upstream"] == [] and out["ratios"] == {}
    assert run["keys"] == 640 and run["clients"] == 2
    # The master holds 640 more objects after the puts than before.
    assert run["rss_after"] > 0 and run["rss_before"] > 0
    for phase in ("put", "exists", "replicas"):
        p = run[phase]
        assert p["ops_s"] > 0 and 0 < p["p50_us"] <= p["p99_us"], (phase, p)
        # The master did the work: its CPU time moved during every phase.
        assert p["cpu_s"] > 0, (phase, p)


def test_ratios_are_lunakv_over_upstream_per_pair():
    def run(bpk, put, exists, replicas):
        r = {"bytes_per_key": bpk}
        for phase, v in (("put", put), ("exists", exists), ("replicas", replicas)):
            r[phase] = {"ops_per_cpu_s": v, "ops_s": v * 10}
        return r

    lr = [run(200, 40, 60, 80), run(300, 20, 60, 80)]
    ur = [run(800, 10, 30, 40), run(600, 10, 60, 20)]
    r = bench.ratios(lr, ur)
    assert r["bytes_per_key"] == [0.25, 0.5]
    assert r["put_ops_per_cpu_s"] == [4.0, 2.0]
    assert r["exists_ops_s"] == [2.0, 1.0]
    assert r["replicas_ops_per_cpu_s"] == [2.0, 4.0]
