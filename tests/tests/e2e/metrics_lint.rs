//! Every service's /metrics, scraped from the real binaries, passes `promtool check metrics`
//! (Debian's `prometheus` package; CI installs it): counters typed as counters with `_total`,
//! `process_*` and `lunakv_build_info` everywhere, a Content-Type Prometheus 3 accepts.

use std::io::Write;
use std::net::SocketAddr;
use std::process::{Command, Stdio};

use lunakv_tests::pd::{Bootstrap, Sidecar, Sim, request};
use lunakv_tests::{Master, Store};

fn promtool() -> std::path::PathBuf {
    let p = std::path::Path::new("/usr/bin/promtool");
    assert!(
        p.exists(),
        "promtool not found: install Debian's prometheus package \
         (`apt-get install -y --no-install-recommends prometheus`; CI's .ci/run does)"
    );
    p.to_path_buf()
}

/// (body, content type) of a GET.
fn scrape(addr: SocketAddr, path: &str) -> (String, String) {
    let r = request(addr, "GET", path, &[], b"");
    let ct = r.header("content-type").unwrap_or_default().to_owned();
    (r.text(), ct)
}

/// Upstream Mooncake's names, kept beside promtool-clean twins (`master_keys`,
/// `master_evicted_keys_total`, `master_disk_keys`) because upstream's dashboards query them.
const UPSTREAM_ALIASES: &[&str] = &[
    "master_key_count",
    "master_evicted_key_count",
    "master_disk_key_count",
];

/// What promtool says of `text`, less its remarks on [`UPSTREAM_ALIASES`]: empty when it passes.
fn lint(text: &str) -> String {
    let mut child = Command::new(promtool())
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("feed promtool");
    let out = child.wait_with_output().expect("promtool ends");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    said.lines()
        .filter(|l| {
            !UPSTREAM_ALIASES
                .iter()
                .any(|a| l.starts_with(&format!("{a} ")))
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

#[test]
fn every_service_passes_promtool_and_names_its_build() {
    promtool();
    let dir = tempfile::tempdir().expect("tempdir");
    let m = Master::start(dir.path(), &[]);
    let s = Store::start(&m.addr(), "16MB", &["--enable_shm=false"]);
    let c = lunakv_tests::tcp_requester(&m.addr());
    c.put("k", b"v").expect("put");
    c.get("k").expect("get");
    let host = "127.0.0.1".parse().expect("ip");
    let boot = Bootstrap::start(host, 0, &[]);
    let decoder = Sim::start(host, 0, "decode", &[]);
    let sc = Sidecar::start(&decoder, "mooncake", boot.http.port(), &[]);
    let targets = [
        ("lunakv-master", m.admin, "/metrics"),
        ("lunakv-store", s.admin.expect("store admin"), "/metrics"),
        ("lunakv-bootstrap", boot.http, "/metrics"),
        ("lunakv-sidecar", sc.http, "/lunakv/sidecar/metrics"),
        // The vLLM test double serves /metrics where vLLM does; compose's Prometheus scrapes it.
        ("lunakv-engine-sim", decoder.http, "/metrics"),
    ];
    let mut problems = Vec::new();
    for (service, addr, path) in targets {
        let (text, ct) = scrape(addr, path);
        if !ct.starts_with("text/plain") {
            problems.push(format!("{service}: Content-Type {ct:?}"));
        }
        let said = lint(&text);
        if !said.is_empty() {
            problems.push(format!("{service}: promtool says:\n{said}"));
        }
        for family in [
            "# TYPE process_cpu_seconds_total counter",
            "# TYPE process_resident_memory_bytes gauge",
        ] {
            if !text.contains(family) {
                problems.push(format!("{service}: no {family:?}"));
            }
        }
        if !text.contains(&format!("lunakv_build_info{{service=\"{service}\"")) {
            problems.push(format!("{service}: no lunakv_build_info"));
        }
        // A cumulative value is a counter, never a gauge.
        for l in text.lines().filter(|l| l.starts_with("# TYPE ")) {
            let mut w = l.split_whitespace().skip(2);
            if let (Some(name), Some("gauge")) = (w.next(), w.next())
                && name.ends_with("_total")
            {
                problems.push(format!("{service}: {name} is typed gauge"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    let (text, _) = scrape(m.admin, "/metrics");
    let observed = text
        .lines()
        .filter(|l| l.starts_with("master_rpc_duration_seconds_count{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>();
    assert!(
        observed >= 2.0,
        "the put and get left no RPC latency:\n{text}"
    );
}
