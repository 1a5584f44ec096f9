//! OpenTelemetry traces across the real binaries (docs/TRACING.md). An in-process OTLP
//! receiver ([`lunakv_tests::otlp::Collector`]) takes the spans every service exports, and each
//! test checks that one request is ONE trace: every span carries the same trace id, and each
//! one's parent span id is the span of the hop that called it, in the process that called it.
//!
//! - A P/D completion through the sidecar (http/protobuf export): the caller's `traceparent`
//!   -> sidecar request -> its prefill, decode and bootstrap legs -> the bootstrap, the prefill
//!   and decode engines -> the decoder's bootstrap lookup and side channel -> the prefill's KV
//!   write -> the decoder's RAW_WRITEs (the transfer wire's trace context).
//! - A put from the `lunakv` CLI (grpc export): client `put` -> the master's BatchPutStart and
//!   BatchPutEnd (gRPC metadata) -> the store's WRITE (tcp) or COMMIT (shm) on the transfer wire.
//!
//! The sidecar and the store batch their spans for 10 minutes, so theirs arrive only through
//! the flush at exit: each test stops one with SIGTERM and expects a clean exit and the spans.

use std::collections::HashMap;
use std::time::Duration;

use lunakv_tests::otlp::{Collector, SpanRecord};
use lunakv_tests::pd::{Bootstrap, Sidecar, Sim, fresh_host, post, request};
use lunakv_tests::{Master, Proc, Store, child_env};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(40);
const SERVER: i32 = 2;
const CLIENT: i32 = 3;

/// One expected span: found by service, name and the span that must be its parent.
struct Hop {
    label: &'static str,
    service: &'static str,
    name: &'static str,
    /// The label of the parent hop, or [`REMOTE`] for the caller outside the system.
    parent: &'static str,
}

const REMOTE: &str = "remote caller";

const fn hop(
    label: &'static str,
    service: &'static str,
    name: &'static str,
    parent: &'static str,
) -> Hop {
    Hop {
        label,
        service,
        name,
        parent,
    }
}

/// Resolves `hops` in order among the spans of `trace_id`: each hop is the span of its service
/// and name whose parent is its parent hop's span (`remote` for [`REMOTE`]). Err names the
/// first hop not found.
fn chain(
    spans: &[SpanRecord],
    trace_id: &str,
    remote: &str,
    hops: &[Hop],
) -> Result<HashMap<&'static str, SpanRecord>, String> {
    let mut found: HashMap<&'static str, SpanRecord> = HashMap::new();
    for h in hops {
        let parent = if h.parent == REMOTE {
            remote.to_owned()
        } else {
            found
                .get(h.parent)
                .map(|p| p.span_id.clone())
                .ok_or_else(|| format!("hop {} comes before its parent {}", h.label, h.parent))?
        };
        let s = spans
            .iter()
            .find(|s| {
                s.trace_id == trace_id
                    && s.service == h.service
                    && s.name == h.name
                    && s.parent_span_id == parent
            })
            .ok_or_else(|| {
                format!(
                    "no span [{}] {:?} in trace {trace_id} whose parent is {} ({parent})",
                    h.service, h.name, h.parent
                )
            })?;
        found.insert(h.label, s.clone());
    }
    Ok(found)
}

fn dump(spans: &[SpanRecord], trace_id: &str) -> String {
    spans
        .iter()
        .filter(|s| s.trace_id == trace_id)
        .map(|s| format!("  {s}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Waits until `hops` resolve in `trace_id`; panics with what arrived otherwise.
fn wait_chain(
    c: &Collector,
    trace_id: &str,
    remote: &str,
    hops: &[Hop],
) -> HashMap<&'static str, SpanRecord> {
    let mut last = String::new();
    c.wait_for(WAIT, |spans| match chain(spans, trace_id, remote, hops) {
        Ok(found) => Some(found),
        Err(e) => {
            last = e;
            None
        }
    })
    .unwrap_or_else(|| {
        panic!(
            "the trace never became complete: {last}\nspans of trace {trace_id}:\n{}",
            dump(&c.spans(), trace_id)
        )
    })
}

fn random_hex(bytes: usize) -> String {
    (0..bytes)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect()
}

/// Threads of `pid` named `lunakv-otlp`: the exporter's runtime exists exactly when traces are
/// exported.
fn exporter_threads(pid: u32) -> usize {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .filter_map(|t| t.ok())
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .filter(|name| name.trim() == "lunakv-otlp")
        .count()
}

#[test]
fn a_pd_request_through_sidecar_bootstrap_prefill_and_decode_is_one_trace() {
    let collector = Collector::start();
    let endpoint = collector.http_endpoint();
    let _env = child_env(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ]);
    let host = fresh_host();
    let boot = Bootstrap::start(host, 0, &["--lease-ttl=1500ms"]);
    let prefill = {
        let _name = child_env(&[("OTEL_SERVICE_NAME", "sim-prefill")]);
        Sim::prefill(host, &boot, &[])
    };
    let decode = {
        let _name = child_env(&[("OTEL_SERVICE_NAME", "sim-decode")]);
        Sim::start("127.0.0.1".parse().expect("ip"), 0, "decode", &[])
    };
    // The sidecar's spans leave only with the flush at exit (SIGTERM, below).
    let mut sidecar = {
        let _late = child_env(&[("OTEL_BSP_SCHEDULE_DELAY", "600000")]);
        Sidecar::start(&decode, "mooncake", boot.http.port(), &[])
    };

    // The caller's own span: the sidecar must continue it, not start a trace.
    let (trace_id, caller) = (random_hex(16), random_hex(8));
    let traceparent = format!("00-{trace_id}-{caller}-01");
    let target = prefill.http.to_string();
    let body = json!({"model": "sim", "max_tokens": 4, "prompt":
        "a prompt long enough to fill several blocks of simulated kv cache, so that the prefill \
         engine writes more than one block into the decoder's registered memory"});
    let r = post(
        sidecar.http,
        "/v1/completions",
        &[
            ("x-prefiller-host-port", &target),
            ("traceparent", &traceparent),
            ("x-request-id", "otel-req-1"),
        ],
        &body,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    // x-request-id still travels: echoed by the sidecar, and the decoder named its answer by it.
    assert_eq!(r.header("x-request-id"), Some("otel-req-1"));
    assert_eq!(r.json()["id"], "cmpl-otel-req-1", "{}", r.text());
    assert!(decode.stat("kv_bytes_received") > 0, "the KV never moved");
    // Probes and scrapes as a kubelet and Prometheus send them: no trace context.
    for path in ["/health", "/health", "/lunakv/sidecar/metrics"] {
        assert_eq!(
            request(sidecar.http, "GET", path, &[], b"").status,
            200,
            "{path}"
        );
    }

    // The engines export on their own schedule; the sidecar holds its spans until it drains.
    let in_trace = |service: &str| {
        let service = service.to_owned();
        let trace_id = trace_id.clone();
        move |spans: &[SpanRecord]| {
            spans
                .iter()
                .any(|s| s.trace_id == trace_id && s.service == service)
                .then_some(())
        }
    };
    assert!(
        collector.wait_for(WAIT, in_trace("sim-decode")).is_some(),
        "the decode engine exported nothing"
    );
    assert!(
        in_trace("lunakv-sidecar")(&collector.spans()).is_none(),
        "the sidecar exported before its flush at exit"
    );
    assert_eq!(
        sidecar.proc.terminate(Duration::from_secs(30)),
        Some(0),
        "the sidecar must drain and flush cleanly on SIGTERM:\n{}",
        sidecar.proc.output()
    );

    let sc = "lunakv-sidecar";
    let found = wait_chain(
        &collector,
        &trace_id,
        &caller,
        &[
            hop("request", sc, "request", REMOTE),
            hop("pd", sc, "pd", "request"),
            hop("prefill", sc, "prefill", "pd"),
            hop("decode", sc, "decode", "pd"),
            hop("lookup", sc, "GET /query", "pd"),
            hop("bootstrap", "lunakv-bootstrap", "GET /query", "lookup"),
            hop("p.serve", "sim-prefill", "POST /v1/completions", "prefill"),
            hop("d.serve", "sim-decode", "POST /v1/completions", "decode"),
            hop("d.lookup", "sim-decode", "GET /query", "d.serve"),
            hop("bootstrap2", "lunakv-bootstrap", "GET /query", "d.lookup"),
            hop("d.side", "sim-decode", "POST /sim/kv/transfer", "d.serve"),
            hop("p.side", "sim-prefill", "POST /sim/kv/transfer", "d.side"),
            hop("p.kv", "sim-prefill", "kv_write", "p.side"),
            hop("d.raw", "sim-decode", "transfer RAW_WRITE", "p.kv"),
        ],
    );
    let spans = collector.spans();
    let probes: Vec<&SpanRecord> = spans
        .iter()
        .filter(|s| s.service == sc && s.attr("path").is_some_and(|p| p != "/v1/completions"))
        .collect();
    assert!(
        probes.is_empty(),
        "health probes and scrapes must not start traces: {probes:?}"
    );
    let trace: Vec<&SpanRecord> = spans.iter().filter(|s| s.trace_id == trace_id).collect();
    // One trace, entered once: the caller's span is the only parent outside it.
    let ids: Vec<&str> = trace.iter().map(|s| s.span_id.as_str()).collect();
    for s in &trace {
        assert!(
            s.parent_span_id == caller || ids.contains(&s.parent_span_id.as_str()),
            "{s} hangs off a span outside the trace:\n{}",
            dump(&spans, &trace_id)
        );
        assert_eq!(
            s.via, "http",
            "{s}: OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"
        );
    }
    for (label, kind) in [
        ("request", SERVER),
        ("lookup", CLIENT),
        ("bootstrap", SERVER),
        ("p.serve", SERVER),
        ("d.side", CLIENT),
        ("d.raw", SERVER),
    ] {
        assert_eq!(found[label].kind, kind, "{}", found[label]);
    }
    // The prefill and decode legs are separate spans; the request carried its id.
    assert_ne!(found["prefill"].span_id, found["decode"].span_id);
    assert!(
        found["request"]
            .attr("request_id")
            .is_some_and(|v| v.contains("otel-req-1")),
        "{:?}",
        found["request"].attributes
    );
    // Resources: each service under its name (default, or OTEL_SERVICE_NAME for the engines).
    for s in &trace {
        assert!(
            [
                "lunakv-sidecar",
                "lunakv-bootstrap",
                "sim-prefill",
                "sim-decode"
            ]
            .contains(&s.service.as_str()),
            "unexpected service.name on {s}"
        );
    }
}

#[test]
fn a_put_through_client_master_and_store_is_one_trace_and_no_endpoint_means_no_exporter() {
    let collector = Collector::start();
    let endpoint = collector.grpc_endpoint();
    let dir = tempfile::tempdir().expect("tempdir");
    let env = child_env(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ]);
    let master = Master::start(&dir.path().join("m"), &[]);
    // The store's spans leave only with the flush at exit (SIGTERM, below).
    let mut store = {
        let _late = child_env(&[("OTEL_BSP_SCHEDULE_DELAY", "600000")]);
        Store::start(&master.addr(), "32MB", &[])
    };
    let file = dir.path().join("value.bin");
    std::fs::write(&file, lunakv_tests::pattern(7, 200_000)).expect("write value");

    // One put over tcp (WRITE), one over shared memory (COMMIT): both transfer paths carry
    // the trace context to the store.
    let mut traces = Vec::new();
    let mut puts = Vec::new();
    for (key, shm, op) in [
        ("otel-tcp", "1", "transfer WRITE"),
        ("otel-shm", "0", "transfer COMMIT"),
    ] {
        let _shm = child_env(&[("LUNAKV_DISABLE_SHM", shm)]);
        let mut cli = Proc::spawn(
            "lunakv",
            &[
                "--master".into(),
                master.addr(),
                "put".into(),
                key.into(),
                file.display().to_string(),
            ],
            &[],
        );
        assert_eq!(
            cli.wait_exit(Duration::from_secs(30)),
            Some(0),
            "{}",
            cli.output()
        );
        let seen: Vec<String> = traces.clone();
        let put = collector
            .wait_for(WAIT, |spans| {
                spans
                    .iter()
                    .find(|s| {
                        s.service == "lunakv"
                            && s.name == "put"
                            && s.parent_span_id.is_empty()
                            && !seen.contains(&s.trace_id)
                    })
                    .cloned()
            })
            .unwrap_or_else(|| {
                panic!(
                    "no client put span for {key}; got:\n{:?}",
                    collector.spans()
                )
            });
        assert_eq!(put.kind, CLIENT, "{put}");
        let found = wait_chain(
            &collector,
            &put.trace_id,
            &put.span_id,
            &[
                hop(
                    "start",
                    "lunakv-master",
                    "lunakv.master.v1.Master/BatchPutStart",
                    REMOTE,
                ),
                hop(
                    "end",
                    "lunakv-master",
                    "lunakv.master.v1.Master/BatchPutEnd",
                    REMOTE,
                ),
            ],
        );
        for s in found.values() {
            assert_eq!(s.kind, SERVER, "{s}");
            assert_eq!(s.via, "grpc", "{s}: OTEL_EXPORTER_OTLP_PROTOCOL=grpc");
        }
        traces.push(put.trace_id.clone());
        puts.push((put, op));
    }
    assert!(
        !collector
            .spans()
            .iter()
            .any(|s| s.service == "lunakv-store"),
        "the store exported before its flush at exit"
    );
    assert_eq!(
        store.proc.terminate(Duration::from_secs(30)),
        Some(0),
        "the store must drain and flush cleanly on SIGTERM:\n{}",
        store.proc.output()
    );
    for (put, op) in &puts {
        let found = wait_chain(
            &collector,
            &put.trace_id,
            &put.span_id,
            &[hop("store", "lunakv-store", op, REMOTE)],
        );
        assert_eq!(found["store"].kind, SERVER, "{}", found["store"]);
        assert_eq!(found["store"].via, "grpc", "{}", found["store"]);
    }
    assert_eq!(
        exporter_threads(master.proc.pid()),
        1,
        "a master with an endpoint runs one export thread"
    );

    // Without an endpoint nothing is created: no export thread. (Empty counts as unset, which
    // also keeps an endpoint in this test's own environment away.)
    drop(env);
    let _off = child_env(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", ""),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", ""),
    ]);
    let plain = Master::start(&dir.path().join("plain"), &[]);
    assert_eq!(
        exporter_threads(plain.proc.pid()),
        0,
        "a master without an endpoint must not start an exporter"
    );
}
