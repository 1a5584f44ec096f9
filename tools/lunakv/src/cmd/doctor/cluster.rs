//! The checks the master answers: it is reached and serves this pool, store-clients have
//! mounted memory, the transport they offer, and keys that read back as written.

use lunakv_client::StoreClient;
use lunakv_client::{ClusterStatus, NamespaceStats};

use super::check::{Check, UNSHARED_MESSAGE};
use super::http::http_get;
use crate::args::DoctorArgs;
use crate::output::human_bytes;
use crate::target::Target;

/// Why the master gave doctor no cluster status.
#[derive(Debug, thiserror::Error)]
pub(super) enum MasterError {
    #[error("{0:#}")]
    Connect(anyhow::Error),
    #[error(transparent)]
    Status(lunakv_client::ClientError),
}

/// What the engines use lunakv for, as their `--kv-transfer-config` says. The master and its
/// pool serve MooncakeStoreConnector; the P/D connectors move KV straight between engines
/// (MooncakeConnector through the bootstrap), so a P/D-only stack is healthy with no master and
/// no store-client, and the master row must not fail it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Purpose {
    /// A pool with memory is expected: the engines run MooncakeStoreConnector or another
    /// connector that may use the store (LMCache, ...), or doctor was not told what they run.
    Store,
    /// The engines run only these P/D connectors (the ones a routing sidecar drives).
    PdOnly(Vec<String>),
}

impl Purpose {
    /// From the engine's command line (`--vllm-args`), else `--kv-transfer-config`. Input that
    /// does not parse leaves the default, [`Purpose::Store`]: the `connectors` and `vllm_stats`
    /// rows report it, and a store stack must keep failing when its store is missing.
    pub(super) fn of(a: &DoctorArgs) -> Purpose {
        use lunakv_config::connectors::{engine_connectors, parse_vllm_args, sidecar_connector};
        let kv = a
            .vllm_args
            .as_deref()
            .and_then(|v| parse_vllm_args(v).ok())
            .and_then(|v| v.kv_transfer_config)
            .or_else(|| {
                a.kv_transfer_config
                    .as_deref()
                    .and_then(|k| serde_json::from_str(k).ok())
            });
        let Some(kv) = kv else {
            return Purpose::Store;
        };
        let pd: Vec<&str> = ["mooncake", "nixlv2", "shared-storage"]
            .into_iter()
            .filter_map(sidecar_connector)
            .collect();
        // MultiConnector only wraps the others; what it wraps decides.
        let runs: Vec<String> = engine_connectors(&kv)
            .into_iter()
            .filter(|c| c != "MultiConnector")
            .collect();
        if !runs.is_empty() && runs.iter().all(|c| pd.contains(&c.as_str())) {
            Purpose::PdOnly(runs)
        } else {
            Purpose::Store
        }
    }
}

/// Said when a store stack's master row fails, since a P/D-only stack that doctor was not told
/// about fails the same way.
const PD_ONLY_HINT: &str = "; on a P/D-only stack (MooncakeConnector, no MooncakeStoreConnector) \
                            pass the engine's --kv-transfer-config or --vllm-args and the master \
                            is not required";

pub(super) fn check_master(
    t: &Target,
    status: &Result<ClusterStatus, MasterError>,
    purpose: &Purpose,
) -> Check {
    const NAME: &str = "master";
    if let Purpose::PdOnly(runs) = purpose {
        let why = format!(
            "the engines run only {} (P/D transfer, no MooncakeStoreConnector), which needs no \
             master or store-client",
            runs.join(", ")
        );
        match status {
            Err(e) => {
                return Check::skip(
                    NAME,
                    format!(
                        "the master at {} ({}) was not reached ({e}); {why}",
                        t.master, t.origin
                    ),
                );
            }
            Ok(s) if s.total_capacity_bytes == 0 => {
                return Check::pass(
                    NAME,
                    format!(
                        "master {} (version {}) answers with no segment registered; {why}",
                        t.master, s.master_version
                    ),
                );
            }
            Ok(_) => {}
        }
    }
    match status {
        Err(e) => Check::fail(
            NAME,
            format!(
                "cannot reach the master at {} ({}): {e}",
                t.master, t.origin
            ),
            format!(
                "start lunakv-master, or point --master / MOONCAKE_MASTER / master_server_address \
                 at its gRPC address (host:port, or etcd://... with HA){PD_ONLY_HINT}"
            ),
        ),
        Ok(s) if s.total_capacity_bytes == 0 => Check::fail(
            NAME,
            format!(
                "master {} answers but the pool has no capacity: no segment is registered",
                t.master
            ),
            format!(
                "start a store-client: lunakv-store --master_server_address={} \
                 --global_segment_size=40GB (or an embedded-mode engine with \
                 global_segment_size > 0){PD_ONLY_HINT}",
                t.master
            ),
        ),
        Ok(s) => Check::pass(
            NAME,
            format!(
                "master {} (version {}): {} segment(s), capacity {}, used {}, {} keys",
                t.master,
                s.master_version,
                s.segments.len(),
                human_bytes(s.total_capacity_bytes),
                human_bytes(s.allocated_bytes),
                s.key_count
            ),
        ),
    }
}

pub(super) fn check_store_clients(a: &DoctorArgs, status: Option<&ClusterStatus>) -> Check {
    const NAME: &str = "store_clients";
    let segments = status.map(|s| s.segments.as_slice()).unwrap_or_default();
    if segments.is_empty() && a.store.is_empty() {
        return Check::skip(
            NAME,
            if status.is_none() {
                "the master is unreachable and no --store was given"
            } else {
                "no segment is mounted and no --store was given"
            },
        );
    }
    let mut dead = Vec::new();
    let mut alive = Vec::new();
    for g in segments {
        let name = g
            .segment
            .as_ref()
            .map(|d| d.name.clone())
            .unwrap_or_default();
        if g.last_ping_ms_ago > a.stale_ping_ms {
            dead.push(format!(
                "{name} (client {}) last pinged the master {:.1} s ago",
                g.client_id,
                g.last_ping_ms_ago as f64 / 1000.0
            ));
        } else {
            alive.push(name);
        }
    }
    for s in &a.store {
        match http_get(s, "/health") {
            Ok((200, _)) => alive.push(format!("{s} /health")),
            Ok((code, body)) => dead.push(format!(
                "store-client admin {s} answered /health with HTTP {code}: {}",
                body.trim()
            )),
            Err(e) => dead.push(format!("store-client admin {s} does not answer: {e}")),
        }
    }
    if dead.is_empty() {
        Check::pass(NAME, format!("alive: {}", alive.join(", ")))
    } else {
        Check::fail(
            NAME,
            dead.join("; "),
            "restart the dead lunakv-store (its pod or unit) and check its log; the master \
             drops its segment and objects after client_ttl",
        )
    }
}

/// Every segment serves the protocol it was configured with. llm-d's manifests say rdma; a
/// pod without a device serves tcp (one line in its log), and this row makes that visible.
pub(super) fn check_protocol(status: Option<&ClusterStatus>) -> Check {
    const NAME: &str = "protocol";
    let Some(status) = status else {
        return Check::skip(NAME, "the master is unreachable");
    };
    if status.segments.is_empty() {
        return Check::skip(NAME, "no segment is mounted");
    }
    let mut served = Vec::new();
    let mut fell_back = Vec::new();
    for g in &status.segments {
        let Some(d) = &g.segment else { continue };
        let p = crate::cmd::status::segment_protocol(d);
        if p.fell_back() {
            fell_back.push(format!("{}: {p}", d.name));
        } else {
            served.push(format!("{} {}", d.name, p.effective));
        }
    }
    if fell_back.is_empty() {
        Check::pass(NAME, served.join(", "))
    } else {
        Check::warn(
            NAME,
            fell_back.join("; "),
            "bytes move over tcp there (same-host peers still use shared memory); for RDMA run a \
             build with the `rdma` feature on a node with an RDMA device (docs/RDMA.md), or set \
             \"protocol\": \"tcp\" / --protocol=tcp to state what is served",
        )
    }
}

pub(super) fn check_key_consistency(client: Option<&StoreClient>) -> Check {
    const NAME: &str = "key_consistency";
    let Some(client) = client else {
        return Check::skip(NAME, "the master is unreachable");
    };
    let r = match client.namespace_stats() {
        Ok(r) => r,
        Err(e) => {
            return Check::fail(
                NAME,
                format!("GetNamespaceStats failed: {e}"),
                "upgrade lunakv-master to a version with GetNamespaceStats",
            );
        }
    };
    let flagged: Vec<&NamespaceStats> = r.namespaces.iter().filter(|n| n.unshared).collect();
    if !flagged.is_empty() {
        let which: Vec<String> = flagged
            .iter()
            .map(|n| {
                format!(
                    "{} ({} instances, {} keys put, 0 shared)",
                    n.namespace, n.active_clients, n.keys_put
                )
            })
            .collect();
        return Check::fail(
            NAME,
            format!("{UNSHARED_MESSAGE}: {}", which.join("; ")),
            "give every vLLM instance the same PYTHONHASHSEED (e.g. PYTHONHASHSEED=0 in the pod \
             spec) and the same --prefix-caching-hash-algo, then restart them",
        );
    }
    let compared: Vec<&NamespaceStats> = r
        .namespaces
        .iter()
        .filter(|n| n.active_clients >= 2)
        .collect();
    if compared.is_empty() {
        return Check::skip(
            NAME,
            format!(
                "no namespace has two instances with {} keys put yet ({} namespace(s) seen)",
                r.min_keys,
                r.namespaces.len()
            ),
        );
    }
    let shared: u64 = compared.iter().map(|n| n.shared_keys).sum();
    Check::pass(
        NAME,
        format!(
            "{} namespace(s) with 2+ instances share keys ({shared} shared lookups/puts)",
            compared.len()
        ),
    )
}
