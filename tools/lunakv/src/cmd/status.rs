//! `lunakv status`: the master's GetClusterStatus, as a table or one JSON object.

use std::process::ExitCode;

use lunakv_client::{ClusterStatus, Segment};
use lunakv_transfer::ProtocolChoice;
use serde::Serialize;

use crate::error::Coded;
use crate::output::{human_bytes, print_json};
use crate::target::Target;

pub fn run(t: &Target, json: bool) -> anyhow::Result<ExitCode> {
    let s = fetch_blocking(t)?;
    if json {
        print_json(&StatusJson::from_proto(&t.master, &s))?;
    } else {
        print!("{}", render(&t.master, &s));
    }
    Ok(ExitCode::SUCCESS)
}

/// One GetClusterStatus call through the client library, so an `etcd://` address finds the
/// HA leader exactly as engines do.
pub fn fetch_blocking(t: &Target) -> anyhow::Result<ClusterStatus> {
    let client = crate::cmd::kv::connect(t)?;
    let status = client
        .cluster_status()
        .map_err(|e| Coded::new(e.code(), format!("GetClusterStatus failed: {e}")))?;
    Ok(status)
}

#[derive(Debug, Serialize)]
struct StatusJson {
    ok: bool,
    master: String,
    master_version: String,
    cluster_id: String,
    capacity_bytes: u64,
    used_bytes: u64,
    keys: u64,
    clients: u64,
    evicted_keys: u64,
    enable_offload: bool,
    disk_capacity_bytes: u64,
    disk_used_bytes: u64,
    kv_events: KvEventsJson,
    segments: Vec<SegmentJson>,
    /// Per tenant: objects, DRAM charged, quota (docs/TENANTS.md).
    enable_multi_tenants: bool,
    tenants: Vec<TenantJson>,
}

#[derive(Debug, Serialize)]
struct TenantJson {
    tenant_id: String,
    objects: u64,
    dram_bytes: u64,
    disk_objects: u64,
    /// null: no quota.
    quota_bytes: Option<u64>,
    quota_rejected: u64,
}

/// Whether the master publishes KV events, and where (docs/EVENTS.md).
#[derive(Debug, Serialize)]
struct KvEventsJson {
    enabled: bool,
    endpoint: String,
    replay_endpoint: String,
    topic: String,
    vllm_endpoint: String,
}

#[derive(Debug, Serialize)]
struct SegmentJson {
    name: String,
    transfer_endpoint: String,
    client_id: String,
    size_bytes: u64,
    used_bytes: u64,
    objects: u64,
    last_ping_ms_ago: u64,
    /// The protocol served ("tcp" or "rdma").
    protocol: String,
    /// The protocol configured; differs from `protocol` where RDMA was unavailable.
    requested_protocol: String,
    /// Why they differ ("" when they agree).
    protocol_reason: String,
    /// `tcp`, `rdma`, or `tcp (rdma unavailable: <reason>)`, as the table shows it.
    protocol_display: String,
    shm: bool,
    enable_offload: bool,
    disk_capacity_bytes: u64,
    disk_used_bytes: u64,
    disk_objects: u64,
}

impl StatusJson {
    fn from_proto(master: &str, s: &ClusterStatus) -> StatusJson {
        StatusJson {
            ok: true,
            master: master.to_owned(),
            master_version: s.master_version.clone(),
            cluster_id: s.cluster_id.clone(),
            capacity_bytes: s.total_capacity_bytes,
            used_bytes: s.allocated_bytes,
            keys: s.key_count,
            clients: s.active_clients,
            evicted_keys: s.evicted_key_count,
            enable_offload: s.enable_offload,
            disk_capacity_bytes: s.disk_capacity_bytes,
            disk_used_bytes: s.disk_used_bytes,
            kv_events: KvEventsJson {
                enabled: s.kv_events_enabled,
                endpoint: s.kv_events_endpoint.clone(),
                replay_endpoint: s.kv_events_replay_endpoint.clone(),
                topic: s.kv_events_topic.clone(),
                vllm_endpoint: s.kv_events_vllm_endpoint.clone(),
            },
            segments: s
                .segments
                .iter()
                .map(|g| {
                    let d = g.segment.clone().unwrap_or_default();
                    let p = segment_protocol(&d);
                    SegmentJson {
                        name: d.name,
                        transfer_endpoint: d.transfer_endpoint,
                        client_id: g.client_id.clone(),
                        size_bytes: d.size,
                        used_bytes: g.used_bytes,
                        objects: g.object_count,
                        last_ping_ms_ago: g.last_ping_ms_ago,
                        protocol: p.effective.as_str().to_owned(),
                        requested_protocol: p.requested.as_str().to_owned(),
                        protocol_reason: p.reason_str().to_owned(),
                        protocol_display: p.to_string(),
                        shm: !d.shm_socket.is_empty(),
                        enable_offload: d.enable_offload,
                        disk_capacity_bytes: g.disk_capacity_bytes,
                        disk_used_bytes: g.disk_used_bytes,
                        disk_objects: g.disk_object_count,
                    }
                })
                .collect(),
            enable_multi_tenants: s.enable_multi_tenants,
            tenants: s
                .tenants
                .iter()
                .map(|t| TenantJson {
                    tenant_id: t.tenant_id.clone(),
                    objects: t.objects,
                    dram_bytes: t.dram_bytes,
                    disk_objects: t.disk_objects,
                    quota_bytes: t.quota_bytes,
                    quota_rejected: t.quota_rejected,
                })
                .collect(),
        }
    }
}

/// One line per tenant, shown when any key belongs to a tenant other than the default one or
/// the master enforces quotas.
fn render_tenants(o: &mut String, s: &ClusterStatus) {
    use std::fmt::Write;
    let only_default = s
        .tenants
        .iter()
        .all(|t| t.tenant_id == lunakv_proto::DEFAULT_TENANT && t.quota_bytes.is_none());
    if only_default && !s.enable_multi_tenants {
        return;
    }
    let mode = if s.enable_multi_tenants {
        "quotas enforced"
    } else {
        "no quotas"
    };
    let _ = writeln!(o, "tenants   {} ({mode})", s.tenants.len());
    for t in &s.tenants {
        let quota = match t.quota_bytes {
            Some(q) => format!(
                "  quota {} ({:.1}%)  refused {}",
                human_bytes(q),
                percent(t.dram_bytes, q),
                t.quota_rejected
            ),
            None => String::new(),
        };
        let _ = writeln!(
            o,
            "  {}  objects {}  dram {}{quota}",
            t.tenant_id,
            t.objects,
            human_bytes(t.dram_bytes)
        );
    }
}

/// What a segment's owner was configured with and serves (older owners: just `protocol`).
pub fn segment_protocol(d: &Segment) -> ProtocolChoice {
    ProtocolChoice::from_wire(&d.requested_protocol, &d.protocol, &d.protocol_reason)
}

fn percent(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 * 100.0 / whole as f64
    }
}

fn render(master: &str, s: &ClusterStatus) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let version = if s.master_version.is_empty() {
        String::new()
    } else {
        format!("  version {}", s.master_version)
    };
    let _ = writeln!(o, "master    {master}  cluster {}{version}", s.cluster_id);
    let _ = writeln!(
        o,
        "capacity  {}  used {} ({:.1}%)  keys {}  clients {}  evicted {}",
        human_bytes(s.total_capacity_bytes),
        human_bytes(s.allocated_bytes),
        percent(s.allocated_bytes, s.total_capacity_bytes),
        s.key_count,
        s.active_clients,
        s.evicted_key_count
    );
    if s.enable_offload {
        let _ = writeln!(
            o,
            "offload   on{}  disk {} of {} ({:.1}%)",
            if s.promotion_on_hit {
                "  promotion_on_hit"
            } else {
                ""
            },
            human_bytes(s.disk_used_bytes),
            human_bytes(s.disk_capacity_bytes),
            percent(s.disk_used_bytes, s.disk_capacity_bytes)
        );
    }
    if s.kv_events_enabled {
        let mut line = format!(
            "kv events on  {} topic {:?}",
            s.kv_events_endpoint, s.kv_events_topic
        );
        if !s.kv_events_replay_endpoint.is_empty() {
            line.push_str(&format!("  replay {}", s.kv_events_replay_endpoint));
        }
        if !s.kv_events_vllm_endpoint.is_empty() {
            line.push_str(&format!("  vllm {}", s.kv_events_vllm_endpoint));
        }
        let _ = writeln!(o, "{line}");
    } else {
        let _ = writeln!(o, "kv events off");
    }
    render_tenants(&mut o, s);
    if s.segments.is_empty() {
        let _ = writeln!(
            o,
            "segments  none mounted (start lunakv-store, or an embedded client)"
        );
        return o;
    }
    let rows: Vec<[String; 8]> = s
        .segments
        .iter()
        .map(|g| {
            let d = g.segment.clone().unwrap_or_default();
            let protocol = segment_protocol(&d).to_string();
            [
                d.name,
                human_bytes(d.size),
                format!(
                    "{} ({:.1}%)",
                    human_bytes(g.used_bytes),
                    percent(g.used_bytes, d.size)
                ),
                g.object_count.to_string(),
                if d.enable_offload {
                    format!(
                        "{} of {} ({} obj)",
                        human_bytes(g.disk_used_bytes),
                        human_bytes(g.disk_capacity_bytes),
                        g.disk_object_count
                    )
                } else {
                    "-".to_owned()
                },
                format!("{:.1} s ago", g.last_ping_ms_ago as f64 / 1000.0),
                g.client_id.clone(),
                protocol,
            ]
        })
        .collect();
    let head = [
        "SEGMENT",
        "SIZE",
        "USED",
        "OBJECTS",
        "DISK",
        "LAST PING",
        "CLIENT",
        "PROTOCOL",
    ];
    let mut width: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let _ = writeln!(o);
    let line = |cells: &[String]| {
        cells
            .iter()
            .zip(&width)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_owned()
    };
    let _ = writeln!(o, "{}", line(&head.map(String::from)));
    for r in &rows {
        let _ = writeln!(o, "{}", line(r));
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use lunakv_client::SegmentStatus;

    fn sample() -> ClusterStatus {
        ClusterStatus {
            cluster_id: "mooncake_cluster".into(),
            segments: vec![SegmentStatus {
                segment: Some(Segment {
                    name: "127.0.0.1:50052".into(),
                    transfer_endpoint: "127.0.0.1:50052".into(),
                    size: 1 << 30,
                    shm_socket: "/tmp/s.sock".into(),
                    protocol: "tcp".into(),
                    ..Default::default()
                }),
                client_id: "c1".into(),
                used_bytes: 64 << 20,
                object_count: 3,
                last_ping_ms_ago: 420,
                ..Default::default()
            }],
            total_capacity_bytes: 1 << 30,
            allocated_bytes: 64 << 20,
            key_count: 3,
            active_clients: 2,
            evicted_key_count: 0,
            master_version: "0.1.0".into(),
            ..Default::default()
        }
    }

    #[test]
    fn text_names_every_figure() {
        let t = render("127.0.0.1:50051", &sample());
        for want in [
            "127.0.0.1:50052",
            "1.0 GiB",
            "64.0 MiB (6.2%)",
            "keys 3",
            "clients 2",
            "0.4 s ago",
        ] {
            assert!(t.contains(want), "missing {want} in:\n{t}");
        }
    }

    #[test]
    fn tenants_show_their_usage_and_quota() {
        let mut s = sample();
        assert!(
            !render("m:1", &s).contains("tenants"),
            "one default tenant: no section"
        );
        s.enable_multi_tenants = true;
        s.tenants = vec![lunakv_proto::views::TenantStatus {
            tenant_id: "team-a".into(),
            objects: 7,
            dram_bytes: 512 << 20,
            quota_bytes: Some(1 << 30),
            quota_rejected: 3,
            ..Default::default()
        }];
        let t = render("m:1", &s);
        for want in [
            "tenants   1 (quotas enforced)",
            "team-a  objects 7  dram 512.0 MiB  quota 1.0 GiB (50.0%)  refused 3",
        ] {
            assert!(t.contains(want), "missing {want:?} in:\n{t}");
        }
        let v = serde_json::to_value(StatusJson::from_proto("m:1", &s)).expect("json");
        assert_eq!(v["tenants"][0]["quota_bytes"], 1u64 << 30);
        assert_eq!(v["tenants"][0]["dram_bytes"], 512u64 << 20);
    }

    #[test]
    fn json_has_the_totals_and_segments() {
        let v = serde_json::to_value(StatusJson::from_proto("m:1", &sample())).expect("json");
        assert_eq!(v["ok"], true);
        assert_eq!(v["capacity_bytes"], 1u64 << 30);
        assert_eq!(v["keys"], 3);
        assert_eq!(v["segments"][0]["objects"], 3);
        assert_eq!(v["segments"][0]["shm"], true);
        assert_eq!(v["segments"][0]["protocol_display"], "tcp");
    }

    #[test]
    fn kv_events_say_on_and_where() {
        let t = render("127.0.0.1:50051", &sample());
        assert!(t.contains("kv events off"), "{t}");
        let mut s = sample();
        s.kv_events_enabled = true;
        s.kv_events_endpoint = "tcp://127.0.0.1:19997".into();
        s.kv_events_replay_endpoint = "tcp://127.0.0.1:19998".into();
        s.kv_events_topic = "mooncake".into();
        let t = render("127.0.0.1:50051", &s);
        assert!(
            t.contains("kv events on  tcp://127.0.0.1:19997 topic \"mooncake\"  replay tcp://127.0.0.1:19998"),
            "{t}"
        );
        let v = serde_json::to_value(StatusJson::from_proto("m:1", &s)).expect("json");
        assert_eq!(v["kv_events"]["enabled"], true);
        assert_eq!(v["kv_events"]["endpoint"], "tcp://127.0.0.1:19997");
    }

    #[test]
    fn a_segment_that_fell_back_from_rdma_says_why() {
        let mut s = sample();
        let d = s.segments[0].segment.as_mut().expect("segment");
        d.requested_protocol = "rdma".into();
        d.protocol_reason = "no RDMA device found".into();
        let t = render("127.0.0.1:50051", &s);
        assert!(
            t.contains("tcp (rdma unavailable: no RDMA device found)"),
            "{t}"
        );
        let v = serde_json::to_value(StatusJson::from_proto("m:1", &s)).expect("json");
        assert_eq!(v["segments"][0]["protocol"], "tcp");
        assert_eq!(v["segments"][0]["requested_protocol"], "rdma");
    }
}
