//! Every metric a Grafana dashboard under deploy/grafana queries is exported by some service.
//!
//! The exported names come from the real endpoints, not from the source: a master (and, with
//! etcd, an HA master, which adds the election metrics), a store-client, the routing sidecar
//! after a P/D request through it, and every other service that serves /metrics. A dashboard
//! panel whose metric no service exports would stay empty forever in production; this test turns
//! that into a failure naming the dashboard, the panel and the metric.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use lunakv_tests::pd::{Bootstrap, Sidecar, Sim, fresh_host, request};
use lunakv_tests::{Master, Store, http_get, requester};
use serde_json::Value;

fn grafana_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .join("deploy/grafana")
}

/// Metric names in a Prometheus text exposition (histogram series included as exported:
/// `_bucket`, `_sum`, `_count`).
fn exported(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

const PROMQL_WORDS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "inf",
    "nan", // aggregation operators may put `by (...)` before their parentheses:
    "sum",
    "avg",
    "min",
    "max",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
];

/// The metric names a PromQL expression reads: identifiers that are not functions or
/// aggregations (followed by `(`), keywords, label names in `by (...)`/`on (...)` clauses, or
/// anything inside label matchers, strings and range selectors.
fn queried(expr: &str) -> BTreeSet<String> {
    // Drop strings, {label matchers} and [ranges].
    let mut cleaned = String::with_capacity(expr.len());
    let mut depth_brace = 0;
    let mut depth_bracket = 0;
    let mut in_str: Option<char> = None;
    for ch in expr.chars() {
        if let Some(q) = in_str {
            if ch == q {
                in_str = None;
            }
            continue;
        }
        match ch {
            '"' | '\'' | '`' if depth_brace == 0 => in_str = Some(ch),
            '{' => depth_brace += 1,
            '}' => depth_brace -= 1,
            '[' => depth_bracket += 1,
            ']' => depth_bracket -= 1,
            _ if depth_brace > 0 || depth_bracket > 0 => {}
            _ => cleaned.push(ch),
        }
        if matches!(ch, '{' | '}' | '[' | ']') {
            cleaned.push(' ');
        }
    }
    // Tokenize; remember what follows each identifier.
    let chars: Vec<char> = cleaned.chars().collect();
    let mut out = BTreeSet::new();
    let mut i = 0;
    let mut skip_group = false;
    while i < chars.len() {
        let c = chars[i];
        if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut j = i;
            while j < chars.len() && chars[j].is_whitespace() {
                j += 1;
            }
            let next = chars.get(j).copied();
            let lower = word.to_ascii_lowercase();
            if matches!(
                lower.as_str(),
                "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
            ) {
                skip_group = next == Some('(');
                continue;
            }
            if next == Some('(') || PROMQL_WORDS.contains(&lower.as_str()) {
                continue;
            }
            out.insert(word);
        } else if c == '(' && skip_group {
            // Skip the label list of by/without/on/ignoring/group_*.
            while i < chars.len() && chars[i] != ')' {
                i += 1;
            }
            skip_group = false;
            i += 1;
        } else if c.is_ascii_digit() || c == '.' {
            // Numbers, including 1e-9 and 0.95.
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric()
                    || chars[i] == '.'
                    || chars[i] == '-' && chars[i - 1] == 'e')
            {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    out
}

/// (dashboard file, panel title, expression) for every query of every dashboard.
fn dashboard_queries() -> Vec<(String, String, String)> {
    fn walk(file: &str, panels: &[Value], out: &mut Vec<(String, String, String)>) {
        for p in panels {
            let title = p
                .get("title")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string();
            for t in p
                .get("targets")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                if let Some(e) = t.get("expr").and_then(Value::as_str) {
                    out.push((file.to_string(), title.clone(), e.to_string()));
                }
            }
            if let Some(nested) = p.get("panels").and_then(Value::as_array) {
                walk(file, nested, out);
            }
        }
    }
    let mut out = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(grafana_dir())
        .expect("deploy/grafana exists")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no dashboards in deploy/grafana");
    let mut uids = BTreeSet::new();
    for f in files {
        let name = f.file_name().expect("name").to_string_lossy().into_owned();
        let d: Value = serde_json::from_str(&std::fs::read_to_string(&f).expect("read"))
            .unwrap_or_else(|e| panic!("{name} is not JSON: {e}"));
        for k in ["uid", "title", "panels", "templating"] {
            assert!(d.get(k).is_some(), "{name} has no {k}");
        }
        let uid = d["uid"].as_str().expect("uid").to_string();
        assert!(uids.insert(uid.clone()), "{name}: uid {uid} used twice");
        walk(&name, d["panels"].as_array().expect("panels"), &mut out);
    }
    out
}

#[test]
fn promql_metric_extraction() {
    let q = queried(
        r#"histogram_quantile(0.95, sum by (le, instance) (rate(lunakv_sidecar_request_duration_seconds_bucket{job=~"$job",le!="x"}[5m]))) / clamp_min(sum(master_total_capacity_bytes{job="a"}), 1e-9) + on(instance) group_left(pod) kube_pod_info"#,
    );
    let want: BTreeSet<String> = [
        "lunakv_sidecar_request_duration_seconds_bucket",
        "master_total_capacity_bytes",
        "kube_pod_info",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(q, want);
}

#[test]
fn every_dashboard_metric_is_exported_by_a_service() {
    let queries = dashboard_queries();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut exports: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();

    // Master + store-client, with traffic so every series has been touched.
    let master = Master::start(&dir.path().join("m"), &[]);
    let store = Store::start(&master.addr(), "64MB", &[]);
    {
        let c = requester(&master.addr());
        c.put("dash/k", b"dashboard").expect("put");
        // A vLLM-shaped key, so the per-namespace series (labelled by namespace) exist.
        c.put("dash-model@tp_rank:0@00ab", b"block").expect("put");
        assert_eq!(c.get("dash/k").expect("get"), b"dashboard");
    }
    exports.insert(
        "lunakv-master".into(),
        exported(&master.http_get("/metrics").1),
    );
    let store_admin = store.admin.expect("the store prints its admin address");
    exports.insert(
        "lunakv-store".into(),
        exported(&http_get(store_admin, "/metrics").1),
    );

    // An HA master adds the election metrics.
    let mut ha_checked = false;
    if let Some(etcd) = lunakv_meta::testing::etcd_or_skip() {
        let ha = Master::start_ha(&dir.path().join("ha"), &etcd.endpoint(), &[]);
        let leading = lunakv_tests::wait_until(Duration::from_secs(15), || {
            (ha.role().as_deref() == Some("leader")).then_some(())
        });
        assert!(leading.is_some(), "the HA master did not become leader");
        exports.insert(
            "lunakv-master (HA)".into(),
            exported(&ha.http_get("/metrics").1),
        );
        ha_checked = true;
    }

    // Routing sidecar after one disaggregated request; bootstrap and engines if they serve /metrics.
    let host = fresh_host();
    let bootstrap = Bootstrap::start(host, 0, &[]);
    let prefill = Sim::prefill(host, &bootstrap, &[]);
    prefill.wait_registered();
    let decode = Sim::start(fresh_host(), 0, "decode", &[]);
    let sidecar = Sidecar::start(&decode, "mooncake", bootstrap.http.port(), &[]);
    let prefiller = prefill.http.to_string();
    let r = request(
        sidecar.http,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json"), ("x-prefiller-host-port", &prefiller)],
        br#"{"model":"sim-model","messages":[{"role":"user","content":"dashboards"}],"max_tokens":4}"#,
    );
    assert_eq!(r.status, 200, "P/D request through the sidecar");
    let sc = request(sidecar.http, "GET", "/lunakv/sidecar/metrics", &[], b"");
    exports.insert(
        "lunakv-sidecar".into(),
        exported(&String::from_utf8_lossy(&sc.body)),
    );
    let b = request(bootstrap.http, "GET", "/metrics", &[], b"");
    if b.status == 200 {
        exports.insert(
            "lunakv-bootstrap".into(),
            exported(&String::from_utf8_lossy(&b.body)),
        );
    }

    let all: BTreeSet<&String> = exports.values().flatten().collect();
    let mut missing = Vec::new();
    let mut checked = BTreeSet::new();
    for (file, panel, expr) in &queries {
        if !ha_checked && file == "lunakv-ha.json" {
            continue;
        }
        let names = queried(expr);
        assert!(!names.is_empty(), "{file} / {panel}: no metric in `{expr}`");
        for n in names {
            if !all.contains(&n) {
                missing.push(format!("{file} / \"{panel}\": {n}"));
            }
            checked.insert(n);
        }
    }
    if !ha_checked {
        println!("LUNAKV_SKIP_ETCD=1: lunakv-ha.json not checked (its metrics need an HA master)");
    }
    for (svc, names) in &exports {
        println!("{svc}: {} metrics exported", names.len());
    }
    println!(
        "{} distinct metrics queried by {} panels' queries, all exported",
        checked.len(),
        queries.len()
    );
    assert!(
        missing.is_empty(),
        "dashboard queries of metrics no service exports:\n  {}",
        missing.join("\n  ")
    );
}
