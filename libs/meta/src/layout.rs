//! Where lunakv's cluster facts live in etcd (HA mode). Everything of one cluster sits under
//! `<root>/<cluster_id>/`, with upstream's root `mooncake-store/`, so several clusters share one
//! etcd and an operator finds a cluster's keys with one prefix listing:
//!
//! | key (under `mooncake-store/<cluster_id>/`) | value | lifetime |
//! |---|---|---|
//! | `master_view` | the leader: JSON `{"address","admin","term"}` | leader's lease (`ha_lease_ttl_sec`, 2 s) |
//! | `master/epoch` | the last leader term (decimal); high 32 bits of generations | permanent |
//! | `master/cluster_id` | the cluster id (a sanity check, as in the embedded store) | permanent |
//! | `segments/<name>` | a mounted segment's descriptor (transfer endpoint, size, ...) | until unmounted |
//! | `bootstrap/<group>/dp/<dp_rank>` | a P/D bootstrap table's dp rank: JSON list of worker slots with lease deadlines (`lunakv-bootstrap --etcd-endpoints`) | until its workers' leases lapse |
//!
//! The object index is never written to etcd: the leader rebuilds it from owners' inventories.

/// Upstream's root prefix.
pub const ROOT: &str = "mooncake-store/";
/// The leader key, relative to the cluster prefix (upstream's name).
pub const LEADER_KEY: &str = "master_view";
/// Segments' transfer endpoints, relative to the cluster prefix.
pub const SEGMENTS_PREFIX: &str = "segments/";
/// P/D bootstrap tables (`lunakv-bootstrap --etcd-endpoints`), relative to the cluster prefix.
pub const BOOTSTRAP_PREFIX: &str = "bootstrap/";

/// `mooncake-store/<cluster_id>/`.
pub fn cluster_prefix(cluster_id: &str) -> String {
    format!("{ROOT}{cluster_id}/")
}

/// `mooncake-store/<cluster_id>/master_view`.
pub fn leader_key(cluster_id: &str) -> String {
    format!("{}{LEADER_KEY}", cluster_prefix(cluster_id))
}

/// The leader key's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderView {
    /// The leader's gRPC address, host:port.
    pub address: String,
    /// Its admin/metrics HTTP address, host:port.
    pub admin: String,
    /// Its term: unique and increasing across leaders (the epoch of its generations).
    pub term: u64,
}

impl LeaderView {
    pub fn encode(&self) -> Vec<u8> {
        // Hand-written JSON keeps lunakv-meta free of serde; the fields are plain.
        format!(
            "{{\"address\":\"{}\",\"admin\":\"{}\",\"term\":{}}}",
            self.address, self.admin, self.term
        )
        .into_bytes()
    }

    /// Parses the JSON form, or a bare `host:port` (upstream's value) with term 0.
    pub fn decode(bytes: &[u8]) -> Option<LeaderView> {
        let s = std::str::from_utf8(bytes).ok()?.trim();
        if !s.starts_with('{') {
            return (!s.is_empty()).then(|| LeaderView {
                address: s.to_string(),
                admin: String::new(),
                term: 0,
            });
        }
        let field = |name: &str| -> Option<&str> {
            let pat = format!("\"{name}\":");
            let rest = &s[s.find(&pat)? + pat.len()..];
            let rest = rest.trim_start();
            if let Some(r) = rest.strip_prefix('"') {
                r.find('"').map(|e| &r[..e])
            } else {
                let end = rest.find([',', '}']).unwrap_or(rest.len());
                Some(rest[..end].trim())
            }
        };
        Some(LeaderView {
            address: field("address")?.to_string(),
            admin: field("admin").unwrap_or_default().to_string(),
            term: field("term")?.parse().ok()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leader_view_round_trips() {
        let v = LeaderView {
            address: "10.0.0.1:50051".into(),
            admin: "10.0.0.1:9003".into(),
            term: 42,
        };
        assert_eq!(LeaderView::decode(&v.encode()), Some(v));
        assert_eq!(
            LeaderView::decode(b"10.0.0.2:50051").map(|v| v.address),
            Some("10.0.0.2:50051".to_string())
        );
        assert_eq!(LeaderView::decode(b"{\"admin\":\"x\"}"), None);
        assert_eq!(leader_key("c1"), "mooncake-store/c1/master_view");
    }
}
