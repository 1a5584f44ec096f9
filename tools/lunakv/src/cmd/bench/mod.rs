//! `lunakv bench`: self-contained. It starts its own master and store-client (ephemeral ports,
//! temp data dir), measures the store rows (see [`rows`]) next to this machine's limits (see
//! [`limits`]), prints the issue's targets with PASS/MISS, and stops what it started.
//!
//! Nothing here asserts on timing: a MISS is reported, not failed, because two-process figures on
//! a 2-core box swing between runs. Compare the ratios measured side by side in one run.

mod caps;
mod device;
mod drain;
mod events;
pub mod limits;
mod offload;

pub mod paired;
mod progress;
mod rows;
mod stats;
pub mod trace;

use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::bail;
use lunakv_proto::ErrorCode;
use serde::Serialize;

use self::limits::Loopback;
use self::paired::{PairedRatio, interleave, loadavg};
use self::progress::Progress;
use self::rows::{GetBench, Plan, Row, Transport};
use self::stats::Spread;
use crate::args::BenchArgs;
use crate::error::Coded;
use crate::output::{human_bytes, print_json};
use crate::stack::{MASTER_BIN, STORE_BIN, Stack, StackOptions, bin_dir, service_bin};

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

/// /proc/loadavg at the start and the end of the run: the ratios are only as steady as the
/// machine was.
#[derive(Debug, Serialize)]
struct Load {
    start: String,
    end: String,
}

#[derive(Debug, Serialize)]
struct Report {
    ok: bool,
    quick: bool,
    pairs: usize,
    load: Load,
    /// The paired trials behind the ratio targets, pair by pair.
    paired: Vec<PairedRatio>,
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
    if a.pairs == 0 {
        bail!(Coded::new(
            ErrorCode::InvalidParams,
            "--pairs 0: the verdicts need paired trials; use at least 1 (5 or more for a verdict that holds)"
        ));
    }
    if let Some(path) = &a.trace {
        let bins = bin_dir(a.bin_dir.as_deref())?;
        let r = trace::run(
            &bins,
            &trace::TracePlan {
                path: path.clone(),
                block_bytes: a.block_bytes,
                capacity_tokens: a.capacity_tokens,
                ssd_tokens: a.ssd_tokens,
                first: a.first,
                time_scale: a.time_scale,
                master_args: a.master_args.clone(),
            },
        )?;
        print!("{}", trace::render(&r));
        if json {
            print_json(&r)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    if a.device {
        let bins = bin_dir(a.bin_dir.as_deref())?;
        let plan = device::DevicePlan {
            layers: a.device_layers,
            objects: a.device_objects,
            block_bytes: a.device_block_bytes,
            batches: a.device_batches.unwrap_or(if a.quick { 5 } else { 20 }),
        };
        let progress = Progress::new();
        if let Some(other) = &a.against {
            let paired = device::against(other, a.bin_dir.as_deref(), plan, a.pairs, &progress)?;
            progress.clear();
            println!(
                "lunakv bench --device --against {}: overhead p50 per batch, {} pairs, interleaved \
                 (other, this, other, ...); ratio other / this (> 1: this build is faster)",
                other.display(),
                a.pairs
            );
            for p in &paired {
                println!(
                    "{:<28} other {:>7.2} ms  this {:>7.2} ms  {:>5.2}x [{:.2}-{:.2}]",
                    p.label,
                    p.median_of(|x| x.row),
                    p.median_of(|x| x.limit),
                    p.median_ratio,
                    p.min_ratio,
                    p.max_ratio
                );
            }
            if json {
                print_json(&paired)?;
            }
            return Ok(ExitCode::SUCCESS);
        }
        let r = device::run(&bins, plan, &progress)?;
        progress.clear();
        // With --json stdout is the report alone: --against parses it.
        if json {
            print_json(&r)?;
        } else {
            print!("{}", device::render(&r));
        }
        return Ok(ExitCode::SUCCESS);
    }
    if a.drain {
        let bins = bin_dir(a.bin_dir.as_deref())?;
        let r = drain::run(&bins, a.quick, a.drain_concurrency)?;
        print!("{}", drain::render(&r));
        if json {
            print_json(&r)?;
        }
        let clean = r.status == "SUCCEEDED" && r.failed_gets == 0 && r.wrong_bytes == 0;
        return Ok(if clean {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        });
    }
    if a.events {
        let bins = bin_dir(a.bin_dir.as_deref())?;
        let r = events::run(&bins, a.quick, a.pairs)?;
        print!("{}", events::render(&r));
        if json {
            print_json(&r)?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    if a.caps {
        let r = caps::run(a.quick, a.pairs)?;
        print!("{}", caps::render(&r));
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
    let load_start = loadavg();
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
    let mut memcpy = limits::memcpy(memcpy_reps)?.samples;
    progress.show("loopback TCP");
    let mut loopback = limits::loopback(stream_bytes, stream_reps, pings)?;

    let data_dir = tempfile::Builder::new().prefix("lunakv-bench-").tempdir()?;
    progress.show("starting lunakv-master and lunakv-store");
    let mut stack = Stack::start(&StackOptions {
        bin_dir: bins.clone(),
        rpc_port: 0,
        master_metrics_port: 0,
        data_dir: data_dir.path().join("master"),
        store_port: 0,
        store_metrics_port: 0,
        segment_size: a.segment_size.clone(),
        // The services' info logs would bury the table; warnings and errors still show.
        default_log: Some("warn"),
    })?;
    let measured = measure_rows(&mut stack, &plan, &progress).and_then(|r| {
        let paired = measure_pairs(
            &stack.master_rpc,
            &plan,
            a.pairs,
            (memcpy_reps, stream_bytes),
            &progress,
        )?;
        stack.check_alive()?;
        Ok((r, paired))
    });
    progress.show("stopping lunakv-store and lunakv-master");
    let stopped = stack.stop();
    let ((rows, shm_offered), mut paired) = measured?;
    stopped?;
    // KV events' cost to a put: two stacks of their own, after this one is gone.
    progress.show("kv events on / off");
    let ev = events::run(&bins, a.quick, a.pairs)?;
    progress.done(&paired_line(&ev.paired));
    paired.push(ev.paired);

    // ...and after, so a noisy moment on a shared box shows as spread rather than bias.
    progress.show("memcpy");
    memcpy.extend(limits::memcpy(memcpy_reps)?.samples);
    progress.show("loopback TCP");
    loopback.merge(limits::loopback(stream_bytes, stream_reps, pings)?);
    progress.clear();
    let load = Load {
        start: load_start,
        end: loadavg(),
    };

    let report = build_report(
        a,
        &plan,
        shm_offered,
        rows,
        (Spread::of(memcpy), &loopback),
        paired,
        load,
    );
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

/// The ratio targets as paired trials: limit, row, limit, row, ... `pairs` times each.
fn measure_pairs(
    master: &str,
    plan: &Plan,
    pairs: usize,
    (memcpy_reps, stream_bytes): (usize, u64),
    progress: &Progress,
) -> anyhow::Result<Vec<PairedRatio>> {
    let size = 4 << 20;
    let mut tcp = GetBench::start(master, Transport::Tcp, size, plan)?;
    let tcp_pairs = interleave(
        pairs,
        |i| {
            progress.show(&format!("pair {}/{pairs}: loopback TCP", i + 1));
            Ok(limits::loopback(stream_bytes, 1, 0)?.stream().median)
        },
        |i| {
            progress.show(&format!("pair {}/{pairs}: tcp get 4 MiB", i + 1));
            tcp.pass()
        },
    )?;
    tcp.finish()?;
    let tcp = PairedRatio::judge(
        "tcp_get_4m_vs_loopback",
        "tcp get 4 MiB / loopback TCP",
        "GB/s",
        tcp_pairs,
        0.75,
    );
    progress.done(&paired_line(&tcp));
    let mut shm = GetBench::start(master, Transport::Shm, size, plan)?;
    let shm_pairs = interleave(
        pairs,
        |i| {
            progress.show(&format!("pair {}/{pairs}: memcpy", i + 1));
            Ok(limits::memcpy(memcpy_reps)?.median)
        },
        |i| {
            progress.show(&format!("pair {}/{pairs}: shm get 4 MiB", i + 1));
            shm.pass()
        },
    )?;
    shm.finish()?;
    let shm = PairedRatio::judge(
        "shm_get_4m_vs_memcpy",
        "shm get 4 MiB / memcpy",
        "GB/s",
        shm_pairs,
        0.5,
    );
    progress.done(&paired_line(&shm));
    Ok(vec![tcp, shm])
}

fn paired_line(p: &PairedRatio) -> String {
    format!(
        "{}: median {:.2}x (min {:.2}, max {:.2}) over {} pairs",
        p.label,
        p.median_ratio,
        p.min_ratio,
        p.max_ratio,
        p.pairs.len()
    )
}

fn find(rows: &[Row], name: &str) -> Option<Row> {
    rows.iter().find(|r| r.name == name).cloned()
}

fn build_report(
    a: &BenchArgs,
    plan: &Plan,
    shm_offered: bool,
    rows: Vec<Row>,
    (memcpy, lo): (Spread, &Loopback),
    paired: Vec<PairedRatio>,
    load: Load,
) -> Report {
    let gbps = |n: &str| find(&rows, n).map_or(0.0, |r| r.gbps);
    let p50 = |n: &str| find(&rows, n).map_or(0.0, |r| r.p50_us);
    let tcp_get_4m = gbps("tcp_get_4m_single");
    let shm_get_4m = gbps("shm_get_4m_single");
    let get_64k_p50 = p50("tcp_get_64k_single");
    let stream = lo.stream();
    // Ratio targets: the median of the paired ratios, with their spread in the rule's text.
    let mut targets: Vec<Target> = paired
        .iter()
        .map(|p| Target {
            name: p.name,
            value: p.median_ratio,
            unit: "x",
            threshold: p.threshold_ratio,
            rule: format!(
                "{} >= {:.2}x, median of {} paired ratios (min-max {:.2}-{:.2}; medians {:.2} / {:.2} {})",
                p.label,
                p.threshold_ratio,
                p.pairs.len(),
                p.min_ratio,
                p.max_ratio,
                p.median_of(|x| x.row),
                p.median_of(|x| x.limit),
                p.unit
            ),
            pass: p.pass,
        })
        .collect();
    targets.extend([Target {
        name: "get_64k_p50",
        value: get_64k_p50,
        unit: "us",
        threshold: 150.0,
        rule: "tcp get 64 KiB single p50 <= 150 us".to_owned(),
        pass: get_64k_p50 > 0.0 && get_64k_p50 <= 150.0,
    }]);
    Report {
        ok: true,
        quick: a.quick,
        pairs: a.pairs,
        load,
        paired,
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
        "  memcpy, one thread, 64 MiB from a segment {:>6.2} / {:.2} GB/s  ({} copies)",
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
    let _ = writeln!(
        o,
        "\nPaired trials (limit, row, limit, row, ...; load average {} at start, {} at end):",
        r.load.start, r.load.end
    );
    for p in &r.paired {
        let ratios: Vec<String> = p.pairs.iter().map(|x| format!("{:.2}", x.ratio)).collect();
        let _ = writeln!(o, "  {:<30} ratios {}", p.label, ratios.join(" "));
    }
    let _ = writeln!(o, "\nTargets:");
    for t in &r.targets {
        let _ = writeln!(
            o,
            "  {:<4} {:>8.2} {:<4} {}",
            if t.pass { "PASS" } else { "MISS" },
            t.value,
            t.unit,
            t.rule
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
            pairs: 5,
            bin_dir: None,
            offload: false,
            offload_dir: None,
            caps: false,
            events: false,
            drain: false,
            drain_concurrency: 16,
            trace: None,
            block_bytes: 16384,
            capacity_tokens: 3_000_000,
            ssd_tokens: 0,
            first: 0,
            time_scale: 0.0,
            master_args: Vec::new(),
            device: false,
            device_layers: 32,
            device_objects: 128,
            device_block_bytes: 32768,
            device_batches: None,
            against: None,
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
        let pair = |l: f64, r: f64| paired::Pair::new(l, r);
        let paired = vec![
            PairedRatio::judge(
                "tcp_get_4m_vs_loopback",
                "tcp get 4 MiB / loopback TCP",
                "GB/s",
                vec![pair(2.0, 1.8), pair(2.2, 0.5), pair(2.1, 1.7)],
                0.75,
            ),
            PairedRatio::judge(
                "shm_get_4m_vs_memcpy",
                "shm get 4 MiB / memcpy",
                "GB/s",
                vec![pair(6.0, 2.0), pair(5.0, 2.0), pair(7.0, 2.0)],
                0.5,
            ),
        ];
        let load = Load {
            start: "1.00 0.50 0.25".into(),
            end: "2.00 1.00 0.50".into(),
        };
        let r = build_report(
            &a,
            &Plan::quick(),
            true,
            rows,
            (Spread::of(vec![6.0, 5.0, 7.0]), &lo),
            paired,
            load,
        );
        let v = serde_json::to_value(&r).expect("json");
        for k in [
            "tcp_get_4m_gbps",
            "loopback_tcp_gbps",
            "shm_get_4m_gbps",
            "memcpy_gbps",
            "get_64k_p50_us",
            "rows",
            "paired",
            "load",
        ] {
            assert!(v.get(k).is_some(), "missing {k}");
        }
        assert_eq!(v["loopback_tcp_gbps"], 2.1);
        assert_eq!(v["memcpy_gbps"], 6.0);
        let pass: Vec<bool> = r.targets.iter().map(|t| t.pass).collect();
        // Median ratio 0.81 >= 0.75 despite one bad pair; 0.33 < 0.5; 160 > 150.
        assert_eq!(pass, vec![true, false, false]);
        assert_eq!(v["paired"][0]["pairs"][1]["row"], 0.5);
        assert_eq!(v["paired"][0]["pairs"].as_array().map(Vec::len), Some(3));
        let text = render(&r, "note");
        assert!(text.contains("PASS") && text.contains("MISS"), "{text}");
        assert!(text.contains("load average 1.00 0.50 0.25"), "{text}");
    }
}
