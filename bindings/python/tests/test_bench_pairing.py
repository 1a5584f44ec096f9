"""The paired-trial arithmetic of bench/bench_store.py (pure functions, nothing timed)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "bench_store", Path(__file__).resolve().parents[1] / "bench" / "bench_store.py"
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def run(mode, put, get):
    return [{"mode": "memcpy", "put_gbps": 9.0, "get_gbps": 9.0}, {"mode": mode, "put_gbps": put, "get_gbps": get}]


def test_ratios_pair_the_ith_runs_of_each_side():
    lruns = [run("embedded", 4.0, 6.0), run("embedded", 1.0, 6.0), run("embedded", 4.0, 3.0)]
    uruns = [run("embedded", 1.0, 2.0), run("embedded", 1.0, 2.0), run("embedded", 2.0, 1.0)]
    r = bench.paired_ratios(lruns, uruns, "embedded")
    assert r == {"put": [4.0, 1.0, 2.0], "get": [3.0, 3.0, 3.0]}
    # The median ignores the one pair a neighbour's burst hit.
    assert bench.summarize(r["put"]) == {"median": 2.0, "min": 1.0, "max": 4.0}


def test_summarize_even_count_and_missing_mode():
    assert bench.summarize([1.0, 4.0, 2.0, 3.0])["median"] == 2.5
    assert bench.paired_ratios([run("embedded", 1, 1)], [run("standalone-store", 1, 1)], "embedded") == {
        "put": [],
        "get": [],
    }
