"""bench/bench_cluster.py: a small real run, stores and requesters in their own network
namespaces. It checks what the row reports (placement balance, gets surviving a killed store),
never a timing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BIN_DIR

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_cluster.py"


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_a_small_cluster_spreads_evenly_and_replicas_survive_a_killed_store():
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--stores", "1,3", "--requesters", "2", "--total-mib", "24",
         "--object-kib", "256", "--pairs", "1", "--rounds", "1", "--limit-mib", "16",
         "--lunakv-python", sys.executable, "--bin-dir", str(BIN_DIR), "--json"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, LUNAKV_LOG="error"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(r.stdout.strip().splitlines()[-1])["rows"]
    assert [row["stores"] for row in rows] == [1, 3]
    per_req = 24 * 1024 // 256 // 2
    for row in rows:
        for rep in ("r1", "r2"):
            assert row[rep]["get_gbps"]["median"] > 0 and row[rep]["tcp_limit_gbps"]["median"] > 0
        # replica_num 1 and 2 objects of both requesters; one store holds one copy of each.
        copies = 2 * per_req * (1 + min(2, row["stores"]))
        assert sum(row["objects_per_store"]) == copies, row
    one, three = rows
    assert "after_kill" not in one["r1"], "nothing is killed with one store"
    # free_ratio_first over equal stores: within a batch's worth of even.
    assert three["balance_max_min"] <= 1.1, three["objects_per_store"]
    both = three["r2"]["after_kill"]
    assert both == {"ok": 2 * per_req, "failed": 0, "wrong": 0}, "every object has a live replica"
    single = three["r1"]["after_kill"]
    assert single["wrong"] == 0 and single["ok"] + single["failed"] == 2 * per_req, single
    assert 0 < single["failed"] < 2 * per_req, "the killed store held some, not all, single copies"
