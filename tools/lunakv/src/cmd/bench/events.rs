//! What publishing KV events costs a put (docs/EVENTS.md): a paired target of `lunakv bench`,
//! and the whole of `lunakv bench --events`.
//!
//! Two stacks side by side, each its own lunakv-master + lunakv-store on loopback: one with
//! events off, one with `--enable_kv_event_publish` and a subscriber in this process that reads
//! every message. Passes of small vLLM-keyed puts (4 KiB, one object per call) alternate between
//! them so both see the same machine. Each pair of passes gives a ratio (on / off); the verdict
//! is on the median pair ratio (target >= 0.95), printed with its min-max, as the other benches.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use lunakv_client::{ClientOptions, StoreClient};

use super::offload::{Svc, spawn, spawn_store};
use super::paired::{Pair, PairedRatio, median};
use crate::stack::{MASTER_BIN, service_bin};

const VALUE: usize = 4096;

#[derive(Debug, serde::Serialize)]
pub struct EventsReport {
    pub object_bytes: usize,
    pub puts_per_pass: usize,
    /// Per pair: `limit` = put ops/s with events off, `row` = with events on; the verdict is
    /// the median on / off (target >= 0.95).
    pub paired: PairedRatio,
    /// Master CPU time per put (all its threads), median over the passes: where an events
    /// cost shows up when the machine is not idle enough for put ops/s to show it.
    pub off_master_cpu_us_per_put: f64,
    pub on_master_cpu_us_per_put: f64,
    /// Events the subscriber received (every put's store event, if none was dropped).
    pub events_received: u64,
}

struct Side {
    master: Svc,
    _store: Svc,
    client: StoreClient,
    events: Option<String>,
}

fn start(bins: &std::path::Path, dir: &std::path::Path, events: bool) -> anyhow::Result<Side> {
    let mut args = vec![
        "--rpc_address=127.0.0.1".to_string(),
        "--rpc_port=0".into(),
        "--metrics_port=0".into(),
        format!("--data_dir={}", dir.display()),
    ];
    if events {
        args.push("--enable_kv_event_publish=true".into());
        args.push("--kv_event_publisher_endpoint=tcp://127.0.0.1:*".into());
    }
    let (master, f) = spawn(&service_bin(bins, MASTER_BIN)?, &args, &[], "rpc")?;
    let rpc = f.get("rpc").cloned().context("master rpc address")?;
    let store = spawn_store(bins, &rpc, "512MB", None)?;
    let client = StoreClient::connect(ClientOptions {
        master_server_address: rpc,
        ..ClientOptions::default()
    })?;
    Ok(Side {
        master,
        _store: store,
        client,
        events: f.get("events").cloned(),
    })
}

/// Events in a Mooncake batch, `[ts_ms, [event, ...], dp_rank]` (RFC #1527, the default) or
/// `[ts, [event, ...]]` (the older array form), read from the headers alone: a real subscriber
/// runs elsewhere, and decoding every event here (as `lunakv events` does) took the
/// benchmark's own CPU from the puts it measures on a 2-core machine.
fn batch_len(payload: &[u8]) -> Option<u64> {
    let mut r = payload;
    matches!(rmp::decode::read_array_len(&mut r).ok()?, 2 | 3).then_some(())?;
    let mut float = r;
    if rmp::decode::read_f64(&mut float).is_ok() {
        r = float;
    } else {
        rmp::decode::read_int::<i64, _>(&mut r).ok()?;
    }
    rmp::decode::read_array_len(&mut r).ok().map(u64::from)
}

/// CPU time of every thread of process `pid` so far, in ns (`/proc/PID/task/*/schedstat`, which
/// counts in ns where `/proc/PID/stat` counts in 10 ms ticks); 0 where /proc cannot tell.
fn process_cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// One timed pass: put ops/s and the master's CPU us per put.
fn pass(side: &Side, tag: &str, n: usize, value: &[u8]) -> anyhow::Result<(f64, f64)> {
    let c = &side.client;
    let pid = side.master.pid();
    let cpu = process_cpu_ns(pid);
    let keys: Vec<String> = (0..n)
        .map(|i| format!("bench@Qwen3-8B@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{tag}{i:056x}"))
        .collect();
    let t = Instant::now();
    for k in &keys {
        c.put(k, value)?;
    }
    let ops = n as f64 / t.elapsed().as_secs_f64();
    let cpu_us = process_cpu_ns(pid).saturating_sub(cpu) as f64 / 1e3 / n as f64;
    // Room for the next pass; untimed.
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    c.batch_remove(&refs, true);
    Ok((ops, cpu_us))
}

/// Runs `passes` pairs (2000 puts per pass with `quick`, else 20000).
pub fn run(bins: &std::path::Path, quick: bool, passes: usize) -> anyhow::Result<EventsReport> {
    let tmp = tempfile::Builder::new()
        .prefix("lunakv-bench-events-")
        .tempdir()?;
    let off = start(bins, &tmp.path().join("off"), false)?;
    let on = start(bins, &tmp.path().join("on"), true)?;
    let endpoint = on
        .events
        .clone()
        .context("the events master printed no events=")?;
    let received = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB)?;
    sub.set_subscribe(b"")?;
    sub.set_rcvtimeo(100)?;
    sub.connect(&endpoint)?;
    let reader = {
        let (received, stop) = (received.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(frames) = sub.recv_multipart(0)
                    && let Some(p) = frames.get(2)
                    && let Some(n) = batch_len(p)
                {
                    received.fetch_add(n, Ordering::Relaxed);
                }
            }
        })
    };
    // The subscription has to reach the publisher before the first timed put.
    std::thread::sleep(Duration::from_millis(300));
    let n = if quick { 2000 } else { 20000 };
    let value = vec![0x42u8; VALUE];
    // Every put and every untimed removal of the events side is one event. Before each timed
    // pass the subscriber must have them all, so no pass shares the machine with the
    // publishing of the previous one's removals.
    let mut expected = 0u64;
    let settle = |expected: u64| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while received.load(Ordering::Relaxed) < expected && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    pass(&off, "w0", n / 5, &value)?;
    pass(&on, "w1", n / 5, &value)?;
    expected += 2 * (n / 5) as u64;
    let (mut offs, mut ons, mut off_cpu, mut on_cpu) = (vec![], vec![], vec![], vec![]);
    for p in 0..passes {
        // Alternate which side goes first, so drift on a shared box hits both.
        let order = if p % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for events in order {
            settle(expected);
            let (side, tag) = if events { (&on, "b") } else { (&off, "a") };
            let (ops, cpu) = pass(side, &format!("{tag}{p}"), n, &value)?;
            if events {
                expected += 2 * n as u64;
                ons.push(ops);
                on_cpu.push(cpu);
            } else {
                offs.push(ops);
                off_cpu.push(cpu);
            }
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let _ = reader.join();
    let pairs = offs.iter().zip(&ons).map(|(off, on)| Pair::new(*off, *on));
    Ok(EventsReport {
        object_bytes: VALUE,
        puts_per_pass: n,
        paired: PairedRatio::judge(
            "kv_events_put_on_vs_off",
            "put ops/s, kv events on / off",
            "puts/s",
            pairs.collect(),
            0.95,
        ),
        off_master_cpu_us_per_put: median(&off_cpu),
        on_master_cpu_us_per_put: median(&on_cpu),
        events_received: received.load(Ordering::Relaxed),
    })
}

pub fn render(r: &EventsReport) -> String {
    let p = &r.paired;
    format!(
        "lunakv bench --events: put {} B objects, one per call, {} per pass x {} pairs, \
         alternating two stacks\n\
         {:<34} {:>12}\n\
         {:<34} {:>12.0}\n\
         {:<34} {:>12.0}\n\
         {:<34} {:>11.3}x  [{:.3}-{:.3}] median of per-pair ratios (target >= 0.95x: {})\n\
         master CPU per put: {:.1} us off, {:.1} us on\n\
         events received by the subscriber: {}\n",
        r.object_bytes,
        r.puts_per_pass,
        p.pairs.len(),
        "",
        "put ops/s",
        "kv events off",
        p.median_of(|x| x.limit),
        "kv events on + 1 subscriber",
        p.median_of(|x| x.row),
        "on / off",
        p.median_ratio,
        p.min_ratio,
        p.max_ratio,
        if p.pass { "pass" } else { "FAIL" },
        r.off_master_cpu_us_per_put,
        r.on_master_cpu_us_per_put,
        r.events_received
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_len_counts_the_events_of_a_mooncake_batch() {
        let mut buf = Vec::new();
        rmp::encode::write_array_len(&mut buf, 2).unwrap();
        rmp::encode::write_f64(&mut buf, 1.7e9).unwrap();
        rmp::encode::write_array_len(&mut buf, 3).unwrap();
        for _ in 0..3 {
            rmp::encode::write_array_len(&mut buf, 1).unwrap();
            rmp::encode::write_str(&mut buf, "RemoveAllEvent").unwrap();
        }
        assert_eq!(batch_len(&buf), Some(3));
        assert_eq!(batch_len(&buf[..5]), None, "cut short");
        assert_eq!(batch_len(b"\x93"), None, "no timestamp");
        assert_eq!(batch_len(b"\x91\x00"), None, "not a batch");
    }

    #[test]
    fn batch_len_counts_the_events_of_an_rfc1527_batch() {
        // [1700000000123, [{}, {}], 0]: the timestamp in ms, an int.
        let mut buf = Vec::new();
        rmp::encode::write_array_len(&mut buf, 3).unwrap();
        rmp::encode::write_sint(&mut buf, 1_700_000_000_123).unwrap();
        rmp::encode::write_array_len(&mut buf, 2).unwrap();
        for _ in 0..2 {
            rmp::encode::write_map_len(&mut buf, 0).unwrap();
        }
        rmp::encode::write_uint(&mut buf, 0).unwrap();
        assert_eq!(batch_len(&buf), Some(2));
    }
}
