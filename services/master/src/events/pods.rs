//! The serving pods the vLLM-format stream speaks for (`kv_events_vllm_pods`). An entry whose
//! host is an IP address is a pod as written. An entry whose host is a name (a Kubernetes
//! headless Service: one address per ready pod) stands for every address it resolves to, and
//! is resolved again every [`RESOLVE_EVERY`], so the topics follow a rollout's new pod IPs
//! without a master restart. llm-d names a pod by its endpoint's `address:port`, so a name
//! itself would never score.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

/// How often names are resolved again.
pub const RESOLVE_EVERY: Duration = Duration::from_secs(10);

/// How long the master's start waits for the first resolution.
pub const FIRST_WAIT: Duration = Duration::from_secs(2);

/// The pods now: static entries plus what the names resolved to last.
#[derive(Debug)]
pub struct Pods {
    current: Arc<RwLock<Arc<Vec<String>>>>,
}

impl Pods {
    /// Resolves the names on a thread of its own, at once and then every [`RESOLVE_EVERY`]
    /// until this is dropped. Waits up to [`FIRST_WAIT`] for the first answer, so the first
    /// events reach the pods while a dead DNS cannot hold up the master's start.
    pub fn start(entries: &[String]) -> Pods {
        let (fixed, names): (Vec<&String>, Vec<&String>) =
            entries.iter().partition(|e| is_address(e));
        let fixed: Vec<String> = fixed.into_iter().cloned().collect();
        let names: Vec<String> = names.into_iter().cloned().collect();
        let current = Arc::new(RwLock::new(Arc::new(fixed.clone())));
        if names.is_empty() {
            return Pods { current };
        }
        let (first_tx, first_rx) = std::sync::mpsc::channel();
        let weak = Arc::downgrade(&current);
        let spawned = std::thread::Builder::new()
            .name("kv-events-pods".into())
            .spawn(move || refresh(&weak, &fixed, &names, &first_tx));
        match spawned {
            Ok(_) => {
                let _ = first_rx.recv_timeout(FIRST_WAIT);
            }
            Err(e) => tracing::warn!(error = %e, "kv events: pod names will not be resolved"),
        }
        Pods { current }
    }

    /// The pods to announce to now.
    pub fn now(&self) -> Arc<Vec<String>> {
        self.current.read().map(|g| g.clone()).unwrap_or_default()
    }
}

/// True for `ip:port` and `[ipv6]:port`: a pod as written.
fn is_address(entry: &str) -> bool {
    entry.parse::<SocketAddr>().is_ok()
        || entry
            .rsplit_once(':')
            .is_some_and(|(h, _)| h.parse::<IpAddr>().is_ok())
}

/// The pods now. `failing` holds the names that did not resolve last time, so a name that stays
/// unresolvable (a headless Service with no ready pod) is logged when it starts failing and
/// when it recovers, not every 10 s.
fn resolve_all(fixed: &[String], names: &[String], failing: &mut BTreeSet<String>) -> Vec<String> {
    let mut out: BTreeSet<String> = fixed.iter().cloned().collect();
    for name in names {
        match name.to_socket_addrs() {
            Ok(addrs) => {
                out.extend(addrs.map(|a| a.to_string()));
                if failing.remove(name) {
                    tracing::info!(name = %name, "kv events: kv_events_vllm_pods entry resolves again");
                }
            }
            Err(e) => {
                if failing.insert(name.clone()) {
                    tracing::warn!(name = %name, error = %e,
                        "kv events: kv_events_vllm_pods entry does not resolve; no pod for it until it does");
                }
            }
        }
    }
    out.into_iter().collect()
}

fn refresh(
    current: &Weak<RwLock<Arc<Vec<String>>>>,
    fixed: &[String],
    names: &[String],
    first: &std::sync::mpsc::Sender<()>,
) {
    let mut failing = BTreeSet::new();
    let mut known: Option<Vec<String>> = None;
    loop {
        let pods = resolve_all(fixed, names, &mut failing);
        let Some(current) = current.upgrade() else {
            return;
        };
        if known.as_ref() != Some(&pods) {
            tracing::info!(pods = ?pods, "kv events: the vLLM stream speaks for these pods");
            if let Ok(mut slot) = current.write() {
                *slot = Arc::new(pods.clone());
            }
            known = Some(pods);
        }
        drop(current);
        let _ = first.send(());
        std::thread::sleep(RESOLVE_EVERY);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_stay_as_written_and_names_become_their_addresses() {
        assert!(is_address("10.0.0.5:8000"));
        assert!(is_address("[fd00::5]:8000"));
        assert!(!is_address("vllm.llm-d.svc.cluster.local:8000"));
        let pods = Pods::start(&["10.0.0.5:8000".to_string(), "localhost:8000".to_string()]);
        let now = pods.now();
        assert!(now.contains(&"10.0.0.5:8000".to_string()), "{now:?}");
        assert!(
            now.contains(&"127.0.0.1:8000".to_string()),
            "localhost resolved: {now:?}"
        );
        assert!(!now.iter().any(|p| p.starts_with("localhost")), "{now:?}");
    }

    #[test]
    fn a_name_that_does_not_resolve_is_no_pod_and_no_error() {
        let pods = Pods::start(&["no-such-host.invalid:8000".to_string()]);
        assert!(pods.now().is_empty());
    }

    #[test]
    fn a_failing_name_is_remembered_until_it_resolves() {
        let mut failing = BTreeSet::new();
        let names = ["no-such-host.invalid:8000".to_string()];
        assert!(resolve_all(&[], &names, &mut failing).is_empty());
        assert!(
            failing.contains(&names[0]),
            "remembered, so the next failure is not logged"
        );
        failing.insert("localhost:8000".to_string());
        resolve_all(&[], &["localhost:8000".to_string()], &mut failing);
        assert!(
            !failing.contains("localhost:8000"),
            "forgotten once it resolves"
        );
    }
}
