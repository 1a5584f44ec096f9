//! The HA metrics (`master_is_leader`, `master_leader_term`, the warm copy's gauges, ...): the
//! election, the write fence and the warm standby all count into them, so they sit apart from
//! each of those.

use prometheus::{IntCounter, IntGauge, Opts, Registry};

/// The HA metrics, in their own registry (they outlive the per-term core).
pub struct HaMetrics {
    pub registry: Registry,
    /// 1 while etcd answers this master.
    pub etcd_up: IntGauge,
    /// 1 while this master leads.
    pub is_leader: IntGauge,
    /// Times this master became leader.
    pub leader_changes_total: IntCounter,
    /// The current leader term seen by this master (0 = none known).
    pub leader_term: IntGauge,
    /// Writes refused because the local lease deadline had passed.
    pub fenced_writes_total: IntCounter,
    /// Leases of dead leaders this standby revoked (`ha_fast_takeover`).
    pub fast_takeovers_total: IntCounter,
    /// Reads a new leader answered from its warm copy while the owners remounted.
    pub warm_reads_total: IntCounter,
    /// Objects in this standby's warm copy of the leader's index.
    pub warm_copy_keys: IntGauge,
    /// 1 while this standby's warm copy holds a whole snapshot of the current leader's index.
    pub warm_copy_synced: IntGauge,
}

impl HaMetrics {
    pub(crate) fn new() -> HaMetrics {
        let registry = Registry::new();
        let g = |n: &str, h: &str| {
            let g = IntGauge::with_opts(Opts::new(n, h)).expect("static metric definition");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric name");
            g
        };
        let c = |n: &str, h: &str| {
            let c = IntCounter::with_opts(Opts::new(n, h)).expect("static metric definition");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric name");
            c
        };
        HaMetrics {
            etcd_up: g("master_etcd_up", "1 while etcd answers this master"),
            is_leader: g("master_is_leader", "1 while this master is the HA leader"),
            leader_changes_total: c(
                "master_leader_changes_total",
                "Times this master became the leader",
            ),
            leader_term: g("master_leader_term", "Term of the leader this master knows"),
            fenced_writes_total: c(
                "master_fenced_writes_total",
                "Requests refused because this master's leader lease might have expired",
            ),
            fast_takeovers_total: c(
                "master_fast_takeovers_total",
                "Leases of leaders whose RPC port refused connections that this standby revoked",
            ),
            warm_reads_total: c(
                "master_warm_reads_total",
                "Reads a new leader answered from its warm copy of the index while the owners remounted",
            ),
            warm_copy_keys: g(
                "master_warm_copy_keys",
                "Objects in this standby's warm copy of the leader's index",
            ),
            warm_copy_synced: g(
                "master_warm_copy_synced",
                "1 while this standby's warm copy holds a whole snapshot of the current leader's index",
            ),
            registry,
        }
    }
}
