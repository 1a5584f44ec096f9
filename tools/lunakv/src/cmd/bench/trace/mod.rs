//! `lunakv bench --trace FILE`: hits on real traffic (docs/BENCH.md, "Hits on real
//! traffic"). Replays a Mooncake-format request trace (one JSON object per line: `timestamp`
//! ms, `input_length`, `hash_ids`, one id per 512-token block) against a real lunakv-master and
//! lunakv-store on loopback, through the calls vLLM's MooncakeStoreConnector makes per request:
//! one existence batch over the request's block keys, one get batch of the leading hits, one put
//! batch of the missing blocks. Every byte read is checked against what was put.
//!
//! In the same run it computes the offline figures for the same capacity ([`offline`]): the
//! maximum, LRU and Belady, and prints the replay's hit rate beside them with requests/s,
//! blocks/s, the master's evictions and every error by code.

pub mod offline;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use lunakv_client::{ClientOptions, ReplicateConfig, StoreClient};
use lunakv_proto::ErrorCode;
use serde::Serialize;

use self::offline::{BLOCK_TOKENS, Request};
use super::offload::{spawn, spawn_store};
use crate::error::Coded;
use crate::stack::{MASTER_BIN, service_bin};

/// What `--trace` replays and how.
#[derive(Debug, Clone)]
pub struct TracePlan {
    pub path: PathBuf,
    /// Bytes that stand for one 512-token block.
    pub block_bytes: u64,
    /// The pool's DRAM, in tokens.
    pub capacity_tokens: u64,
    /// The store's SSD tier, in tokens (0: none).
    pub ssd_tokens: u64,
    /// Only the first N requests (0: all).
    pub first: usize,
    /// 0: as fast as the client goes; else the trace's own timestamps divided by this.
    pub time_scale: f64,
    /// Extra flags for lunakv-master (`--eviction_policy=lru`, `--default_kv_lease_ttl=1`).
    pub master_args: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct TraceReport {
    pub trace: String,
    pub requests: usize,
    pub block_bytes: u64,
    pub capacity_tokens: u64,
    pub capacity_blocks: u64,
    pub ssd_tokens: u64,
    pub master_args: Vec<String>,
    pub hit_rate: f64,
    pub max_hit_rate: f64,
    pub lru_hit_rate: f64,
    pub belady_hit_rate: f64,
    /// hit_rate / max_hit_rate.
    pub of_max: f64,
    /// hit_rate / lru_hit_rate.
    pub vs_lru: f64,
    pub requests_per_s: f64,
    pub blocks_per_s: f64,
    pub seconds: f64,
    pub blocks_read: u64,
    pub blocks_put: u64,
    /// Lookups that said "present" and whose read then failed.
    pub false_present: u64,
    pub wrong_bytes: u64,
    /// Failed calls by Mooncake error code name.
    pub errors: BTreeMap<String, u64>,
    /// The first message of each error code.
    pub error_examples: BTreeMap<String, String>,
    /// The master's counters at the end (evicted keys, eviction passes, offloads, promotions).
    pub master: BTreeMap<String, f64>,
}

/// Loads a trace, at most `first` requests (0: all); a bad line names its number.
pub fn load(path: &Path, first: usize) -> anyhow::Result<Vec<Request>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--trace {}: cannot read it", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if first > 0 && out.len() >= first {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let r: Request = serde_json::from_str(line).map_err(|e| {
            Coded::new(
                ErrorCode::InvalidParams,
                format!(
                    "--trace {} line {}: {e}; each line must be a JSON object with \
                     input_length and hash_ids (Mooncake's trace format)",
                    path.display(),
                    i + 1
                ),
            )
        })?;
        out.push(r);
    }
    if out.is_empty() {
        bail!(Coded::new(
            ErrorCode::InvalidParams,
            format!("--trace {}: no request in it", path.display())
        ));
    }
    Ok(out)
}

fn key(id: u64) -> String {
    format!("trace-block-{id:016x}")
}

/// The bytes block `id` holds: a function of the id only, so every read is checked whole.
fn fill(id: u64, buf: &mut [u8]) {
    let mut x = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// Replays `plan` against a stack of its own, then the offline figures for the same capacity.
pub fn run(bins: &Path, plan: &TracePlan) -> anyhow::Result<TraceReport> {
    if plan.block_bytes == 0 || plan.capacity_tokens < BLOCK_TOKENS {
        bail!(Coded::new(
            ErrorCode::InvalidParams,
            "--block-bytes must be at least 1 and --capacity-tokens at least 512 (one block)"
        ));
    }
    let trace = load(&plan.path, plan.first)?;
    let blocks = plan.capacity_tokens / BLOCK_TOKENS;
    let dir = tempfile::Builder::new().prefix("lunakv-trace-").tempdir()?;
    let mut args = vec![
        "--rpc_address=127.0.0.1".to_string(),
        "--rpc_port=0".into(),
        "--metrics_port=0".into(),
        format!("--data_dir={}", dir.path().join("master").display()),
    ];
    let ssd_dir = dir.path().join("ssd");
    let ssd = (plan.ssd_tokens > 0).then(|| {
        (
            ssd_dir.as_path(),
            plan.ssd_tokens / BLOCK_TOKENS * plan.block_bytes,
        )
    });
    if ssd.is_some() {
        args.push("--enable_offload=true".into());
    }
    args.extend(plan.master_args.iter().cloned());
    let (master, f) = spawn(&service_bin(bins, MASTER_BIN)?, &args, &[], "rpc")?;
    let rpc = f.get("rpc").cloned().context("master rpc address")?;
    let admin = f.get("admin").cloned().context("master admin address")?;
    let store = spawn_store(bins, &rpc, &(blocks * plan.block_bytes).to_string(), ssd)?;
    let client = StoreClient::connect(ClientOptions {
        master_server_address: rpc,
        ..ClientOptions::default()
    })?;
    let replay = replay(&client, &trace, plan);
    drop(client);
    let master_counters = scrape(&admin);
    drop(store);
    drop(master);
    let replay = replay?;

    let input = offline::input_tokens(&trace);
    let hit_rate = replay.hit_tokens as f64 / input.max(1) as f64;
    let max_hit_rate = offline::infinite(&trace);
    let lru_hit_rate = offline::lru(&trace, blocks as usize);
    let belady_hit_rate = offline::belady(&trace, blocks as usize);
    let blocks_moved = replay.blocks_read + replay.blocks_put;
    let secs = replay.elapsed.as_secs_f64().max(1e-9);
    Ok(TraceReport {
        trace: plan.path.display().to_string(),
        requests: trace.len(),
        block_bytes: plan.block_bytes,
        capacity_tokens: plan.capacity_tokens,
        capacity_blocks: blocks,
        ssd_tokens: plan.ssd_tokens,
        master_args: plan.master_args.clone(),
        hit_rate,
        max_hit_rate,
        lru_hit_rate,
        belady_hit_rate,
        of_max: hit_rate / max_hit_rate.max(1e-12),
        vs_lru: hit_rate / lru_hit_rate.max(1e-12),
        requests_per_s: trace.len() as f64 / secs,
        blocks_per_s: blocks_moved as f64 / secs,
        seconds: secs,
        blocks_read: replay.blocks_read,
        blocks_put: replay.blocks_put,
        false_present: replay.false_present,
        wrong_bytes: replay.wrong_bytes,
        errors: replay.errors,
        error_examples: replay.error_examples,
        master: master_counters,
    })
}

#[derive(Default)]
struct Replayed {
    hit_tokens: u64,
    blocks_read: u64,
    blocks_put: u64,
    false_present: u64,
    wrong_bytes: u64,
    errors: BTreeMap<String, u64>,
    error_examples: BTreeMap<String, String>,
    elapsed: Duration,
}

impl Replayed {
    fn error(&mut self, e: &lunakv_client::ClientError) {
        let code = format!("{:?}", e.code());
        self.error_examples
            .entry(code.clone())
            .or_insert_with(|| e.to_string());
        *self.errors.entry(code).or_default() += 1;
    }
}

fn replay(client: &StoreClient, trace: &[Request], plan: &TracePlan) -> anyhow::Result<Replayed> {
    let bytes = plan.block_bytes as usize;
    let mut out = Replayed::default();
    let mut want = vec![0u8; bytes];
    let cfg = ReplicateConfig::default();
    let start = Instant::now();
    for r in trace {
        if plan.time_scale > 0.0 {
            let due = Duration::from_secs_f64(r.timestamp as f64 / 1000.0 / plan.time_scale);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                std::thread::sleep(wait);
            }
        }
        let keys: Vec<String> = r.hash_ids.iter().map(|&h| key(h)).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let present: Vec<bool> = client
            .batch_exists(&refs)
            .into_iter()
            .map(|e| match e {
                Ok(p) => p,
                Err(e) => {
                    out.error(&e);
                    false
                }
            })
            .collect();
        let run = present.iter().take_while(|p| **p).count();
        // The leading hits, read into buffers of their own and checked byte for byte.
        let mut bufs: Vec<Vec<u8>> = (0..run).map(|_| vec![0u8; bytes]).collect();
        let mut read_ok = 0;
        if run > 0 {
            let mut dsts: Vec<Vec<&mut [u8]>> =
                bufs.iter_mut().map(|b| vec![b.as_mut_slice()]).collect();
            let results = client.batch_get_into(&refs[..run], &mut dsts);
            for (i, res) in results.into_iter().enumerate() {
                match res {
                    Ok(_) if read_ok == i => {
                        fill(r.hash_ids[i], &mut want);
                        if bufs[i] != want {
                            out.wrong_bytes += 1;
                        }
                        read_ok += 1;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        out.false_present += 1;
                        out.error(&e);
                    }
                }
            }
        }
        out.blocks_read += read_ok as u64;
        out.hit_tokens += offline::hit_tokens(r, read_ok);
        // Every block after the usable run that the pool does not hold is put, in order.
        // (A leading block whose read failed is put again: the pool lost it.)
        let missing: Vec<usize> = (read_ok..r.hash_ids.len())
            .filter(|&i| i < run || !present[i])
            .collect();
        let values: Vec<Vec<u8>> = missing
            .iter()
            .map(|&i| {
                let mut v = vec![0u8; bytes];
                fill(r.hash_ids[i], &mut v);
                v
            })
            .collect();
        let items: Vec<(&str, Vec<&[u8]>)> = missing
            .iter()
            .zip(&values)
            .map(|(&i, v)| (refs[i], vec![v.as_slice()]))
            .collect();
        if !items.is_empty() {
            for res in client.batch_put(&items, &cfg) {
                match res {
                    Ok(()) => out.blocks_put += 1,
                    Err(e) if e.code() == ErrorCode::ObjectAlreadyExists => {}
                    Err(e) => out.error(&e),
                }
            }
        }
    }
    out.elapsed = start.elapsed();
    Ok(out)
}

/// The master's eviction, offload (and declined), disk-hit, disk-drop and promotion counters
/// from its /metrics.
fn scrape(admin: &str) -> BTreeMap<String, f64> {
    const WANTED: [&str; 9] = [
        "master_evicted_keys_total",
        "master_successful_evictions_total",
        "master_offloaded_keys_total",
        "master_offload_declined_total",
        "master_disk_hits_total",
        "master_promotions_total",
        "master_put_start_alloc_failures_total",
        "master_eviction_lease_skipped_total",
        "master_disk_dropped_keys_total",
    ];
    let Ok(resp) =
        lunakv_http::get_blocking(&format!("http://{admin}/metrics"), Duration::from_secs(5))
    else {
        return BTreeMap::new();
    };
    resp.text()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (n, v) = l.split_once(' ')?;
            WANTED
                .contains(&n)
                .then(|| Some((n.to_string(), v.trim().parse().ok()?)))?
        })
        .collect()
}

pub fn render(r: &TraceReport) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "trace {} ({} requests), capacity {} tokens ({} blocks of {} bytes){}{}",
        r.trace,
        r.requests,
        r.capacity_tokens,
        r.capacity_blocks,
        r.block_bytes,
        if r.ssd_tokens > 0 {
            format!(" + SSD {} tokens", r.ssd_tokens)
        } else {
            String::new()
        },
        if r.master_args.is_empty() {
            String::new()
        } else {
            format!(", master {}", r.master_args.join(" "))
        }
    );
    let _ = writeln!(
        s,
        "  hit rate {:.4}  ({:.0}% of the max {:.4}; {:.2}x offline LRU {:.4}; Belady {:.4})",
        r.hit_rate,
        100.0 * r.of_max,
        r.max_hit_rate,
        r.vs_lru,
        r.lru_hit_rate,
        r.belady_hit_rate
    );
    let _ = writeln!(
        s,
        "  {:.0} requests/s, {:.0} blocks/s ({} read, {} put) in {:.1} s",
        r.requests_per_s, r.blocks_per_s, r.blocks_read, r.blocks_put, r.seconds
    );
    let _ = writeln!(
        s,
        "  false present {}, wrong bytes {}, errors {:?}",
        r.false_present, r.wrong_bytes, r.errors
    );
    for (code, msg) in &r.error_examples {
        let _ = writeln!(s, "    first {code}: {msg}");
    }
    let _ = writeln!(s, "  master {:?}", r.master);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blocks_bytes_depend_on_its_id_only() {
        let (mut a, mut b, mut c) = (vec![0u8; 100], vec![0u8; 100], vec![0u8; 100]);
        fill(7, &mut a);
        fill(7, &mut b);
        fill(8, &mut c);
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn a_bad_line_is_named_by_its_number() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        std::fs::write(
            &p,
            "{\"input_length\": 10, \"hash_ids\": [1]}\n{\"hash_ids\": 3}\n",
        )
        .unwrap();
        let e = load(&p, 0).unwrap_err().to_string();
        assert!(e.contains("line 2"), "{e}");
        assert_eq!(
            load(&p, 1).unwrap().len(),
            1,
            "--first cuts before the bad line"
        );
    }
}
