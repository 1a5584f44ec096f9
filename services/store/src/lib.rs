//! # lunakv-store
//!
//! The standalone store-client (upstream's `mooncake_client`): owns a DRAM segment of
//! `--global_segment_size`, serves it on `--port` (50052) through the transfer library, mounts it
//! with the master, pings, and unmounts on a graceful stop; with the SSD tier it first writes the
//! objects still in DRAM to disk (`--offload_drain_timeout_sec`, docs/OFFLOAD.md), so a rolling
//! update keeps them. Engines in standalone-store mode are pure requesters against it, so the
//! pool survives engine restarts.
//!
//! The segment logic itself is [`lunakv_segment::SegmentHost`], shared with embedded-mode
//! engines; this crate adds the flags, the admin HTTP endpoint (/metrics, /health for liveness,
//! /ready for readiness: 503 until the segment is mounted) and the lifecycle. A store started
//! before its master waits for it (one WARN line, then one every 30 s) instead of exiting.
#![forbid(unsafe_code)]

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use lunakv_config::StoreConfig;
use lunakv_master_client::{ClientError, MasterWait};
use lunakv_segment::{HostDisk, HostOptions, SegmentHost};
use lunakv_telemetry::metrics;
use lunakv_transfer::{ProtocolChoice, WireProtocol};
use prometheus::{IntCounter, IntGauge, IntGaugeVec, Registry};

mod admin;
mod offload;

pub use offload::EVICTION_POLICY_ENV;

/// Env var: the interval of the store's Ping to the master in ms (default 1000). For tests: a
/// long one shows what the master learns without the Ping (e.g. the disk tier's drops, which
/// an OFFLOAD answer carries). The master's `--client_ttl` must stay above it.
pub const PING_INTERVAL_ENV: &str = "LUNAKV_STORE_PING_INTERVAL_MS";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(
        "--host '{0}' is not an IP address: the transfer listener binds exactly this address; pass this node's IP, e.g. --host=127.0.0.1"
    )]
    BadHost(String),
    #[error(
        "cannot bind the admin port {addr}: {source}; pick another --metrics_port (0 = any free port)"
    )]
    AdminBind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Segment(#[from] ClientError),
    #[error(transparent)]
    Config(#[from] lunakv_config::ConfigError),
    #[error("offload: {0}")]
    Offload(String),
    #[error("{var}={value:?} is not a ping interval: give milliseconds above 0, e.g. {var}=1000")]
    BadPingInterval { var: &'static str, value: String },
}

/// Serves until `shutdown` resolves, then unmounts and stops. Prints two lines on stdout: once
/// the transfer and admin ports are bound,
/// `lunakv-store bound transfer=IP:PORT admin=IP:PORT segment=NAME size=BYTES master=ADDR`,
/// and once the segment is mounted (which waits for the master as long as it takes),
/// `lunakv-store listening transfer=IP:PORT admin=IP:PORT segment=NAME size=BYTES protocol=P`.
/// SIGTERM while waiting returns `Ok` at once; only a configuration error (a refused mount, a
/// malformed address, a cluster_id mismatch) returns an error.
pub async fn serve(cfg: StoreConfig, shutdown: impl Future<Output = ()>) -> Result<(), StoreError> {
    let ip: IpAddr = cfg
        .host
        .parse()
        .map_err(|_| StoreError::BadHost(cfg.host.clone()))?;
    // `--protocol=rdma` (llm-d's DaemonSet) is served where this build has the transport and a
    // device opens; otherwise one warning line says why and the segment is served over tcp.
    let protocol = ProtocolChoice::resolve(match cfg.protocol {
        lunakv_config::Protocol::Tcp => WireProtocol::Tcp,
        lunakv_config::Protocol::Rdma => WireProtocol::Rdma,
    });
    if let Some(w) = protocol.warning() {
        tracing::warn!("lunakv-store: {w}");
    }
    let client_id = format!("store-{}", uuid_like());
    let env = lunakv_config::process_env;
    let shm_socket = cfg.enable_shm.then(|| {
        if cfg.port == 0 && !cfg.shm_socket_is_exact() {
            // An ephemeral port is unknown until bound; keep the socket name unique anyway.
            let dir = cfg.shm_socket_path(0, &env);
            dir.with_file_name(format!("lunakv-store-{}.sock", uuid_like()))
        } else {
            cfg.shm_socket_path(cfg.port, &env)
        }
    });
    // `host:port`, or `etcd://...` (from --etcd_endpoints or the address itself): the segment
    // then follows the HA leader and re-mounts with its inventory on each new one.
    let master = cfg.master_address()?.to_string();
    let metrics = Metrics::new();
    // The SSD tier. A directory that cannot be used is a clear error in the log and on
    // /metrics, but the DRAM pool is still served (the master evicts without offloading).
    let tier = if cfg.enable_offload {
        let mut oc = lunakv_offload::OffloadConfig::new(
            &cfg.offload_file_storage_path,
            cfg.offload_total_size_limit_bytes,
        );
        if let Some(p) = env(EVICTION_POLICY_ENV) {
            oc.policy = p.parse().map_err(|e: lunakv_offload::UnknownPolicy| {
                StoreError::Offload(format!("{EVICTION_POLICY_ENV}: {e}"))
            })?;
        }
        match lunakv_offload::DiskTier::open(oc) {
            Ok((t, report)) => {
                tracing::info!(dir = %cfg.offload_file_storage_path.display(), recovered_objects = report.objects, recovered_bytes = report.bytes, dropped_rows = report.dropped_rows, deleted_buckets = report.deleted_buckets, "SSD offload tier ready");
                metrics.offload_enabled.set(1);
                Some(Arc::new(t))
            }
            Err(e) => {
                tracing::error!(error = %e, "SSD offload disabled: serving DRAM only");
                metrics.offload_open_errors.set(1);
                None
            }
        }
    } else {
        None
    };
    let disk = tier.as_ref().map(|t| {
        let a = Arc::new(offload::Tier(t.clone()));
        HostDisk {
            cold: a.clone(),
            inventory: a,
        }
    });
    let bound = SegmentHost::bind(
        HostOptions {
            master_server_address: master.clone(),
            client_id,
            cluster_id: cfg.cluster_id.clone(),
            bind: SocketAddr::new(ip, cfg.port),
            advertise_host: None,
            size: cfg.global_segment_size,
            shm_socket,
            protocol,
            enable_offload: cfg.enable_offload,
            ping_interval: ping_interval(env(PING_INTERVAL_ENV))?,
            rpc_timeout: Duration::from_secs(10),
            limits: lunakv_transfer::ConnLimits {
                max_conns_per_peer: cfg.transfer_max_conns_per_peer,
                max_conns: cfg.transfer_max_conns,
                idle_timeout: (cfg.transfer_idle_timeout_sec > 0)
                    .then(|| Duration::from_secs(cfg.transfer_idle_timeout_sec)),
            },
            bind_retry: Duration::from_secs(cfg.bind_retry_sec),
        },
        disk,
    )?;
    let protocol = bound.protocol();
    metrics
        .protocol_info
        .with_label_values(&[
            protocol.requested.as_str(),
            protocol.effective.as_str(),
            protocol.reason_str(),
        ])
        .set(1);

    let drain_on = tier.is_some();
    let drain_progress = metrics.drain.clone();
    let metrics = Metrics { tier, ..metrics };
    // The admin port comes up before the mount: liveness (/health) answers while the store
    // waits for its master, and readiness (/ready) says 503 until the segment is mounted.
    let admin_addr = SocketAddr::new(ip, cfg.metrics_port);
    let listener = tokio::net::TcpListener::bind(admin_addr)
        .await
        .map_err(|source| StoreError::AdminBind {
            addr: admin_addr,
            source,
        })?;
    let admin_addr = listener
        .local_addr()
        .map_err(|source| StoreError::AdminBind {
            addr: admin_addr,
            source,
        })?;
    let info = bound.info().clone();
    let (stop_admin, admin_stopped) = tokio::sync::oneshot::channel::<()>();
    let admin = tokio::spawn(admin::serve(
        listener,
        admin::AdminState {
            server: bound.server().clone(),
            segment: info.name.clone(),
            size: info.size,
            status: bound.status(),
            master: master.clone(),
            metrics,
        },
        async {
            let _ = admin_stopped.await;
        },
    ));
    println!(
        "lunakv-store bound transfer={} admin={} segment={} size={} master={}",
        info.transfer_endpoint, admin_addr, info.name, info.size, master
    );

    // Until the master answers: a store started before its master (a DaemonSet rolling out
    // with the master) waits instead of exiting, and SIGTERM still stops it at once. Only a
    // configuration error ends the wait (lunakv_master_client's startup rules).
    tokio::pin!(shutdown);
    let mounted = tokio::select! {
        r = bound.mount(MasterWait::Forever) => r,
        () = &mut shutdown => {
            tracing::info!("shutting down before the segment was mounted");
            let _ = stop_admin.send(());
            let _ = admin.await;
            return Ok(());
        }
    };
    let host = match mounted {
        Ok(h) => h,
        Err(e) => {
            let _ = stop_admin.send(());
            let _ = admin.await;
            return Err(e.into());
        }
    };

    lunakv_telemetry::announce(
        "lunakv-store",
        &[
            ("transfer", &info.transfer_endpoint),
            ("admin", &admin_addr),
            ("segment", &info.name),
            ("size", &info.size),
            ("protocol", &host.protocol().effective),
        ],
    );
    tracing::info!(segment = %info.name, size = info.size, shm = ?info.shm_socket, "serving");

    shutdown.await;
    // With the SSD tier, the objects still in DRAM go to disk first (newest first, within
    // --offload_drain_timeout_sec) so the restarted store serves them; /metrics stays up and
    // shows the drain's progress meanwhile.
    if drain_on {
        let budget = Duration::from_secs(cfg.offload_drain_timeout_sec);
        tracing::info!(
            budget_s = cfg.offload_drain_timeout_sec,
            "shutting down: draining DRAM objects to the SSD tier, then unmounting"
        );
        let (_, unmounted) = host.drain_and_unmount(budget, drain_progress).await;
        if let Err(e) = unmounted {
            tracing::warn!(error = %e, "unmount after the drain failed; the master expires the segment after client_ttl");
        }
    } else {
        tracing::info!("shutting down: unmounting the segment");
    }
    let _ = stop_admin.send(());
    let _ = admin.await;
    host.shutdown().await?;
    Ok(())
}

/// Gauges refreshed from the segment's counters at each scrape.
#[derive(Clone)]
pub(crate) struct Metrics {
    pub(crate) registry: Registry,
    pub(crate) capacity: IntGauge,
    /// 1 while the segment is mounted with the master (what /ready answers).
    pub(crate) mounted: IntGauge,
    pub(crate) used: IntGauge,
    pub(crate) objects: IntGauge,
    pub(crate) bytes_read: IntCounter,
    pub(crate) bytes_written: IntCounter,
    pub(crate) reads: IntCounter,
    pub(crate) writes: IntCounter,
    pub(crate) shm_attaches: IntCounter,
    pub(crate) conns_open: IntGauge,
    pub(crate) conns_refused: IntCounter,
    pub(crate) bad_frames: IntCounter,
    pub(crate) caps_refused: IntCounter,
    /// The device layer's refused 2D copies and split runs (lunakv_transfer::device::split_stats).
    pub(crate) device_refused_2d: IntCounter,
    pub(crate) device_split_runs: IntCounter,
    /// `{requested, effective, reason} 1`: what `--protocol` asked for and what is served.
    pub(crate) protocol_info: IntGaugeVec,
    pub(crate) offload_enabled: IntGauge,
    pub(crate) offload_open_errors: IntGauge,
    pub(crate) disk_capacity: IntGauge,
    pub(crate) disk_used: IntGauge,
    pub(crate) disk_live: IntGauge,
    pub(crate) disk_objects: IntGauge,
    pub(crate) disk_written: IntCounter,
    pub(crate) disk_loaded: IntCounter,
    pub(crate) disk_loads: IntCounter,
    pub(crate) disk_evicted: IntCounter,
    pub(crate) disk_corrupt: IntCounter,
    pub(crate) disk_write_errors: IntCounter,
    pub(crate) disk_compactions: IntCounter,
    pub(crate) disk_compacted: IntCounter,
    pub(crate) disk_second_chances: IntCounter,
    pub(crate) tier: Option<Arc<lunakv_offload::DiskTier>>,
    pub(crate) drain_drained: IntGauge,
    pub(crate) drain_drained_bytes: IntGauge,
    pub(crate) drain_dropped: IntGauge,
    pub(crate) drain: Arc<lunakv_transfer::DrainProgress>,
    /// Held for one scrape: counters advance by differences that two scrapes must not share.
    pub(crate) scrape: Arc<std::sync::Mutex<()>>,
}

impl Metrics {
    fn new() -> Metrics {
        let registry = Registry::new();
        let g = |name: &str, help: &str| metrics::gauge(&registry, name, help);
        // Cumulative values sampled from the server's stats at scrape time, typed as counters.
        let c = |name: &str, help: &str| metrics::counter(&registry, name, help);
        Metrics {
            capacity: g(
                "lunakv_store_segment_capacity_bytes",
                "Bytes of DRAM this store serves",
            ),
            mounted: g(
                "lunakv_store_segment_mounted",
                "1 while the segment is mounted with the master (/ready answers 200); 0 while \
                 waiting for the master, re-mounting, or shutting down",
            ),
            used: g(
                "lunakv_store_segment_used_bytes",
                "Bytes held by committed objects",
            ),
            objects: g(
                "lunakv_store_objects",
                "Objects whose bytes this store holds",
            ),
            bytes_read: c(
                "lunakv_store_transfer_read_bytes_total",
                "Bytes served to readers",
            ),
            bytes_written: c(
                "lunakv_store_transfer_written_bytes_total",
                "Bytes received from writers",
            ),
            reads: c("lunakv_store_transfer_reads_total", "Read requests served"),
            offload_enabled: g(
                "lunakv_store_offload_enabled",
                "1 when the SSD tier is open and serving",
            ),
            offload_open_errors: g(
                "lunakv_store_offload_open_errors",
                "1 when --enable_offload was given but the directory could not be used",
            ),
            disk_capacity: g(
                "lunakv_store_disk_capacity_bytes",
                "SSD tier size limit (MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES)",
            ),
            disk_used: g(
                "lunakv_store_disk_used_bytes",
                "Bytes of bucket files (live objects and dead space)",
            ),
            disk_live: g("lunakv_store_disk_live_bytes", "Bytes of objects on disk"),
            disk_objects: g("lunakv_store_disk_objects", "Objects on disk"),
            disk_written: c(
                "lunakv_store_disk_written_bytes_total",
                "Bytes offloaded to disk",
            ),
            disk_loaded: c(
                "lunakv_store_disk_loaded_bytes_total",
                "Bytes served from disk",
            ),
            disk_loads: c("lunakv_store_disk_loads_total", "Objects served from disk"),
            disk_evicted: c(
                "lunakv_store_disk_evicted_objects_total",
                "Disk objects dropped at the size limit",
            ),
            disk_corrupt: c(
                "lunakv_store_disk_corrupt_objects_total",
                "Disk objects that failed their checksum (dropped, never served)",
            ),
            disk_write_errors: c(
                "lunakv_store_disk_write_errors_total",
                "Offload batches that failed to write",
            ),
            disk_compactions: c(
                "lunakv_store_disk_compactions_total",
                "Buckets rewritten without their dead space (before any live object is dropped)",
            ),
            disk_compacted: c(
                "lunakv_store_disk_compacted_bytes_total",
                "Dead bytes returned by compaction",
            ),
            disk_second_chances: c(
                "lunakv_store_disk_second_chances_total",
                "Objects read since written that the clock policy carried forward instead of dropping with their bucket",
            ),
            tier: None,
            drain_drained: g(
                "lunakv_store_drain_drained_objects",
                "Shutdown drain: DRAM objects written to the SSD tier so far (a restart serves them)",
            ),
            drain_drained_bytes: g(
                "lunakv_store_drain_drained_bytes",
                "Shutdown drain: bytes of those objects",
            ),
            drain_dropped: g(
                "lunakv_store_drain_dropped_objects",
                "Shutdown drain: DRAM objects lost (budget spent, no room, write error); set when it ends",
            ),
            drain: Arc::default(),
            scrape: Arc::default(),
            writes: c(
                "lunakv_store_transfer_writes_total",
                "Write requests served",
            ),
            shm_attaches: c(
                "lunakv_store_shm_attaches_total",
                "Same-host requesters that mapped this segment over the shm socket",
            ),
            conns_open: g(
                "lunakv_store_transfer_connections",
                "Open transfer connections (tcp and shm socket)",
            ),
            conns_refused: c(
                "lunakv_store_transfer_connections_refused_total",
                "Transfer connections closed at accept: a per-peer or global cap was reached",
            ),
            bad_frames: c(
                "lunakv_store_transfer_bad_frames_total",
                "Transfer connections closed for a malformed or oversized frame",
            ),
            caps_refused: c(
                "lunakv_store_transfer_refused_total",
                "Transfer requests refused: capability missing, forged, expired or too weak (pool token set), or a rewrite of a committed generation",
            ),
            device_refused_2d: c(
                "lunakv_device_copy_2d_refused_total",
                "2D device copies the GPU driver refused (each part of a split run refused again included); see docs/GPU.md",
            ),
            device_split_runs: c(
                "lunakv_device_copy_2d_split_runs_total",
                "Runs of device copies copied in parts after their 2D copy was refused",
            ),
            protocol_info: metrics::gauge_vec(
                &registry,
                "lunakv_store_protocol_info",
                "Protocol --protocol asked for, the one served, and why they differ",
                &["requested", "effective", "reason"],
            ),
            registry,
        }
    }
}

fn uuid_like() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{:x}-{:x}", std::process::id(), now)
}

/// [`PING_INTERVAL_ENV`], 1 s when unset.
fn ping_interval(value: Option<String>) -> Result<Duration, StoreError> {
    let Some(value) = value else {
        return Ok(Duration::from_secs(1));
    };
    match value.trim().parse::<u64>() {
        Ok(ms) if ms > 0 => Ok(Duration::from_millis(ms)),
        _ => Err(StoreError::BadPingInterval {
            var: PING_INTERVAL_ENV,
            value,
        }),
    }
}

#[cfg(test)]
mod ping_interval_tests {
    use super::*;

    #[test]
    fn the_ping_interval_is_milliseconds_above_zero_and_a_bad_one_is_named() {
        assert_eq!(ping_interval(None).unwrap(), Duration::from_secs(1));
        assert_eq!(
            ping_interval(Some(" 250 ".into())).unwrap(),
            Duration::from_millis(250)
        );
        for bad in ["0", "1s", ""] {
            let e = ping_interval(Some(bad.into())).unwrap_err().to_string();
            assert!(
                e.contains(PING_INTERVAL_ENV) && e.contains("milliseconds"),
                "{e}"
            );
        }
    }
}
