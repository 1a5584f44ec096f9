//! `lunakv bench --events`: what publishing KV events costs a put (docs/EVENTS.md).
//!
//! Two stacks side by side, each its own lunakv-master + lunakv-store on loopback: one with
//! events off, one with `--enable_kv_event_publish` and a subscriber in this process that reads
//! every message. Passes of small vLLM-keyed puts (4 KiB, one object per call) alternate between
//! them so both see the same machine; the figure is each side's median put ops/s, and the target
//! is on >= 0.95 x off.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use lunakv_client::{ClientOptions, StoreClient};

use super::offload::{Svc, spawn};
use crate::stack::{MASTER_BIN, STORE_BIN, service_bin};

const VALUE: usize = 4096;

#[derive(Debug, serde::Serialize)]
pub struct EventsReport {
    pub object_bytes: usize,
    pub puts_per_pass: usize,
    pub passes: usize,
    pub off_put_ops: f64,
    pub on_put_ops: f64,
    pub ratio: f64,
    pub pass: bool,
    /// Events the subscriber received (every put's store event, if none was dropped).
    pub events_received: u64,
}

struct Side {
    _master: Svc,
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
    let (store, _) = spawn(
        &service_bin(bins, STORE_BIN)?,
        &[
            format!("--master_server_address={rpc}"),
            "--host=127.0.0.1".into(),
            "--port=0".into(),
            "--metrics_port=0".into(),
            "--global_segment_size=512MB".into(),
        ],
        &[],
        "transfer",
    )?;
    let client = StoreClient::connect(ClientOptions {
        master_server_address: rpc,
        ..ClientOptions::default()
    })?;
    Ok(Side {
        _master: master,
        _store: store,
        client,
        events: f.get("events").cloned(),
    })
}

fn pass(c: &StoreClient, tag: &str, n: usize, value: &[u8]) -> anyhow::Result<f64> {
    let keys: Vec<String> = (0..n)
        .map(|i| format!("bench@Qwen3-8B@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{tag}{i:056x}"))
        .collect();
    let t = Instant::now();
    for k in &keys {
        c.put(k, value)?;
    }
    let ops = n as f64 / t.elapsed().as_secs_f64();
    // Room for the next pass; untimed.
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    c.batch_remove(&refs, true);
    Ok(ops)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

pub fn run(bins: &std::path::Path, quick: bool) -> anyhow::Result<EventsReport> {
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
                    && let Ok((_, evs)) = crate::cmd::events::decode_batch(p)
                {
                    received.fetch_add(evs.len() as u64, Ordering::Relaxed);
                }
            }
        })
    };
    // The subscription has to reach the publisher before the first timed put.
    std::thread::sleep(Duration::from_millis(300));
    let (n, passes) = if quick { (1000, 3) } else { (5000, 5) };
    let value = vec![0x42u8; VALUE];
    pass(&off.client, "w0", n / 5, &value)?;
    pass(&on.client, "w1", n / 5, &value)?;
    let (mut offs, mut ons) = (Vec::new(), Vec::new());
    for p in 0..passes {
        // Alternate which side goes first, so drift on a shared box hits both.
        if p % 2 == 0 {
            offs.push(pass(&off.client, &format!("a{p}"), n, &value)?);
            ons.push(pass(&on.client, &format!("b{p}"), n, &value)?);
        } else {
            ons.push(pass(&on.client, &format!("b{p}"), n, &value)?);
            offs.push(pass(&off.client, &format!("a{p}"), n, &value)?);
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let _ = reader.join();
    let (off_ops, on_ops) = (median(offs), median(ons));
    let ratio = if off_ops > 0.0 { on_ops / off_ops } else { 0.0 };
    Ok(EventsReport {
        object_bytes: VALUE,
        puts_per_pass: n,
        passes,
        off_put_ops: off_ops,
        on_put_ops: on_ops,
        ratio,
        pass: ratio >= 0.95,
        events_received: received.load(Ordering::Relaxed),
    })
}

pub fn render(r: &EventsReport) -> String {
    format!(
        "lunakv bench --events: put {} B objects, one per call, {} per pass x {} passes, \
         alternating two stacks\n\
         {:<34} {:>12}\n\
         {:<34} {:>12.0}\n\
         {:<34} {:>12.0}\n\
         {:<34} {:>11.3}x  (target >= 0.95x: {})\n\
         events received by the subscriber: {}\n",
        r.object_bytes,
        r.puts_per_pass,
        r.passes,
        "",
        "put ops/s",
        "kv events off",
        r.off_put_ops,
        "kv events on + 1 subscriber",
        r.on_put_ops,
        "on / off",
        r.ratio,
        if r.pass { "pass" } else { "FAIL" },
        r.events_received
    )
}
