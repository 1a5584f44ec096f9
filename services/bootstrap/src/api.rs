//! What the HTTP and gRPC APIs share: the registration path (lease validation, the registering
//! peer, counting) and the metrics `/metrics` serves.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use lunakv_telemetry::metrics::{counter, gauge};
use prometheus::{IntCounter, IntGauge, Registry};

use crate::state::{BootstrapState, Origin, RegisterError, Registered, Worker, on_peer_host};
use crate::{BootstrapConfig, MAX_LEASE};

/// What `/metrics` serves: the registration counters, and gauges set from the table and the
/// limits at each scrape. Each bootstrap owns its registry, so tests can run several in one
/// process.
pub(crate) struct Metrics {
    registry: Registry,
    pub registrations: IntCounter,
    pub rejected: IntCounter,
    pub over_limit: IntCounter,
    pub unprobed: IntCounter,
    pub queries: IntCounter,
    pub engines: IntGauge,
    pub workers: IntGauge,
    pub registrations_limit: IntGauge,
    pub per_peer_limit: IntGauge,
    /// When the last over-limit warning was logged (ms since the epoch): at most one a minute,
    /// however hard a peer pushes.
    last_limit_warn_ms: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        let r = Registry::new();
        Metrics {
            engines: gauge(
                &r,
                "lunakv_bootstrap_engines",
                "Data-parallel ranks with a live engine.",
            ),
            workers: gauge(
                &r,
                "lunakv_bootstrap_workers",
                "Live worker registrations (leases not lapsed).",
            ),
            registrations: counter(
                &r,
                "lunakv_bootstrap_registrations_total",
                "Accepted registrations, HTTP and gRPC (first registrations and renewals).",
            ),
            rejected: counter(
                &r,
                "lunakv_bootstrap_registrations_rejected_total",
                "Refused registrations (engine id mismatch, duplicate, invalid, lease out of range).",
            ),
            over_limit: counter(
                &r,
                "lunakv_bootstrap_registrations_over_limit_total",
                "New workers refused over --max-registrations or --max-registrations-per-peer.",
            ),
            unprobed: counter(
                &r,
                "lunakv_bootstrap_registrations_unprobed_total",
                "New workers whose addr is not on the registering peer's host: never probed.",
            ),
            registrations_limit: gauge(
                &r,
                "lunakv_bootstrap_registrations_limit",
                "Live workers the table holds at most (--max-registrations).",
            ),
            per_peer_limit: gauge(
                &r,
                "lunakv_bootstrap_registrations_per_peer_limit",
                "Live workers one source IP may register (--max-registrations-per-peer).",
            ),
            queries: counter(&r, "lunakv_bootstrap_queries_total", "GET /query calls."),
            last_limit_warn_ms: AtomicU64::new(0),
            registry: r,
        }
    }
}

impl Metrics {
    /// The families in the Prometheus text format.
    pub fn render(&self) -> String {
        lunakv_telemetry::render(&self.registry)
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// The table plus what every API needs around it.
pub(crate) struct Api {
    pub state: Arc<dyn BootstrapState>,
    pub cfg: BootstrapConfig,
    pub metrics: Metrics,
}

/// The lease a registration asked for: `None` or 0 is the default, else 1..=[`MAX_LEASE`] ms.
pub fn lease_from_request(ms: Option<u64>, default: Duration) -> Result<Duration, RegisterError> {
    let max = u64::try_from(MAX_LEASE.as_millis()).unwrap_or(u64::MAX);
    match ms {
        None | Some(0) => Ok(default),
        Some(v) if v <= max => Ok(Duration::from_millis(v)),
        Some(value) => Err(RegisterError::LeaseOutOfRange { value, max }),
    }
}

impl Api {
    /// Registers `w` for `peer` (the connection's source IP), counting the outcome.
    pub async fn register(
        &self,
        w: Worker,
        lease_ttl_ms: Option<u64>,
        peer: IpAddr,
    ) -> Result<Registered, RegisterError> {
        let c = &self.metrics;
        let origin = Origin {
            peer,
            probe: on_peer_host(&w.addr, peer, interface_addrs),
        };
        let r = match lease_from_request(lease_ttl_ms, self.cfg.lease) {
            Ok(ttl) => self.state.register(w.clone(), ttl, origin).await,
            Err(e) => Err(e),
        };
        match &r {
            Ok(reg) => {
                c.registrations.inc();
                if !reg.renewed
                    && self.cfg.probe_workers
                    && !self.cfg.probe_any_host
                    && origin.probe.is_none()
                {
                    c.unprobed.inc();
                    tracing::warn!(
                        %peer, addr = %w.addr, engine_id = %w.engine_id, lease = ?reg.lease,
                        "registered, but its addr is not on the registering peer's host, so it is never probed: its lease lapses unless it registers again (--probe-any-host=true probes it anyway, e.g. behind NAT)"
                    );
                }
            }
            Err(e @ (RegisterError::TableFull { .. } | RegisterError::PeerFull { .. })) => {
                c.over_limit.inc();
                let now = crate::state::now_ms();
                let last = c.last_limit_warn_ms.load(Ordering::Relaxed);
                if now.saturating_sub(last) >= 60_000
                    && c.last_limit_warn_ms
                        .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                        .is_ok()
                {
                    tracing::warn!(%peer, error = %e, "registration refused over a limit (lunakv_bootstrap_registrations_over_limit_total counts them; this warning repeats at most once a minute)");
                }
            }
            Err(RegisterError::Unavailable(_)) => {}
            Err(_) => {
                c.rejected.inc();
            }
        }
        r
    }
}

/// This host's interface addresses (what `ip addr` lists): assigned addresses only, so
/// 127.0.0.2 is not one even though the whole of 127.0.0.0/8 routes here. Empty if the list
/// cannot be read (then only an addr equal to the peer's IP is probed).
fn interface_addrs() -> Vec<IpAddr> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we own until freeifaddrs below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, valid until freeifaddrs.
        let ifa = unsafe { &*cur };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: a non-null ifa_addr points at a sockaddr whose family says its real
            // type: sockaddr_in for AF_INET, sockaddr_in6 for AF_INET6.
            unsafe {
                match i32::from((*ifa.ifa_addr).sa_family) {
                    libc::AF_INET => {
                        let sa = &*ifa.ifa_addr.cast::<libc::sockaddr_in>();
                        out.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr))));
                    }
                    libc::AF_INET6 => {
                        let sa = &*ifa.ifa_addr.cast::<libc::sockaddr_in6>();
                        out.push(IpAddr::V6(Ipv6Addr::from(sa.sin6_addr.s6_addr)));
                    }
                    _ => {}
                }
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: `head` came from getifaddrs and is freed once; no reference into it survives.
    unsafe { libc::freeifaddrs(head) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Users' dashboards (deploy/) read these names, types and HELP texts: they stay as they
    /// were.
    #[test]
    fn metrics_keep_their_names_types_and_help() {
        let m = Metrics::default();
        m.queries.inc();
        let text = m.render();
        for line in [
            "# HELP lunakv_bootstrap_engines Data-parallel ranks with a live engine.",
            "# TYPE lunakv_bootstrap_engines gauge",
            "# TYPE lunakv_bootstrap_workers gauge",
            "# HELP lunakv_bootstrap_registrations_total Accepted registrations, HTTP and gRPC \
             (first registrations and renewals).",
            "# TYPE lunakv_bootstrap_registrations_total counter",
            "# TYPE lunakv_bootstrap_registrations_rejected_total counter",
            "# TYPE lunakv_bootstrap_registrations_over_limit_total counter",
            "# TYPE lunakv_bootstrap_registrations_unprobed_total counter",
            "# TYPE lunakv_bootstrap_registrations_limit gauge",
            "# TYPE lunakv_bootstrap_registrations_per_peer_limit gauge",
            "# HELP lunakv_bootstrap_queries_total GET /query calls.",
            "# TYPE lunakv_bootstrap_queries_total counter",
            "lunakv_bootstrap_queries_total 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing in\n{text}"
            );
        }
    }

    #[test]
    fn interface_addresses_are_assigned_ones_only() {
        let addrs = interface_addrs();
        assert!(addrs.contains(&IpAddr::from([127, 0, 0, 1])), "{addrs:?}");
        assert!(!addrs.contains(&IpAddr::from([127, 0, 0, 2])), "{addrs:?}");
    }
}
