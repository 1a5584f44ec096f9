//! `lunakv bench`: self-contained. It starts its own master and store-client (ephemeral ports,
//! temp data dir), measures the store rows (see [`rows`]) next to this machine's limits (see
//! [`limits`]), prints the issue's targets with PASS/MISS, and stops what it started.
//!
//! Nothing here asserts on timing: a MISS is reported, not failed, because two-process figures on
//! a 2-core box swing between runs. Compare the ratios measured side by side in one run.

mod events;
pub mod limits;
mod offload;
mod rows;
mod stats;

use std::fmt::Write as _;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use anyhow::bail;
use lunakv_proto::ErrorCode;
use serde::Serialize;

use self::limits::Loopback;
use self::rows::{Plan, Row, Transport};
use self::stats::Spread;
use crate::args::BenchArgs;
use crate::error::Coded;
use crate::output::{human_bytes, print_json};
use crate::stack::{MASTER_BIN, STORE_BIN, Stack, StackOptions, bin_dir, service_bin};

/// Progress on stderr, only when it is a terminal (logs and CI output stay clean).
pub struct Progress {
    enabled: bool,
}

impl Progress {
    fn new() -> Progress {
        Progress {
            enabled: std::io::stderr().is_terminal(),
        }
    }

    pub fn show(&self, msg: &str) {
        if self.enabled {
            let mut e = std::io::stderr().lock();
            let _ = write!(e, "\r\x1b[2Kbench: {msg}");
            let _ = e.flush();
        }
    }

    fn clear(&self) {
        if self.enabled {
            let mut e = std::io::stderr().lock();
            let _ = write!(e, "\r\x1b[2K");
            let _ = e.flush();
        }
    }
}

/// One of the issue's targets.
#[derive(Debug, Serialize)]
struct Target {
    name: &'static str,
    value: f64,
    unit: &'static str,
    /// What `value` is compared with (already scaled: 75% of loopback, ...).
    threshold: f64,
    rule: String,
    pass: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    ok: bool,
    quick: bool,
    bytes_per_pass: u64,
    segment_size: String,
    shm_offered: bool,
    tcp_get_4m_gbps: f64,
    loopback_tcp_gbps: f64,
    shm_get_4m_gbps: f64,
    memcpy_gbps: f64,
    get_64k_p50_us: f64,
    shm_get_64k_p50_us: f64,
    tcp_get_4m_batch32_gbps: f64,
    shm_get_4m_batch32_gbps: f64,
    memcpy_best_gbps: f64,
    loopback_tcp_best_gbps: f64,
    loopback_ping_64b_p50_us: f64,
    loopback_ping_64b_p99_us: f64,
    memcpy_samples_gbps: Vec<f64>,
    loopback_tcp_samples_gbps: Vec<f64>,
    targets: Vec<Target>,
    rows: Vec<Row>,
}

pub fn run(a: &BenchArgs, json: bool) -> anyhow::Result<ExitCode> {
    if a.events {
        let bins = bin_dir(a.bin_dir.as_deref())?;
        let r = events::run(&bins, a.quick)?;
        print!("{}", events::render(&r));
        if json {
            print_json(&r)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    if a.offload {
        let bins = bin_dir(a.bin_dir.as_deref())?;
        let r = offload::run(&bins, a.offload_dir.as_deref(), a.quick)?;
        print!("{}", offload::render(&r));
        if json {
            print_json(&r)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let mut plan = if a.quick { Plan::quick() } else { Plan::full() };
    if let Some(mib) = a.mib_per_row {
        if mib == 0 {
            bail!(Coded::new(
                ErrorCode::InvalidParams,
                "--mib-per-row must be at least 1"
            ));
        }
        plan.bytes_per_pass = mib << 20;
    }
    let segment = lunakv_config::parse_size(&a.segment_size)
        .map_err(|e| Coded::new(ErrorCode::InvalidParams, format!("--segment-size: {e}")))?;
    // A pass must fit with room to spare: removals return space through the owner's FREE ack.
    let need = plan.segment_bytes_needed();
    if segment < need + need / 4 {
        bail!(Coded::new(
            ErrorCode::InvalidParams,
            format!(
                "--segment-size {} is too small for {} per pass: use at least {}",
                a.segment_size,
                human_bytes(need),
                human_bytes(need + need / 4)
            )
        ));
    }
    // Fail before minutes of measuring if the services are not built.
    let bins = bin_dir(a.bin_dir.as_deref())?;
    service_bin(&bins, MASTER_BIN)?;
    service_bin(&bins, STORE_BIN)?;

    let progress = Progress::new();
    let (memcpy_reps, stream_bytes, stream_reps, pings) = if a.quick {
        (3, 256u64 << 20, 2, 500)
    } else {
        (7, 1u64 << 30, 3, 2000)
    };

    // Limits before the store rows...
    progress.show("memcpy");
    let mut memcpy = limits::memcpy(memcpy_reps).samples;
    progress.show("loopback TCP");
    let mut loopback = limits::loopback(stream_bytes, stream_reps, pings)?;

    let data_dir = tempfile::Builder::new().prefix("lunakv-bench-").tempdir()?;
    progress.show("starting lunakv-master and lunakv-store");
    let mut stack = Stack::start(&StackOptions {
        bin_dir: bins,
        rpc_port: 0,
        master_metrics_port: 0,
        data_dir: data_dir.path().join("master"),
        store_port: 0,
        store_metrics_port: 0,
        segment_size: a.segment_size.clone(),
        // The services' info logs would bury the table; warnings and errors still show.
        default_log: Some("warn"),
    })?;
    let measured = measure_rows(&mut stack, &plan, &progress);
    progress.show("stopping lunakv-store and lunakv-master");
    let stopped = stack.stop();
    let (rows, shm_offered) = measured?;
    stopped?;

    // ...and after, so a noisy moment on a shared box shows as spread rather than bias.
    progress.show("memcpy");
    memcpy.extend(limits::memcpy(memcpy_reps).samples);
    progress.show("loopback TCP");
    loopback.merge(limits::loopback(stream_bytes, stream_reps, pings)?);
    progress.clear();

    let report = build_report(a, &plan, shm_offered, rows, Spread::of(memcpy), &loopback);
    print!("{}", render(&report, &stack_note(a, &plan)));
    if json {
        print_json(&report)?;
    }
    Ok(ExitCode::SUCCESS)
}

fn stack_note(a: &BenchArgs, plan: &Plan) -> String {
    format!(
        "lunakv bench{}: own lunakv-master + lunakv-store on loopback (segment {}), {} per row and pass",
        if a.quick { " --quick" } else { "" },
        a.segment_size,
        human_bytes(plan.bytes_per_pass)
    )
}

/// Both transports' rows; also whether the store offered shm to this host (if not, the shm
/// rows silently fell back to tcp, and the report says so).
fn measure_rows(
    stack: &mut Stack,
    plan: &Plan,
    progress: &Progress,
) -> anyhow::Result<(Vec<Row>, bool)> {
    let status = crate::cmd::status::fetch_blocking(&crate::target::Target {
        master: stack.master_rpc.clone(),
        origin: crate::target::Origin::Flag,
        enable_shm: true,
    })?;
    let here = lunakv_transfer::host_id();
    let shm_offered = status.segments.iter().any(|s| {
        s.segment
            .as_ref()
            .is_some_and(|d| !d.shm_socket.is_empty() && d.host_id == here)
    });
    let mut rows = Vec::new();
    for t in [Transport::Shm, Transport::Tcp] {
        rows.extend(rows::run_transport(&stack.master_rpc, t, plan, progress)?);
        stack.check_alive()?;
    }
    Ok((rows, shm_offered))
}

fn find(rows: &[Row], name: &str) -> Option<Row> {
    rows.iter().find(|r| r.name == name).cloned()
}

fn build_report(
    a: &BenchArgs,
    plan: &Plan,
    shm_offered: bool,
    rows: Vec<Row>,
    memcpy: Spread,
    lo: &Loopback,
) -> Report {
    let gbps = |n: &str| find(&rows, n).map_or(0.0, |r| r.gbps);
    let p50 = |n: &str| find(&rows, n).map_or(0.0, |r| r.p50_us);
    let tcp_get_4m = gbps("tcp_get_4m_single");
    let shm_get_4m = gbps("shm_get_4m_single");
    let get_64k_p50 = p50("tcp_get_64k_single");
    let stream = lo.stream();
    let targets = vec![
        Target {
            name: "tcp_get_4m_vs_loopback",
            value: tcp_get_4m,
            unit: "GB/s",
            threshold: 0.75 * stream.median,
            rule: format!(
                "tcp get 4 MiB >= 75% of raw loopback TCP ({:.2} GB/s)",
                stream.median
            ),
            pass: tcp_get_4m >= 0.75 * stream.median,
        },
        Target {
            name: "shm_get_4m_vs_memcpy",
            value: shm_get_4m,
            unit: "GB/s",
            threshold: 0.5 * memcpy.median,
            rule: format!("shm get 4 MiB >= 50% of memcpy ({:.2} GB/s)", memcpy.median),
            pass: shm_get_4m >= 0.5 * memcpy.median,
        },
        Target {
            name: "get_64k_p50",
            value: get_64k_p50,
            unit: "us",
            threshold: 150.0,
            rule: "tcp get 64 KiB single p50 <= 150 us".to_owned(),
            pass: get_64k_p50 > 0.0 && get_64k_p50 <= 150.0,
        },
    ];
    Report {
        ok: true,
        quick: a.quick,
        bytes_per_pass: plan.bytes_per_pass,
        segment_size: a.segment_size.clone(),
        shm_offered,
        tcp_get_4m_gbps: tcp_get_4m,
        loopback_tcp_gbps: stream.median,
        shm_get_4m_gbps: shm_get_4m,
        memcpy_gbps: memcpy.median,
        get_64k_p50_us: get_64k_p50,
        shm_get_64k_p50_us: p50("shm_get_64k_single"),
        tcp_get_4m_batch32_gbps: gbps("tcp_get_4m_batch32"),
        shm_get_4m_batch32_gbps: gbps("shm_get_4m_batch32"),
        memcpy_best_gbps: memcpy.best,
        loopback_tcp_best_gbps: stream.best,
        loopback_ping_64b_p50_us: lo.ping_p50_us(),
        loopback_ping_64b_p99_us: lo.ping_p99_us(),
        memcpy_samples_gbps: memcpy.samples,
        loopback_tcp_samples_gbps: stream.samples,
        targets,
        rows,
    }
}

const LEGEND: &str = "\
What each row measures (GB/s = 1e9 bytes / summed call time; p50/p99 per call in microseconds;
ops/s counts objects):
  put      a writer StoreClient stores new objects in the lunakv-store's segment
           (master PutStart, the bytes, master PutEnd per call)
  get      a second StoreClient reads them into its own preallocated buffers (get_into /
           batch_get_into); its location cache was warmed by batch_exists first, as vLLM does,
           so a get is one transfer and no master call
  single   one object per call;  batch32: 32 objects per call (batch_put / batch_get_into)
  shm      same host: the client maps the store's memfd (a get is pin + one memcpy + unpin)
  tcp      client with enable_shm=false: bytes cross the loopback socket to/from lunakv-store
  Every get is checked byte for byte, outside the timed region.
";

fn render(r: &Report, note: &str) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "{note}");
    if !r.shm_offered {
        let _ = writeln!(
            o,
            "WARNING: the store offered no shm socket to this host, so the shm rows ran over tcp"
        );
    }
    let _ = writeln!(o, "\n{LEGEND}");
    let _ = writeln!(
        o,
        "{:<4} {:<4} {:<8} {:>5} {:>7} {:>8} {:>10} {:>9} {:>9}",
        "", "op", "mode", "size", "objects", "GB/s", "ops/s", "p50 us", "p99 us"
    );
    for row in &r.rows {
        let _ = writeln!(
            o,
            "{:<4} {:<4} {:<8} {:>5} {:>7} {:>8.2} {:>10.0} {:>9.0} {:>9.0}",
            row.transport,
            row.op,
            row.mode,
            rows::size_tag(row.value_bytes).to_uppercase(),
            row.objects,
            row.gbps,
            row.ops_per_sec,
            row.p50_us,
            row.p99_us
        );
    }
    let _ = writeln!(
        o,
        "\nThis machine, same run (measured before and after the rows; median / best):"
    );
    let _ = writeln!(
        o,
        "  memcpy, one thread, 64 MiB buffers        {:>6.2} / {:.2} GB/s  ({} copies)",
        r.memcpy_gbps,
        r.memcpy_best_gbps,
        r.memcpy_samples_gbps.len()
    );
    let _ = writeln!(
        o,
        "  loopback TCP, 2 processes, 4 MiB writes   {:>6.2} / {:.2} GB/s  ({} streams)",
        r.loopback_tcp_gbps,
        r.loopback_tcp_best_gbps,
        r.loopback_tcp_samples_gbps.len()
    );
    let _ = writeln!(
        o,
        "  loopback TCP ping-pong 64 B               p50 {:.0} us, p99 {:.0} us",
        r.loopback_ping_64b_p50_us, r.loopback_ping_64b_p99_us
    );
    let _ = writeln!(o, "\nTargets:");
    for t in &r.targets {
        let _ = writeln!(
            o,
            "  {:<4} {:>8.2} {:<4} {} (threshold {:.2} {})",
            if t.pass { "PASS" } else { "MISS" },
            t.value,
            t.unit,
            t.rule,
            t.threshold,
            t.unit
        );
    }
    let _ = writeln!(
        o,
        "  (info) shm get 64 KiB single p50 {:.0} us; tcp get 4 MiB batch32 {:.2} GB/s; shm get 4 MiB batch32 {:.2} GB/s",
        r.shm_get_64k_p50_us, r.tcp_get_4m_batch32_gbps, r.shm_get_4m_batch32_gbps
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, gbps: f64, p50: f64) -> Row {
        let mut parts = name.split('_');
        Row {
            name: name.to_owned(),
            transport: if parts.next() == Some("tcp") {
                "tcp"
            } else {
                "shm"
            },
            op: "get",
            mode: "single".to_owned(),
            batch: 1,
            value_bytes: 4 << 20,
            calls: 1,
            objects: 1,
            bytes: 1,
            seconds: 1.0,
            gbps,
            ops_per_sec: 1.0,
            p50_us: p50,
            p99_us: p50,
        }
    }

    #[test]
    fn report_has_the_issue_keys_and_judges_targets() {
        let a = BenchArgs {
            quick: true,
            segment_size: "1GB".into(),
            mib_per_row: None,
            bin_dir: None,
            offload: false,
            offload_dir: None,
            events: false,
        };
        let rows = vec![
            row("tcp_get_4m_single", 1.8, 2000.0),
            row("shm_get_4m_single", 2.0, 900.0),
            row("tcp_get_64k_single", 0.5, 160.0),
        ];
        let lo = Loopback {
            stream_gbps: vec![2.0, 2.2, 2.1],
            ping_us: vec![30.0; 10],
        };
        let r = build_report(
            &a,
            &Plan::quick(),
            true,
            rows,
            Spread::of(vec![6.0, 5.0, 7.0]),
            &lo,
        );
        let v = serde_json::to_value(&r).expect("json");
        for k in [
            "tcp_get_4m_gbps",
            "loopback_tcp_gbps",
            "shm_get_4m_gbps",
            "memcpy_gbps",
            "get_64k_p50_us",
            "rows",
        ] {
            assert!(v.get(k).is_some(), "missing {k}");
        }
        assert_eq!(v["loopback_tcp_gbps"], 2.1);
        assert_eq!(v["memcpy_gbps"], 6.0);
        let pass: Vec<bool> = r.targets.iter().map(|t| t.pass).collect();
        // 1.8 >= 0.75*2.1; 2.0 < 0.5*6.0; 160 > 150.
        assert_eq!(pass, vec![true, false, false]);
        let text = render(&r, "note");
        assert!(text.contains("PASS") && text.contains("MISS"), "{text}");
    }
}
