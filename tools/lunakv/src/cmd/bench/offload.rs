//! `lunakv bench --offload`: the SSD tier's figures, measured in one run on the same directory.
//!
//! - Offload write GB/s: [`lunakv_offload::DiskTier::store_batch`] in eviction-pass sized batches
//!   (16 x 4 MiB, fdatasync + index commit per batch), against raw sequential `write` of the same
//!   bytes in 4 MiB chunks with one fdatasync per 64 MiB, alternating so both see the same disk.
//!   Target: >= 70% of raw.
//! - Get-from-disk latency p50/p99 for 1 MiB and 4 MiB objects: its own `lunakv-master
//!   --enable_offload` and `lunakv-store --enable_offload` (64 MiB of DRAM), a workload 3x DRAM so
//!   the early keys are disk-only, then timed gets of those keys (the owner's LOAD: bucket read +
//!   CRC check + one tcp transfer). Recently written buckets are usually in the page cache; dropping
//!   it needs root, so the figure is the software path, not the device's random-read latency.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use lunakv_client::{ClientOptions, StoreClient};
use lunakv_launch::{Launch, Process};
use lunakv_offload::{DiskTier, OffloadConfig, StoreItem};

use crate::stack::{MASTER_BIN, START_TIMEOUT, STOP_GRACE, STORE_BIN, service_bin};

const CHUNK: usize = 4 << 20;
const BATCH: usize = 16;

/// Offload section results.
#[derive(Debug, serde::Serialize)]
pub struct OffloadReport {
    pub dir: String,
    pub bytes_per_rep: u64,
    pub raw_write_gbps: f64,
    pub offload_write_gbps: f64,
    pub ratio: f64,
    pub pass: bool,
    pub get_1m_p50_us: f64,
    pub get_1m_p99_us: f64,
    pub get_4m_p50_us: f64,
    pub get_4m_p99_us: f64,
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn raw_write(dir: &Path, total: u64, buf: &[u8]) -> anyhow::Result<f64> {
    let path = dir.join("raw-sequential.bin");
    let f = std::fs::File::create(&path).with_context(|| format!("create {}", path.display()))?;
    let t = Instant::now();
    let mut off = 0u64;
    let mut n = 0usize;
    while off < total {
        f.write_all_at(buf, off)?;
        off += buf.len() as u64;
        n += 1;
        if n.is_multiple_of(BATCH) {
            f.sync_data()?;
        }
    }
    f.sync_data()?;
    let r = gbps(total, t.elapsed());
    drop(f);
    let _ = std::fs::remove_file(&path);
    Ok(r)
}

fn tier_write(dir: &Path, total: u64, buf: &[u8], rep: u64) -> anyhow::Result<f64> {
    let tdir = dir.join(format!("tier-{rep}"));
    let (tier, _) = DiskTier::open(OffloadConfig::new(&tdir, total * 2))?;
    let keys: Vec<String> = (0..(total as usize / buf.len()) + BATCH)
        .map(|i| format!("bench-{i}"))
        .collect();
    let t = Instant::now();
    let mut written = 0u64;
    let mut i = 0usize;
    while written < total {
        let items: Vec<StoreItem<'_>> = (0..BATCH)
            .map(|j| StoreItem {
                key: &keys[i + j],
                generation: (i + j) as u64 + 1,
                bytes: buf,
                proof: None,
            })
            .collect();
        tier.store_batch(&items)?;
        i += BATCH;
        written += (BATCH * buf.len()) as u64;
    }
    let r = gbps(written, t.elapsed());
    drop(tier);
    let _ = std::fs::remove_dir_all(&tdir);
    Ok(r)
}

/// A service of a bench section; SIGTERM (then SIGKILL) when dropped.
pub(super) struct Svc(Process);

impl Svc {
    pub(super) fn pid(&self) -> u32 {
        self.0.pid()
    }
}

impl Drop for Svc {
    fn drop(&mut self) {
        let _ = self.0.terminate(STOP_GRACE);
    }
}

/// Starts `bin` quietly (`RUST_LOG=warn`, output kept for the error report) and returns its
/// listening line's fields once it carries `key`.
pub(super) fn spawn(
    bin: &Path,
    args: &[String],
    env: &[(&str, String)],
    key: &str,
) -> anyhow::Result<(Svc, HashMap<String, String>)> {
    let mut launch = Launch::new(bin)
        .args(args)
        .env("RUST_LOG", "warn")
        .keep_lines(30);
    for (k, v) in env {
        launch = launch.env(k, v);
    }
    let p = launch.spawn()?;
    let fields = p.wait_announce(key, START_TIMEOUT)?;
    Ok((Svc(p), fields))
}

/// A lunakv-store on loopback ephemeral ports with a DRAM segment of `size` ("512MB", bytes),
/// mounted at the master `rpc`; with `ssd`, an SSD tier in that directory of that many bytes.
pub(super) fn spawn_store(
    bins: &Path,
    rpc: &str,
    size: &str,
    ssd: Option<(&Path, u64)>,
) -> anyhow::Result<Svc> {
    let mut args = vec![
        format!("--master_server_address={rpc}"),
        "--host=127.0.0.1".into(),
        "--port=0".into(),
        "--metrics_port=0".into(),
        format!("--global_segment_size={size}"),
    ];
    let mut env = Vec::new();
    if let Some((dir, limit)) = ssd {
        args.push("--enable_offload=true".into());
        env.push((
            "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH",
            dir.display().to_string(),
        ));
        env.push(("MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", limit.to_string()));
    }
    let bin = crate::stack::service_bin(bins, crate::stack::STORE_BIN)?;
    Ok(spawn(&bin, &args, &env, "transfer")?.0)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Timed gets (µs) of disk-only objects of `size` bytes.
fn disk_gets(bins: &Path, dir: &Path, size: usize, n: usize) -> anyhow::Result<(f64, f64)> {
    let mdir = dir.join(format!("master-{size}"));
    let odir = dir.join(format!("store-{size}"));
    let (_m, master) = spawn(
        &service_bin(bins, MASTER_BIN)?,
        &[
            "--rpc_address=127.0.0.1".into(),
            "--rpc_port=0".into(),
            "--metrics_port=0".into(),
            format!("--data_dir={}", mdir.display()),
            "--enable_offload=true".into(),
        ],
        &[],
        "rpc",
    )?;
    let master = master.get("rpc").cloned().context("master rpc address")?;
    let (_s, _) = spawn(
        &service_bin(bins, STORE_BIN)?,
        &[
            format!("--master_server_address={master}"),
            "--host=127.0.0.1".into(),
            "--port=0".into(),
            "--metrics_port=0".into(),
            "--global_segment_size=64MB".into(),
            "--enable_offload=true".into(),
        ],
        &[(
            "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH",
            odir.display().to_string(),
        )],
        "transfer",
    )?;
    let c = StoreClient::connect(ClientOptions {
        master_server_address: master,
        enable_shm: false,
        ..ClientOptions::default()
    })?;
    let value = vec![0x5au8; size];
    let total = (3 * (64usize << 20)) / size;
    for i in 0..total {
        c.put(&format!("d-{i}"), &value)?;
    }
    let keys: Vec<String> = (0..n.min(total / 3)).map(|i| format!("d-{i}")).collect();
    let mut buf = vec![0u8; size];
    // First pass learns the disk locations (one master round trip each); the timed pass is the
    // steady state: one LOAD per get.
    for k in &keys {
        c.get_into(k, &mut buf)?;
    }
    let mut us = Vec::with_capacity(keys.len() * 3);
    for _ in 0..3 {
        for k in &keys {
            let t = Instant::now();
            c.get_into(k, &mut buf)?;
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    us.sort_by(f64::total_cmp);
    Ok((percentile(&us, 0.5), percentile(&us, 0.99)))
}

pub fn run(bins: &Path, dir: Option<&Path>, quick: bool) -> anyhow::Result<OffloadReport> {
    let tmp;
    let dir: PathBuf = match dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            d.to_path_buf()
        }
        None => {
            tmp = tempfile::Builder::new()
                .prefix("lunakv-bench-offload-")
                .tempdir()?;
            tmp.path().to_path_buf()
        }
    };
    let total: u64 = if quick { 128 << 20 } else { 1 << 30 };
    let reps = if quick { 2 } else { 3 };
    let buf: Vec<u8> = (0..CHUNK).map(|i| (i * 7 + 3) as u8).collect();
    let (mut raw, mut tier) = (Vec::new(), Vec::new());
    for rep in 0..reps {
        eprint!(".");
        let _ = std::io::stderr().flush();
        raw.push(raw_write(&dir, total, &buf)?);
        tier.push(tier_write(&dir, total, &buf, rep)?);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let raw_write_gbps = median(&mut raw);
    let offload_write_gbps = median(&mut tier);
    let ratio = if raw_write_gbps > 0.0 {
        offload_write_gbps / raw_write_gbps
    } else {
        0.0
    };
    let n = if quick { 16 } else { 48 };
    let (get_1m_p50_us, get_1m_p99_us) = disk_gets(bins, &dir, 1 << 20, n)?;
    let (get_4m_p50_us, get_4m_p99_us) = disk_gets(bins, &dir, 4 << 20, n)?;
    eprintln!();
    Ok(OffloadReport {
        dir: dir.display().to_string(),
        bytes_per_rep: total,
        raw_write_gbps,
        offload_write_gbps,
        ratio,
        pass: ratio >= 0.7,
        get_1m_p50_us,
        get_1m_p99_us,
        get_4m_p50_us,
        get_4m_p99_us,
    })
}

pub fn render(r: &OffloadReport) -> String {
    format!(
        "offload (dir {}, {} MiB per rep)\n  raw sequential write   {:>7.2} GB/s\n  offload write          {:>7.2} GB/s  ({:.0}% of raw; target >= 70%: {})\n  get from disk 1 MiB    p50 {:>8.0} us  p99 {:>8.0} us\n  get from disk 4 MiB    p50 {:>8.0} us  p99 {:>8.0} us\n",
        r.dir,
        r.bytes_per_rep >> 20,
        r.raw_write_gbps,
        r.offload_write_gbps,
        r.ratio * 100.0,
        if r.pass { "PASS" } else { "MISS" },
        r.get_1m_p50_us,
        r.get_1m_p99_us,
        r.get_4m_p50_us,
        r.get_4m_p99_us
    )
}
