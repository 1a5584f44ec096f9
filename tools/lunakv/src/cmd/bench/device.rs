//! `lunakv bench --device` (docs/GPU.md, "Everything but the copy"): vLLM's batch shape
//! (objects x layers x K/V pieces of one block each, the defaults of `make test-gpu`) through
//! the device test double (`LUNAKV_DEVICE=fake`), embedded, over shm and over tcp. Per batch it separates the whole
//! call from the time inside the device copies (the double times its copies), so what is left
//! is everything but the copy: the master's round trips, per-key and per-piece work. On a GPU
//! the copy is the DMA; this overhead is what a 256 MiB batch pays on top of it (docs/GPU.md).
//!
//! `--against BIN` runs `BIN bench --device --json` and this build alternately, `--pairs`
//! times, each a process of its own, and prints the overheads side by side (docs/BENCH.md).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use lunakv_client::{ClientOptions, ReplicateConfig, StoreClient};
use lunakv_transfer::device::fake::{self, FakeKvCache};
use serde::{Deserialize, Serialize};

use super::paired::{Pair, PairedRatio, loadavg};
use super::progress::Progress;
use super::stats::percentile;
use crate::output::human_bytes;
use crate::stack::{Stack, StackOptions};

/// The batch: `objects` objects of `2 * layers` pieces of `block_bytes` each.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct DevicePlan {
    pub layers: usize,
    pub objects: usize,
    pub block_bytes: usize,
    /// Timed batches per mode and direction (after one untimed warm-up batch).
    pub batches: usize,
}

impl DevicePlan {
    fn batch_bytes(&self) -> u64 {
        (self.objects * 2 * self.layers * self.block_bytes) as u64
    }
    fn cache_bytes(&self) -> usize {
        2 * self.objects * self.block_bytes
    }
}

/// One mode and direction: per-batch milliseconds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceRow {
    pub mode: String,
    pub op: String,
    pub call_ms_p50: f64,
    pub call_ms_p99: f64,
    pub copy_ms_p50: f64,
    pub copy_ms_p99: f64,
    pub overhead_ms_p50: f64,
    pub overhead_ms_p99: f64,
    /// Driver copy calls per batch (p50): a 2D copy is one, whatever its rows. Absent from
    /// the JSON of builds before it was counted.
    #[serde(default)]
    pub calls_p50: f64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct DeviceReport {
    pub plan: DevicePlan,
    pub batch_bytes: u64,
    pub load_start: String,
    pub load_end: String,
    pub rows: Vec<DeviceRow>,
    /// 2D copies the double refused and runs split during the run (docs/GPU.md).
    pub refused_2d: u64,
    pub split_runs: u64,
}

/// The bytes every source tensor starts with (layer `l`).
fn pattern(len: usize, l: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(l as u8) ^ (i >> 13) as u8)
        .collect()
}

pub fn run(bins: &Path, plan: DevicePlan, progress: &Progress) -> anyhow::Result<DeviceReport> {
    if plan.layers == 0 || plan.objects == 0 || plan.block_bytes == 0 || plan.batches == 0 {
        bail!(
            "--device-layers, --device-objects, --device-block-bytes and --device-batches must be at least 1 (got {}, {}, {}, {})",
            plan.layers,
            plan.objects,
            plan.block_bytes,
            plan.batches
        );
    }
    let f = fake::install(false).context(
        "lunakv bench --device needs the device test double: run it with LUNAKV_DEVICE unset or =fake",
    )?;
    let load_start = loadavg();
    let before = lunakv_transfer::device::split_stats();
    let src = FakeKvCache::new(plan.layers, plan.objects, plan.block_bytes)?;
    let mut dst = FakeKvCache::new(plan.layers, plan.objects, plan.block_bytes)?;
    for l in 0..plan.layers {
        src.write_layer(l, &pattern(plan.cache_bytes(), l))?;
    }
    let batch = plan.batch_bytes();
    // Room for two batches: the previous batch is removed before the next put, and a removal
    // returns its space through the owner's acknowledgement.
    let segment = (3 * batch).max(64 << 20);
    let data_dir = tempfile::Builder::new()
        .prefix("lunakv-bench-device-")
        .tempdir()?;
    progress.show("starting lunakv-master and lunakv-store");
    let mut stack = Stack::start(&StackOptions {
        bin_dir: bins.to_path_buf(),
        rpc_port: 0,
        master_metrics_port: 0,
        data_dir: data_dir.path().join("master"),
        store_port: 0,
        store_metrics_port: 0,
        segment_size: segment.to_string(),
        default_log: Some("warn"),
    })?;
    let rows = (|| {
        let mut rows = Vec::new();
        for mode in ["embedded", "shm", "tcp"] {
            progress.show(&format!("device batches, {mode}"));
            let client = StoreClient::connect(ClientOptions {
                master_server_address: stack.master_rpc.clone(),
                global_segment_size: if mode == "embedded" { segment } else { 0 },
                enable_shm: mode != "tcp",
                ..ClientOptions::default()
            })
            .with_context(|| format!("connecting the {mode} client"))?;
            let mut cfg = ReplicateConfig::default();
            if mode == "embedded" {
                cfg.preferred_segment = client.segment_name();
            }
            let r = run_mode(f, &client, &cfg, mode, &src, &mut dst, plan);
            let _ = client.close();
            rows.extend(r?);
            stack.check_alive()?;
        }
        Ok::<_, anyhow::Error>(rows)
    })();
    let stopped = stack.stop();
    let rows = rows?;
    stopped?;
    let after = lunakv_transfer::device::split_stats();
    Ok(DeviceReport {
        plan,
        batch_bytes: batch,
        load_start,
        load_end: loadavg(),
        rows,
        refused_2d: after.refused_2d - before.refused_2d,
        split_runs: after.split_runs - before.split_runs,
    })
}

fn run_mode(
    f: &fake::Fake,
    c: &StoreClient,
    cfg: &ReplicateConfig,
    mode: &str,
    src: &FakeKvCache,
    dst: &mut FakeKvCache,
    plan: DevicePlan,
) -> anyhow::Result<Vec<DeviceRow>> {
    for cache in [src, &*dst] {
        for &t in cache.tensors() {
            c.register_buffer(t, plan.cache_bytes())
                .context("register_buffer on the fake KV cache")?;
        }
    }
    let mut put = Samples::default();
    let mut get = Samples::default();
    for round in 0..=plan.batches {
        let keys: Vec<String> = (0..plan.objects)
            .map(|i| format!("bench-device-{mode}-{round}-{i}"))
            .collect();
        let items: Vec<(&str, Vec<&[u8]>)> = keys
            .iter()
            .map(String::as_str)
            .zip(src.pieces(0..plan.objects))
            .collect();
        let s0 = f.stats();
        let t = Instant::now();
        let res = c.batch_put(&items, &cfg.clone());
        let call = t.elapsed().as_nanos() as u64;
        let s1 = f.stats();
        let (copy, calls) = (s1.copy_ns - s0.copy_ns, s1.copy_calls - s0.copy_calls);
        if let Some(e) = res.into_iter().find_map(Result::err) {
            bail!("{mode} batch put: {e}");
        }
        drop(items);
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut dsts = dst.pieces_mut(0..plan.objects);
        let s0 = f.stats();
        let t = Instant::now();
        let res = c.batch_get_into(&key_refs, &mut dsts);
        let gcall = t.elapsed().as_nanos() as u64;
        let s1 = f.stats();
        let (gcopy, gcalls) = (s1.copy_ns - s0.copy_ns, s1.copy_calls - s0.copy_calls);
        drop(dsts);
        if let Some(e) = res.into_iter().find_map(Result::err) {
            bail!("{mode} batch get: {e}");
        }
        if round == 0 {
            // The warm-up batch also proves the bytes: every block where its piece says.
            for l in 0..plan.layers {
                let want = pattern(plan.cache_bytes(), l);
                if dst.read_layer(l)? != want {
                    bail!("{mode}: layer {l} read back differs from what was put");
                }
            }
        } else {
            put.push(call, copy, calls);
            get.push(gcall, gcopy, gcalls);
        }
        for r in c.batch_remove(&key_refs, true) {
            r.with_context(|| format!("{mode}: removing a benchmark batch"))?;
        }
    }
    Ok(vec![put.row(mode, "put"), get.row(mode, "get")])
}

#[derive(Default)]
struct Samples {
    call: Vec<f64>,
    copy: Vec<f64>,
    overhead: Vec<f64>,
    calls: Vec<f64>,
}

impl Samples {
    fn push(&mut self, call_ns: u64, copy_ns: u64, calls: u64) {
        let ms = |ns: u64| ns as f64 / 1e6;
        self.call.push(ms(call_ns));
        self.copy.push(ms(copy_ns));
        self.overhead.push(ms(call_ns.saturating_sub(copy_ns)));
        self.calls.push(calls as f64);
    }
    fn row(mut self, mode: &str, op: &str) -> DeviceRow {
        for v in [
            &mut self.call,
            &mut self.copy,
            &mut self.overhead,
            &mut self.calls,
        ] {
            v.sort_by(f64::total_cmp);
        }
        DeviceRow {
            mode: mode.into(),
            op: op.into(),
            call_ms_p50: percentile(&self.call, 50.0),
            call_ms_p99: percentile(&self.call, 99.0),
            copy_ms_p50: percentile(&self.copy, 50.0),
            copy_ms_p99: percentile(&self.copy, 99.0),
            overhead_ms_p50: percentile(&self.overhead, 50.0),
            overhead_ms_p99: percentile(&self.overhead, 99.0),
            calls_p50: percentile(&self.calls, 50.0),
        }
    }
}

pub fn render(r: &DeviceReport) -> String {
    use std::fmt::Write as _;
    let p = &r.plan;
    let mut s = format!(
        "lunakv bench --device: {} objects x {} layers x K/V of {} ({} per batch), {} batches per row, \
         test double (LUNAKV_DEVICE=fake), load {} -> {}\n\
         {:<9} {:<4} {:>9} {:>9} {:>9} {:>9} {:>12} {:>12} {:>6}\n",
        p.objects,
        p.layers,
        human_bytes(p.block_bytes as u64),
        human_bytes(r.batch_bytes),
        p.batches,
        r.load_start,
        r.load_end,
        "MODE",
        "OP",
        "CALL p50",
        "p99",
        "COPY p50",
        "p99",
        "OVERHEAD p50",
        "p99 (ms)",
        "CALLS"
    );
    for row in &r.rows {
        let _ = writeln!(
            s,
            "{:<9} {:<4} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>12.2} {:>12.2} {:>6.0}",
            row.mode,
            row.op,
            row.call_ms_p50,
            row.call_ms_p99,
            row.copy_ms_p50,
            row.copy_ms_p99,
            row.overhead_ms_p50,
            row.overhead_ms_p99,
            row.calls_p50
        );
    }
    let _ = writeln!(
        s,
        "CALLS: device copy calls per batch (a 2D copy is one); 2D copies refused {}, runs split {} \
         (the double refuses what an H200 refused)",
        r.refused_2d, r.split_runs
    );
    s
}

/// `--against BIN`: the other build and this one alternately, `pairs` times, each a process
/// of its own with the same plan; per mode and direction, the overhead p50 of each pair.
pub fn against(
    other: &Path,
    bins: Option<&Path>,
    plan: DevicePlan,
    pairs: usize,
    progress: &Progress,
) -> anyhow::Result<Vec<PairedRatio>> {
    let me = std::env::current_exe().context("finding this lunakv executable")?;
    let run_one = |exe: &PathBuf, i: usize, which: &str| -> anyhow::Result<DeviceReport> {
        progress.show(&format!("pair {}/{pairs}: {which} build", i + 1));
        let mut cmd = std::process::Command::new(exe);
        cmd.args([
            "bench",
            "--device",
            "--json",
            "--device-layers",
            &plan.layers.to_string(),
            "--device-objects",
            &plan.objects.to_string(),
            "--device-block-bytes",
            &plan.block_bytes.to_string(),
            "--device-batches",
            &plan.batches.to_string(),
        ]);
        if let Some(b) = bins {
            cmd.arg("--bin-dir").arg(b);
        }
        let out = cmd
            .output()
            .with_context(|| format!("running {}", exe.display()))?;
        if !out.status.success() {
            bail!(
                "{} bench --device failed ({}): {}",
                exe.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        serde_json::from_slice(&out.stdout).with_context(|| {
            format!(
                "{} bench --device --json printed no report (a build without --device?)",
                exe.display()
            )
        })
    };
    let other = other.to_path_buf();
    let mut runs = Vec::with_capacity(pairs);
    for i in 0..pairs {
        let old = run_one(&other, i, "other")?;
        let new = run_one(&me, i, "this")?;
        runs.push((old, new));
    }
    let Some((first, _)) = runs.first() else {
        return Ok(Vec::new());
    };
    let names: Vec<(String, String)> = first
        .rows
        .iter()
        .map(|r| (r.mode.clone(), r.op.clone()))
        .collect();
    let mut out = Vec::new();
    for (mode, op) in names {
        let find = |rep: &DeviceReport| {
            rep.rows
                .iter()
                .find(|r| r.mode == mode && r.op == op)
                .map_or(0.0, |r| r.overhead_ms_p50)
        };
        // Lower is better: the ratio is other / this, so > 1 means this build is faster.
        let ps = runs
            .iter()
            .map(|(o, n)| Pair::new(find(n), find(o)))
            .collect();
        let label: &'static str = Box::leak(format!("{mode} {op} overhead p50").into_boxed_str());
        out.push(PairedRatio::judge(
            label,
            label,
            "ms (other / this)",
            ps,
            1.0,
        ));
    }
    Ok(out)
}
