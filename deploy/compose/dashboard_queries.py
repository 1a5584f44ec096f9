#!/usr/bin/env python3
"""Runs every PromQL expression of every panel of deploy/grafana/*.json against a real Prometheus.

    dashboard_queries.py PROMETHEUS_URL [DASHBOARD.json ...]

Part of `make e2e-compose` (deploy/compose/e2e.sh), after the stack has served P/D completions,
puts and gets and SSD-tier evictions, so the dashboards' metrics have values. For each query
it prints `ok`, `excluded` or `FAIL` and a reason:

- every expression must parse (HTTP 200, status "success") and return data (a non-empty
  result), except those in EXCLUDED, which name the reason the run cannot make their data;
- an EXCLUDED expression that does return data fails too: the exclusion is stale;
- every query template variable (`label_values(up, job)`) must return values.

Template variables are expanded as Grafana does with "All" selected: `$job` (includeAll,
allValue ".*") becomes `.*`; Grafana's interval variables become fixed ranges. Python's
standard library only (the e2e runs on the host's python3).
"""

import json
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

# Expressions the e2e cannot give data, by (dashboard file, expression as written in the JSON),
# with the reason; each entry is checked to still return nothing, so the list stays true.
# Empty: e2e.sh feeds every panel (P/D through the sidecar, puts and gets, SSD-tier evictions, a
# vLLM-shaped key found by a second client for the key-namespace panels). A new panel whose data
# the stack cannot make goes here, e.g.
#   ("lunakv-ha.json", 'sum(rate(master_failovers_total{job=~"$job"}[5m]))'):
#       "one master in compose: no failover happens",
EXCLUDED = {}

# Grafana's built-in interval variables, as a dashboard would resolve them over the last hour.
BUILTINS = {
    "$__rate_interval": "1m",
    "${__rate_interval}": "1m",
    "$__interval": "15s",
    "${__interval}": "15s",
    "$__range": "1h",
    "${__range}": "1h",
}


def panels(ps):
    for p in ps:
        yield p
        yield from panels(p.get("panels", []))


def variables(dashboard):
    """name -> the value an "All" selection expands to."""
    out = {}
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            out[v["name"]] = v.get("allValue") or ".*"
    return out


def expand(expr, values):
    for k, v in BUILTINS.items():
        expr = expr.replace(k, v)
    for name, v in values.items():
        expr = re.sub(r"\$\{" + re.escape(name) + r"(:[a-z]+)?\}", v, expr)
        expr = re.sub(r"\$" + re.escape(name) + r"\b", v, expr)
    return expr


def query(base, expr):
    """(ok, result list or error text)."""
    url = base.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:
        try:
            body = json.load(e)
        except ValueError:
            return False, f"HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return False, str(e)
    if body.get("status") != "success":
        return False, f"{body.get('errorType')}: {body.get('error')}"
    return True, body["data"]["result"]


def label_values(base, label, match):
    url = (
        base.rstrip("/")
        + f"/api/v1/label/{urllib.parse.quote(label)}/values?"
        + urllib.parse.urlencode({"match[]": match})
    )
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r).get("data", [])


def main(argv):
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    base = argv[1]
    files = [Path(f) for f in argv[2:]] or sorted(
        (Path(__file__).resolve().parents[1] / "grafana").glob("*.json")
    )
    passed = failed = excluded = 0
    seen = set()
    for f in files:
        d = json.loads(f.read_text())
        values = variables(d)
        for v in d.get("templating", {}).get("list", []):
            m = re.fullmatch(r"\s*label_values\((.+),\s*(\w+)\)\s*", v.get("query") or "")
            if v.get("type") != "query" or not m:
                continue
            got = label_values(base, m.group(2), m.group(1))
            if got:
                passed += 1
                print(f"ok       {f.name} variable ${v['name']}: {', '.join(got)}")
            else:
                failed += 1
                print(f"FAIL     {f.name} variable ${v['name']} ({v['query']}): no values")
        for p in panels(d.get("panels", [])):
            for t in p.get("targets", []):
                raw = t.get("expr")
                if not raw or t.get("hide"):
                    continue
                key = (f.name, raw)
                if key in seen:
                    continue
                seen.add(key)
                expr = expand(raw, values)
                ok, res = query(base, expr)
                where = f"{f.name} [{p.get('title', '?')}] {raw}"
                why = EXCLUDED.get(key)
                if not ok:
                    failed += 1
                    print(f"FAIL     {where}: does not run: {res}")
                elif why is not None:
                    if res:
                        failed += 1
                        print(f"FAIL     {where}: excluded ({why}) but returns data: drop it from EXCLUDED")
                    else:
                        excluded += 1
                        print(f"excluded {where}: {why}")
                elif res:
                    passed += 1
                    sample = res[0].get("value", [None, "?"])[1]
                    print(f"ok       {where} = {sample}" + (f" (+{len(res) - 1} series)" if len(res) > 1 else ""))
                else:
                    failed += 1
                    print(f"FAIL     {where}: no data (expanded: {expr})")
    stale = {k for k in EXCLUDED if k not in seen}
    for f, e in sorted(stale):
        failed += 1
        print(f"FAIL     EXCLUDED names {f} {e}, which no dashboard queries any more")
    print(f"dashboard queries: {passed} passed, {failed} failed, {excluded} excluded")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
