//! The SSD tier's checks: a probe object written through the pool reaches some store's disk,
//! and the stores' offload settings agree with what the engines were told.

use std::path::{Path, PathBuf};

use lunakv_client::{ClientError, ReplicateConfig, StoreClient};
use lunakv_client::{ClusterStatus, SegmentStatus};
use lunakv_config::MooncakeConfig;

use super::check::Check;
use super::http::http_get;
use crate::args::DoctorArgs;
use crate::output::human_bytes;

/// Size of the SSD probe object.
const PROBE_BYTES: usize = 256 << 10;

pub(super) fn check_offload_write(
    a: &DoctorArgs,
    client: Option<&StoreClient>,
    status: Option<&ClusterStatus>,
) -> Check {
    const NAME: &str = "offload_write";
    let (Some(client), Some(status)) = (client, status) else {
        return Check::skip(NAME, "the master is unreachable");
    };
    let offloading: Vec<&SegmentStatus> = status
        .segments
        .iter()
        .filter(|g| g.segment.as_ref().is_some_and(|d| d.enable_offload))
        .collect();
    if !status.enable_offload && offloading.is_empty() && a.offload_dir.is_none() {
        return Check::skip(
            NAME,
            "offload is not enabled (master --enable_offload=false, no store-client offloads)",
        );
    }
    if !status.enable_offload {
        return Check::fail(
            NAME,
            "the master runs without --enable_offload, so nothing ever reaches the SSD tier",
            "start lunakv-master with --enable_offload=true",
        );
    }
    let Some(seg) = offloading
        .iter()
        .find(|g| g.disk_capacity_bytes >= PROBE_BYTES as u64)
    else {
        return Check::fail(
            NAME,
            "no mounted store-client offers a usable disk tier",
            "start lunakv-store with --enable_offload=true and a writable \
             MOONCAKE_OFFLOAD_FILE_STORAGE_PATH (see its lunakv_store_offload_open_errors)",
        );
    };
    let seg_name = seg
        .segment
        .as_ref()
        .map(|d| d.name.clone())
        .unwrap_or_default();
    match probe_offload(a, client, &seg_name) {
        Ok(detail) => Check::pass(NAME, detail),
        Err((detail, fix)) => Check::fail(NAME, detail, fix),
    }
}

/// Disk bytes the master indexes on `segment`.
fn segment_disk_used(client: &StoreClient, segment: &str) -> Result<u64, ClientError> {
    let s = client.cluster_status()?;
    Ok(s.segments
        .iter()
        .find(|g| g.segment.as_ref().is_some_and(|d| d.name == segment))
        .map_or(0, |g| g.disk_used_bytes))
}

/// The probe's failure when the master stops answering mid-probe: (detail, fix).
fn master_down(e: ClientError) -> (String, String) {
    (
        format!("GetClusterStatus failed: {e}"),
        "check that the master is up and try again".to_string(),
    )
}

/// Bytes the given store-clients wrote to disk so far (their counter), summed.
fn stores_disk_written(a: &DoctorArgs) -> Option<u64> {
    let mut total = None;
    for s in &a.store {
        if let Some(v) = store_metric(s, "lunakv_store_disk_written_bytes_total") {
            *total.get_or_insert(0) += v;
        }
    }
    total
}

fn store_metric(admin: &str, name: &str) -> Option<u64> {
    let (code, body) = http_get(admin, "/metrics").ok()?;
    if code != 200 {
        return None;
    }
    body.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse::<f64>().ok().map(|f| f as u64))?
    })
}

type ProbeError = (String, String);

/// Puts a probe object on `segment`, asks the master to move it to disk, and checks that the
/// disk tier grew where it can be seen: the master's index, the store-clients' counters
/// (`--store`), the directory (`--offload-dir`). The probe is removed afterwards.
fn probe_offload(
    a: &DoctorArgs,
    client: &StoreClient,
    segment: &str,
) -> Result<String, ProbeError> {
    let key = format!(
        "lunakv-doctor/offload-probe/{}/{}",
        std::process::id(),
        client.client_id()
    );
    let master_before = segment_disk_used(client, segment).map_err(master_down)?;
    let store_before = stores_disk_written(a);
    let dir_before = a.offload_dir.as_deref().map(dir_bytes);
    let data = vec![0x5au8; PROBE_BYTES];
    let cfg = ReplicateConfig {
        replica_num: 1,
        preferred_segment: Some(segment.to_string()),
        ..ReplicateConfig::default()
    };
    client.put_parts(&key, &[&data], &cfg).map_err(|e| {
        (
            format!(
                "the probe put of {} failed: {e}",
                human_bytes(PROBE_BYTES as u64)
            ),
            "free DRAM in the pool or check the store-client's log".to_string(),
        )
    })?;
    let result = (|| {
        client.offload_key(&key).map_err(|e| {
            (
                format!("the master could not move the probe to {segment}'s disk: {e}"),
                "check the store-client's log and lunakv_store_disk_write_errors_total; the \
                 offload directory must be writable with free space"
                    .to_string(),
            )
        })?;
        let master_after = segment_disk_used(client, segment).map_err(master_down)?;
        let mut seen = vec![format!(
            "master disk index on {segment} {} -> {}",
            human_bytes(master_before),
            human_bytes(master_after)
        )];
        if master_after <= master_before {
            return Err((
                format!(
                    "the probe went to disk but the master's disk bytes for {segment} did not \
                     grow ({master_before} -> {master_after})"
                ),
                "check that the store-client reports its disk tier (enable_offload at mount)"
                    .to_string(),
            ));
        }
        if let Some(before) = store_before {
            let after = stores_disk_written(a).unwrap_or(0);
            if after <= before {
                return Err((
                    format!(
                        "the store-clients' lunakv_store_disk_written_bytes_total did not grow \
                         ({before} -> {after})"
                    ),
                    "check that --store names the admin endpoint of the store-client that \
                     offloads"
                        .to_string(),
                ));
            }
            seen.push(format!(
                "store disk written +{}",
                human_bytes(after - before)
            ));
        }
        if let (Some(dir), Some(before)) = (a.offload_dir.as_deref(), dir_before) {
            let after = dir_bytes(dir);
            if after <= before {
                return Err((
                    format!(
                        "the offload directory {} did not grow ({before} -> {after} bytes)",
                        dir.display()
                    ),
                    "point --offload-dir at the store-client's \
                     MOONCAKE_OFFLOAD_FILE_STORAGE_PATH on this host"
                        .to_string(),
                ));
            }
            seen.push(format!(
                "{} grew +{}",
                dir.display(),
                human_bytes(after - before)
            ));
        }
        Ok(format!(
            "{} probe reached the SSD tier: {}",
            human_bytes(PROBE_BYTES as u64),
            seen.join(", ")
        ))
    })();
    // Clean up whatever happened; a failed remove is not the check's verdict.
    let _ = client.remove(&key, true);
    result
}

/// Bytes of the regular files under `dir` (recursively); 0 when it cannot be read.
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

pub(super) fn check_offload_config(
    engine: Option<&MooncakeConfig>,
    config: &Option<PathBuf>,
    status: Option<&ClusterStatus>,
) -> Check {
    const NAME: &str = "offload_config";
    let Some(status) = status else {
        return Check::skip(NAME, "the master is unreachable");
    };
    let mut bad = Vec::new();
    let mut seen = vec![format!("master enable_offload={}", status.enable_offload)];
    for g in &status.segments {
        let Some(d) = &g.segment else { continue };
        if d.enable_offload != status.enable_offload {
            bad.push(format!(
                "store-client {} has enable_offload={} but the master {}",
                d.name, d.enable_offload, status.enable_offload
            ));
        }
    }
    seen.push(format!("{} store-client(s)", status.segments.len()));
    if let (Some(e), Some(path)) = (engine, config) {
        let p = path.display();
        seen.push(format!(
            "engine {p}: mode {} enable_offload={}",
            e.mode.as_str(),
            e.enable_offload
        ));
        if e.enable_offload != status.enable_offload {
            bad.push(format!(
                "engine config {p} has \"enable_offload\": {} but the master {}",
                e.enable_offload, status.enable_offload
            ));
        }
        if e.enable_offload
            && !status.segments.iter().any(|g| {
                g.segment
                    .as_ref()
                    .is_some_and(|d| d.enable_offload && g.disk_capacity_bytes > 0)
            })
        {
            bad.push(format!(
                "engine config {p} enables offload but no store-client offers a disk tier"
            ));
        }
        if !e.is_embedded() && status.total_capacity_bytes == 0 {
            bad.push(format!(
                "engine config {p} is mode standalone-store (the engine contributes no memory) \
                 but no store-client is mounted"
            ));
        }
    } else {
        seen.push("no engine config (--config) to compare".to_string());
    }
    if bad.is_empty() {
        Check::pass(NAME, seen.join(", "))
    } else {
        Check::fail(
            NAME,
            bad.join("; "),
            "use one enable_offload value everywhere: the engine's mooncake_config.json \
             (\"enable_offload\": true, with \"mode\": \"standalone-store\"), lunakv-master \
             --enable_offload=true and every lunakv-store --enable_offload=true (or false in all \
             three)",
        )
    }
}
