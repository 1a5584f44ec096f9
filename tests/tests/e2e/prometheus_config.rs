//! compose.yaml's monitoring, checked without Docker:
//!
//! - deploy/prometheus/prometheus.yml passes `promtool check config` (Debian's `prometheus`
//!   package, as in metrics_lint.rs);
//! - it scrapes every lunakv service of compose.yaml at the host, port and path that service
//!   serves metrics on (a service sharing another's network, the bootstrap, by that one's name);
//! - the `prometheus` service mounts that file, and every lunakv service gets
//!   `OTEL_EXPORTER_OTLP_ENDPOINT` from `LUNAKV_OTLP_ENDPOINT`.
//!
//! `make e2e-compose` then runs the same stack and queries that Prometheus for real.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("repo root")
        .to_path_buf()
}

fn promtool() -> PathBuf {
    let p = Path::new("/usr/bin/promtool");
    assert!(
        p.exists(),
        "promtool not found: install Debian's prometheus package \
         (`apt-get install -y --no-install-recommends prometheus`; CI's .ci/run does)"
    );
    p.to_path_buf()
}

/// A YAML file as JSON, anchors and `<<` merge keys resolved (compose.yaml uses both).
fn yaml(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).expect("read YAML");
    let mut v = serde_norway::Value::deserialize(serde_norway::Deserializer::from_str(&text))
        .expect("YAML parses");
    v.apply_merge().expect("merge keys resolve");
    serde_json::to_value(v).expect("YAML as JSON")
}

fn s<'a>(v: &'a Value, ptr: &str) -> &'a str {
    v.pointer(ptr).and_then(Value::as_str).unwrap_or("")
}

/// The flag value of `--name=value` in a compose `command:` list.
fn flag(svc: &Value, name: &str) -> Option<String> {
    let prefix = format!("{name}=");
    svc.pointer("/command")?
        .as_array()?
        .iter()
        .filter_map(Value::as_str)
        .find_map(|a| a.strip_prefix(&prefix).map(str::to_owned))
}

/// Where each lunakv image serves its metrics: (the flag holding the port, the path).
fn metrics_endpoint(image: &str) -> Option<(&'static str, &'static str)> {
    let repo_name = image.split(':').next().unwrap_or("");
    match repo_name {
        "lunakv/master" | "lunakv/store" => Some(("--metrics_port", "/metrics")),
        "lunakv/bootstrap" | "lunakv/engine-sim" => Some(("--port", "/metrics")),
        "lunakv/sidecar" => Some(("--port", "/lunakv/sidecar/metrics")),
        _ => None,
    }
}

#[test]
fn prometheus_config_passes_promtool() {
    let config = repo().join("deploy/prometheus/prometheus.yml");
    let out = Command::new(promtool())
        .args(["check", "config"])
        .arg(&config)
        .output()
        .expect("promtool runs");
    assert!(
        out.status.success(),
        "promtool check config {}:\n{}{}",
        config.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn prometheus_scrapes_every_lunakv_service_of_compose() {
    let compose = yaml(&repo().join("compose.yaml"));
    let prom = yaml(&repo().join("deploy/prometheus/prometheus.yml"));
    // (host:port, path) of every static target.
    let mut scraped: BTreeSet<(String, String)> = BTreeSet::new();
    for job in prom
        .pointer("/scrape_configs")
        .and_then(Value::as_array)
        .expect("scrape_configs")
    {
        let path = match s(job, "/metrics_path") {
            "" => "/metrics",
            p => p,
        };
        for sc in job
            .pointer("/static_configs")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            for t in sc
                .pointer("/targets")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                scraped.insert((t.as_str().unwrap_or("").to_owned(), path.to_owned()));
            }
        }
    }

    let services = compose
        .pointer("/services")
        .and_then(Value::as_object)
        .expect("compose services");
    let mut failures = Vec::new();
    let mut checked = Vec::new();
    for (name, svc) in services {
        let image = s(svc, "/image");
        if image.starts_with("lunakv/")
            && !matches!(
                image.split(':').next(),
                // etcd and Prometheus are not lunakv's code; lunakv/python only copies files.
                Some("lunakv/etcd" | "lunakv/prometheus" | "lunakv/python")
            )
        {
            let env = svc.pointer("/environment/OTEL_EXPORTER_OTLP_ENDPOINT");
            if env.and_then(Value::as_str) != Some("${LUNAKV_OTLP_ENDPOINT:-}") {
                failures.push(format!(
                    "{name}: environment OTEL_EXPORTER_OTLP_ENDPOINT is {env:?}, want ${{LUNAKV_OTLP_ENDPOINT:-}}"
                ));
            }
        }
        let Some((port_flag, path)) = metrics_endpoint(image) else {
            continue;
        };
        let Some(port) = flag(svc, port_flag) else {
            failures.push(format!("{name}: no {port_flag} in its command"));
            continue;
        };
        // network_mode "service:X" shares X's address: it is reached by X's name.
        let host = s(svc, "/network_mode")
            .strip_prefix("service:")
            .unwrap_or(name);
        let target = format!("{host}:{port}");
        if scraped.contains(&(target.clone(), path.to_owned())) {
            checked.push(format!("{name} ({target}{path})"));
        } else {
            failures.push(format!(
                "{name} ({image}) serves metrics at {target}{path}, which deploy/prometheus/prometheus.yml does not scrape (it scrapes {scraped:?})"
            ));
        }
    }

    let p = services.get("prometheus").expect("a prometheus service");
    let mounts: Vec<&str> = p
        .pointer("/volumes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    if !mounts.contains(&"./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro") {
        failures.push(format!(
            "the prometheus service does not mount deploy/prometheus/prometheus.yml: {mounts:?}"
        ));
    }
    let profiles = p.pointer("/profiles").cloned().unwrap_or_default();
    if !profiles
        .as_array()
        .is_some_and(|a| a.iter().any(|x| x == "observability"))
    {
        failures.push(format!(
            "the prometheus service is not in the observability profile: {profiles}"
        ));
    }
    for svc in [
        "master",
        "store",
        "bootstrap",
        "sidecar",
        "prefill",
        "decode",
    ] {
        if !checked.iter().any(|c| c.starts_with(&format!("{svc} "))) && failures.is_empty() {
            failures.push(format!("compose service {svc} was not checked"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    println!("scraped: {}", checked.join(", "));
}
