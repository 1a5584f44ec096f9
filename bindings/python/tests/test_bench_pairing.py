"""The paired-trial arithmetic of bench/bench_store.py (pure functions, nothing timed)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "bench_store", Path(__file__).resolve().parents[1] / "bench" / "bench_store.py"
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def run(mode, put, get, exists_us=None):
    row = {"mode": mode, "put_gbps": put, "get_gbps": get}
    if exists_us is not None:
        row["exists_first_p50_us"], row["exists_again_p50_us"] = exists_us
    return [{"mode": "memcpy", "put_gbps": 9.0, "get_gbps": 9.0}, row]


def test_ratios_pair_the_ith_runs_of_each_side():
    lruns = [run("embedded", 4.0, 6.0), run("embedded", 1.0, 6.0), run("embedded", 4.0, 3.0)]
    uruns = [run("embedded", 1.0, 2.0), run("embedded", 1.0, 2.0), run("embedded", 2.0, 1.0)]
    r = bench.paired_ratios(lruns, uruns, "embedded")
    assert r == {"put": [4.0, 1.0, 2.0], "get": [3.0, 3.0, 3.0], "exists_first": [], "exists_again": []}
    # The median ignores the one pair a neighbour's burst hit.
    assert bench.summarize(r["put"]) == {"median": 2.0, "min": 1.0, "max": 4.0}


def test_summarize_even_count_and_missing_mode():
    assert bench.summarize([1.0, 4.0, 2.0, 3.0])["median"] == 2.5
    assert bench.paired_ratios([run("embedded", 1, 1)], [run("standalone-store", 1, 1)], "embedded") == {
        "put": [],
        "get": [],
        "exists_first": [],
        "exists_again": [],
    }


def test_exists_ratios_are_upstream_latency_over_lunakvs():
    lruns = [run("embedded", 1, 1, (200.0, 10.0)), run("embedded", 1, 1, (400.0, 20.0))]
    uruns = [run("embedded", 1, 1, (300.0, 300.0)), run("embedded", 1, 1, (200.0, 200.0))]
    r = bench.paired_ratios(lruns, uruns, "embedded")
    assert r["exists_first"] == [1.5, 0.5]
    assert r["exists_again"] == [30.0, 10.0]


def layerwise_row(block, session):
    row = {"impl": "lunakv", "mode": "embedded layer-wise", "load": 0.5}
    for p, (put, get) in (("block", block), ("session", session)):
        for op, v in (("put", put), ("get", get)):
            row[f"{p}_{op}_gbps"] = v
            row[f"{p}_{op}_p50_us"] = row[f"{p}_{op}_p99_us"] = 100.0
    return row


def test_layerwise_ratios_are_session_over_block_within_each_run():
    runs = [
        [{"mode": "memcpy"}, layerwise_row((4.0, 8.0), (2.0, 8.0))],
        [{"mode": "memcpy"}, layerwise_row((2.0, 4.0), (2.0, 2.0))],
        [{"mode": "memcpy"}],
    ]
    r = bench.layerwise_ratios(runs, "embedded layer-wise")
    assert r == {"put": [0.5, 1.0], "get": [1.0, 0.5]}
    # One row, two lines: the whole-block path, then the session path.
    lines = bench.fmt(runs[0][1]).splitlines()
    assert len(lines) == 2 and "block" in lines[0] and "session" in lines[1]
