//! `lunakv bench --drain`: what a drain job moves per second on loopback, and what the gets
//! served during it see (docs/BENCH.md, "Drain jobs"; docs/ARCHITECTURE.md "Drain jobs").
//!
//! A master with the SSD tier on, a source store loaded with objects (a tenth of them moved to
//! its SSD tier first, so the drain reads both tiers), then two empty target stores. A reader
//! gets every key over and over, checking each value, while `POST /api/v1/drain_jobs` drains
//! the source (16 moves in flight as `lunakv drain` asks, or --drain-concurrency; the master's
//! default byte rate). The figures: objects and bytes moved per second from the job's creation
//! to its SUCCEEDED report, the gets served meanwhile, their p50/p99 latency and how many failed
//! or read wrong bytes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use lunakv_client::{ClientOptions, StoreClient};

use super::offload::{Svc, spawn};
use crate::cmd::admin::Admin;
use crate::stack::{MASTER_BIN, STORE_BIN, service_bin};

#[derive(Debug, serde::Serialize)]
pub struct DrainReport {
    pub objects: u64,
    pub object_bytes: u64,
    /// Of `objects`, those only on the source's SSD tier when the drain began.
    pub disk_objects: u64,
    pub max_concurrency: u32,
    pub status: String,
    pub moved: u64,
    pub blocked: u64,
    pub failed_moves: u64,
    pub seconds: f64,
    pub objects_per_sec: f64,
    pub mib_per_sec: f64,
    /// Gets the reader completed between the job's creation and its end.
    pub gets_during: u64,
    pub failed_gets: u64,
    pub wrong_bytes: u64,
    pub get_p50_us: f64,
    pub get_p99_us: f64,
}

/// Object `i`'s bytes: its index, then a fill that differs per object.
fn value(i: u64, len: usize) -> Vec<u8> {
    let mut v = vec![(i % 251) as u8; len];
    v[..8].copy_from_slice(&i.to_le_bytes());
    v
}

fn store(
    bins: &std::path::Path,
    rpc: &str,
    size: u64,
    ssd: Option<&std::path::Path>,
) -> anyhow::Result<(Svc, String)> {
    let mut args = vec![
        format!("--master_server_address={rpc}"),
        "--host=127.0.0.1".into(),
        "--port=0".into(),
        "--metrics_port=0".into(),
        format!("--global_segment_size={size}"),
    ];
    let mut env = Vec::new();
    if let Some(dir) = ssd {
        args.push("--enable_offload=true".into());
        env.push((
            "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH",
            dir.display().to_string(),
        ));
    }
    let (svc, f) = spawn(&service_bin(bins, STORE_BIN)?, &args, &env, "transfer")?;
    let seg = f
        .get("transfer")
        .cloned()
        .context("store transfer address")?;
    Ok((svc, seg))
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

pub fn run(bins: &std::path::Path, quick: bool, concurrency: u32) -> anyhow::Result<DrainReport> {
    let (n, len): (u64, usize) = if quick {
        (512, 64 << 10)
    } else {
        (2048, 256 << 10)
    };
    let disk_n = n / 10;
    let dir = tempfile::Builder::new()
        .prefix("lunakv-bench-drain-")
        .tempdir()?;
    let (_master, f) = spawn(
        &service_bin(bins, MASTER_BIN)?,
        &[
            "--rpc_address=127.0.0.1".into(),
            "--rpc_port=0".into(),
            "--metrics_port=0".into(),
            format!("--data_dir={}", dir.path().join("master").display()),
            "--enable_offload=true".into(),
        ],
        &[],
        "rpc",
    )?;
    let rpc = f.get("rpc").cloned().context("master rpc address")?;
    let admin = f.get("admin").cloned().context("master admin address")?;
    let total = n * len as u64;
    let pool = total + total / 2;
    let ssd = dir.path().join("ssd");
    let (_source, source) = store(bins, &rpc, pool, Some(&ssd))?;
    let client = StoreClient::connect(ClientOptions {
        master_server_address: rpc.clone(),
        ..ClientOptions::default()
    })?;
    let keys: Vec<String> = (0..n).map(|i| format!("drain-bench-{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        client.put(k, &value(i as u64, len))?;
    }
    for k in &keys[..disk_n as usize] {
        client.offload_key(k)?;
    }
    let (_t1, _) = store(bins, &rpc, pool / 2 + pool / 4, None)?;
    let (_t2, _) = store(bins, &rpc, pool / 2 + pool / 4, None)?;

    let stop = Arc::new(AtomicBool::new(false));
    let counting = Arc::new(AtomicBool::new(false));
    let reader = {
        let (stop, counting, keys, rpc) = (stop.clone(), counting.clone(), keys.clone(), rpc);
        std::thread::spawn(move || -> anyhow::Result<(Vec<f64>, u64, u64)> {
            let c = StoreClient::connect(ClientOptions {
                master_server_address: rpc,
                ..ClientOptions::default()
            })?;
            let (mut us, mut failed, mut wrong) = (Vec::new(), 0u64, 0u64);
            let mut buf = vec![0u8; len];
            while !stop.load(Ordering::SeqCst) {
                for (i, k) in keys.iter().enumerate() {
                    let t = Instant::now();
                    let r = c.get_into(k, &mut buf);
                    let took = t.elapsed().as_secs_f64() * 1e6;
                    if !counting.load(Ordering::SeqCst) {
                        continue;
                    }
                    match r {
                        Ok(_) if buf == value(i as u64, len) => us.push(took),
                        Ok(_) => wrong += 1,
                        Err(_) => failed += 1,
                    }
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                }
            }
            Ok((us, failed, wrong))
        })
    };
    // The reader's first pass learns every location (it reads the old copies during the drain).
    std::thread::sleep(Duration::from_millis(500));

    let admin = Admin::new(format!("http://{admin}"))?;
    let body = serde_json::json!({"segments": [source], "max_concurrency": concurrency});
    counting.store(true, Ordering::SeqCst);
    let t0 = Instant::now();
    let created = admin.call("POST", "/api/v1/drain_jobs", &body.to_string())?;
    let id = created["job_id"].as_str().unwrap_or_default().to_string();
    let report = loop {
        let v = admin.call("GET", &format!("/api/v1/drain_jobs/query?job_id={id}"), "")?;
        if matches!(
            v["status_name"].as_str(),
            Some("SUCCEEDED" | "FAILED" | "CANCELED")
        ) {
            break v;
        }
        if t0.elapsed() > Duration::from_secs(600) {
            bail!("the drain did not end within 10 minutes: {v}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let seconds = t0.elapsed().as_secs_f64();
    counting.store(false, Ordering::SeqCst);
    stop.store(true, Ordering::SeqCst);
    let (mut us, failed_gets, wrong_bytes) = reader
        .join()
        .map_err(|_| anyhow::anyhow!("the reader thread panicked"))??;
    us.sort_by(f64::total_cmp);
    let moved = report["succeeded_units"].as_u64().unwrap_or(0);
    let bytes = report["migrated_bytes"].as_u64().unwrap_or(0);
    Ok(DrainReport {
        objects: n,
        object_bytes: len as u64,
        disk_objects: disk_n,
        max_concurrency: concurrency,
        status: report["status_name"].as_str().unwrap_or_default().into(),
        moved,
        blocked: report["blocked_units"].as_u64().unwrap_or(0),
        failed_moves: report["failed_units"].as_u64().unwrap_or(0),
        seconds,
        objects_per_sec: moved as f64 / seconds,
        mib_per_sec: bytes as f64 / seconds / f64::from(1u32 << 20),
        gets_during: us.len() as u64 + failed_gets + wrong_bytes,
        failed_gets,
        wrong_bytes,
        get_p50_us: percentile(&us, 0.5),
        get_p99_us: percentile(&us, 0.99),
    })
}

pub fn render(r: &DrainReport) -> String {
    format!(
        "drain of a loaded store on loopback ({} objects of {} KiB, {} of them on its SSD tier; \
         {} moves in flight, the master's default byte rate):\n  \
         {}: {} moved, {} blocked, {} failed moves in {:.2} s: {:.0} objects/s, {:.1} MiB/s\n  \
         gets during the drain: {} ({} failed, {} wrong bytes), p50 {:.0} us, p99 {:.0} us\n",
        r.objects,
        r.object_bytes >> 10,
        r.disk_objects,
        r.max_concurrency,
        r.status,
        r.moved,
        r.blocked,
        r.failed_moves,
        r.seconds,
        r.objects_per_sec,
        r.mib_per_sec,
        r.gets_during,
        r.failed_gets,
        r.wrong_bytes,
        r.get_p50_us,
        r.get_p99_us
    )
}
