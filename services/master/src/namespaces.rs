//! Cross-instance key consistency: per key namespace, how many keys each client put and how
//! many of them another client already held.
//!
//! vLLM's `MooncakeStoreConnector` names a block
//! `[<cache_prefix>@]<model>@tp_rank:<r>[@pcp<r>@dcp<r>][@pp_rank:<r>][@group:<g>]@<chunk hash>`.
//! The *namespace* is everything before the hash. Two engine instances serving the same model at
//! the same rank compute the same chunk hashes for the same prefix, so their keys collide: that
//! collision is the cross-instance hit the pool exists for. When the hash chains differ
//! (`PYTHONHASHSEED` unset, or a different hash algorithm), every instance writes its own copy
//! of every block and no hit ever crosses instances: the "zero hit rate" trap, silent otherwise.
//!
//! # What "already held by another client" means
//! vLLM calls `batch_is_exist` before saving and skips the keys that exist, so a healthy pool
//! rarely sees a put of a key another client holds. Both signals count as *shared*:
//! - a PutStart of a key that exists (or is being put) under another client's id (the
//!   already-exists answer);
//! - an ExistKey / GetReplicaList (single or batch) by one client that finds a key put by a
//!   different client.
//!
//! A put of a key the same client already holds counts nothing (it is a retry, not a hit). An
//! object rebuilt from an owner's inventory after a master restart carries the owner's client
//! id, not the original putter's.
//!
//! # Bounds
//! At most [`MAX_NAMESPACES`] namespaces and [`MAX_CLIENTS_PER_NAMESPACE`] clients per
//! namespace are tracked; operations beyond the caps are counted in
//! `lunakv_namespace_untracked_total` and otherwise ignored. One mutex (a leaf lock: taken last,
//! never held while taking another) and two hash lookups per operation; no per-key history beyond
//! the object's own record of who put it.

use std::collections::HashMap;

use parking_lot::Mutex;
use serde::Serialize;

/// The message doctor and the metric's help text give for a flagged namespace.
pub const UNSHARED_MESSAGE: &str = lunakv_config::messages::UNSHARED_NAMESPACE;

/// Namespaces tracked at most; later ones are not tracked.
pub const MAX_NAMESPACES: usize = 1024;
/// Clients tracked per namespace at most.
pub const MAX_CLIENTS_PER_NAMESPACE: usize = 256;

/// The namespace of a vLLM store key: everything before the chunk hash, when the key has the
/// connector's shape (a `tp_rank:<digits>` component and a hex hash after the last `@`).
/// Anything else (the CLI's keys, other applications') has no namespace.
pub fn namespace_of(key: &str) -> Option<&str> {
    let (prefix, hash) = key.rsplit_once('@')?;
    if hash.is_empty() || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let has_rank = prefix.split('@').skip(1).any(|part| {
        part.strip_prefix("tp_rank:")
            .is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()))
    });
    has_rank.then_some(prefix)
}

#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    puts: u64,
    put_already_held: u64,
    found_from_other: u64,
}

impl Counts {
    fn shared(&self) -> u64 {
        self.put_already_held + self.found_from_other
    }
}

/// Counted on every put and shared lookup: foldhash (seeded per process, as the index's maps)
/// instead of SipHash, which profiles showed on the put path.
type Fast<V> = HashMap<String, V, foldhash::quality::RandomState>;

#[derive(Debug, Default)]
struct Namespace {
    clients: Fast<Counts>,
    puts: u64,
    shared: u64,
}

/// One client's figures in a namespace.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ClientStats {
    pub client_id: String,
    /// Keys this client put (its PutStarts that placed an object, plus puts answered "already
    /// exists" because another client held the key).
    pub keys_put: u64,
    /// Puts answered "already exists" because another client held the key.
    pub put_already_held: u64,
    /// Exists/get lookups by this client that found a key another client put.
    pub found_from_other: u64,
}

/// One namespace's figures and verdict.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct NamespaceStats {
    pub namespace: String,
    pub keys_put: u64,
    /// put_already_held + found_from_other over all its clients.
    pub shared_keys: u64,
    /// Clients that put at least `min_keys` keys.
    pub active_clients: u64,
    /// Two or more active clients and not one shared key.
    pub unshared: bool,
    /// [`UNSHARED_MESSAGE`] when `unshared`.
    pub message: Option<String>,
    pub clients: Vec<ClientStats>,
}

/// The whole view (admin `/namespaces`, gRPC `GetNamespaceStats`).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct NamespaceReport {
    /// N of the rule: a client is active in a namespace once it put this many keys.
    pub min_keys: u64,
    pub namespaces: Vec<NamespaceStats>,
    /// Operations not tracked because a cap was reached.
    pub untracked: u64,
}

/// The bookkeeping. Shared by the core; cheap enough for the put and lookup paths.
#[derive(Debug)]
pub struct NamespaceTracker {
    min_keys: u64,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    namespaces: Fast<Namespace>,
    untracked: u64,
}

impl NamespaceTracker {
    /// A tracker whose rule flags a namespace once two clients each put `min_keys` keys.
    pub fn new(min_keys: u64) -> NamespaceTracker {
        NamespaceTracker {
            min_keys: min_keys.max(1),
            inner: Mutex::new(Inner::default()),
        }
    }

    /// `client_id` put `key`; `held_by_other` when the answer was "already exists" because
    /// another client holds it.
    pub fn record_put(&self, client_id: &str, key: &str, held_by_other: bool) {
        self.with(client_id, key, |c| {
            c.puts += 1;
            if held_by_other {
                c.put_already_held += 1;
            }
        });
    }

    /// A lookup (exists or get) by `client_id` found `key`, put by another client.
    pub fn record_found_from_other(&self, client_id: &str, key: &str) {
        self.with(client_id, key, |c| c.found_from_other += 1);
    }

    fn with(&self, client_id: &str, key: &str, f: impl FnOnce(&mut Counts)) {
        // Callers without an id (tests, internal calls) are not instances.
        if client_id.is_empty() {
            return;
        }
        let Some(ns) = namespace_of(key) else {
            return;
        };
        let mut inner = self.inner.lock();
        let Inner {
            namespaces,
            untracked,
        } = &mut *inner;
        if !namespaces.contains_key(ns) {
            if namespaces.len() >= MAX_NAMESPACES {
                *untracked += 1;
                return;
            }
            namespaces.insert(ns.to_string(), Namespace::default());
        }
        let Some(n) = namespaces.get_mut(ns) else {
            return;
        };
        if !n.clients.contains_key(client_id) {
            if n.clients.len() >= MAX_CLIENTS_PER_NAMESPACE {
                *untracked += 1;
                return;
            }
            n.clients.insert(client_id.to_string(), Counts::default());
        }
        let Some(c) = n.clients.get_mut(client_id) else {
            return;
        };
        let before = *c;
        f(c);
        n.puts += c.puts - before.puts;
        n.shared += c.shared() - before.shared();
    }

    /// The current figures and verdicts, namespaces sorted by name.
    pub fn report(&self) -> NamespaceReport {
        let inner = self.inner.lock();
        let mut namespaces: Vec<NamespaceStats> = inner
            .namespaces
            .iter()
            .map(|(name, n)| {
                let active = n
                    .clients
                    .values()
                    .filter(|c| c.puts >= self.min_keys)
                    .count() as u64;
                let unshared = active >= 2 && n.shared == 0;
                let mut clients: Vec<ClientStats> = n
                    .clients
                    .iter()
                    .map(|(id, c)| ClientStats {
                        client_id: id.clone(),
                        keys_put: c.puts,
                        put_already_held: c.put_already_held,
                        found_from_other: c.found_from_other,
                    })
                    .collect();
                clients.sort_by(|a, b| a.client_id.cmp(&b.client_id));
                NamespaceStats {
                    namespace: name.clone(),
                    keys_put: n.puts,
                    shared_keys: n.shared,
                    active_clients: active,
                    unshared,
                    message: unshared.then(|| UNSHARED_MESSAGE.to_string()),
                    clients,
                }
            })
            .collect();
        namespaces.sort_by(|a, b| a.namespace.cmp(&b.namespace));
        NamespaceReport {
            min_keys: self.min_keys,
            namespaces,
            untracked: inner.untracked,
        }
    }

    /// The Prometheus text of the namespace metrics, registered in a registry of this scrape
    /// (labels are namespaces, which come and go).
    pub fn render_metrics(&self) -> String {
        use lunakv_telemetry::metrics;
        let r = self.report();
        let registry = prometheus::Registry::new();
        let ns = &["namespace"];
        let keys_put = metrics::counter_vec(
            &registry,
            "lunakv_namespace_keys_put_total",
            "Keys put per vLLM key namespace (model@tp_rank prefix)",
            ns,
        );
        let shared = metrics::counter_vec(
            &registry,
            "lunakv_namespace_shared_keys_total",
            "Puts or lookups of a key another client of the namespace already held",
            ns,
        );
        let clients = metrics::gauge_vec(
            &registry,
            "lunakv_namespace_clients",
            "Clients that put at least namespace_min_keys keys in the namespace",
            ns,
        );
        let unshared = metrics::gauge_vec(
            &registry,
            "lunakv_namespace_unshared_instances",
            &format!("1 when {UNSHARED_MESSAGE}"),
            ns,
        );
        for n in &r.namespaces {
            let label = [label(&n.namespace)];
            keys_put.with_label_values(&label).inc_by(n.keys_put);
            shared.with_label_values(&label).inc_by(n.shared_keys);
            clients
                .with_label_values(&label)
                .set(i64::try_from(n.active_clients).unwrap_or(i64::MAX));
            unshared
                .with_label_values(&label)
                .set(i64::from(n.unshared));
        }
        let flagged = r.namespaces.iter().filter(|n| n.unshared).count();
        metrics::gauge(
            &registry,
            "lunakv_namespace_unshared_namespaces",
            "Namespaces whose instances never share a block",
        )
        .set(i64::try_from(flagged).unwrap_or(i64::MAX));
        metrics::counter(
            &registry,
            "lunakv_namespace_untracked_total",
            "Operations not tracked because the namespace or client cap was reached",
        )
        .inc_by(r.untracked);
        lunakv_telemetry::render(&registry)
    }
}

/// A namespace as a label value: a tenant's separator (a NUL, docs/TENANTS.md) shown as `/`
/// (the encoder escapes the rest).
fn label(v: &str) -> String {
    v.replace('\0', "/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_of_vllm_keys() {
        assert_eq!(
            namespace_of("Qwen3-8B@tp_rank:0@a1b2c3"),
            Some("Qwen3-8B@tp_rank:0")
        );
        assert_eq!(
            namespace_of("pfx@llama@tp_rank:3@pcp0@dcp0@pp_rank:1@group:0@00ff"),
            Some("pfx@llama@tp_rank:3@pcp0@dcp0@pp_rank:1@group:0")
        );
        for bad in [
            "plain-key",
            "model@tp_rank:0@",
            "model@tp_rank:0@not-hex",
            "model@tp_rank:x@abcd",
            "tp_rank:0@abcd",
            "model@abcd",
            "lunakv-doctor/probe",
        ] {
            assert_eq!(namespace_of(bad), None, "{bad}");
        }
    }

    #[test]
    fn two_instances_that_never_share_are_flagged() {
        let t = NamespaceTracker::new(4);
        for i in 0..4 {
            t.record_put("a", &format!("m@tp_rank:0@a{i:x}"), false);
            t.record_put("b", &format!("m@tp_rank:0@b{i:x}"), false);
        }
        let r = t.report();
        assert_eq!(r.namespaces.len(), 1);
        let n = &r.namespaces[0];
        assert_eq!((n.keys_put, n.shared_keys, n.active_clients), (8, 0, 2));
        assert!(n.unshared);
        assert_eq!(n.message.as_deref(), Some(UNSHARED_MESSAGE));
        assert!(
            t.render_metrics()
                .contains("lunakv_namespace_unshared_instances{namespace=\"m@tp_rank:0\"} 1")
        );
    }

    #[test]
    fn one_shared_key_clears_the_flag() {
        let t = NamespaceTracker::new(2);
        for i in 0..2 {
            t.record_put("a", &format!("m@tp_rank:0@a{i}"), false);
            t.record_put("b", &format!("m@tp_rank:0@b{i}"), false);
        }
        assert!(t.report().namespaces[0].unshared);
        t.record_found_from_other("b", "m@tp_rank:0@a0");
        let n = &t.report().namespaces[0];
        assert!(!n.unshared);
        assert_eq!(n.shared_keys, 1);
        // An already-exists put counts as a put and as shared.
        t.record_put("a", "m@tp_rank:0@b0", true);
        let n = &t.report().namespaces[0];
        assert_eq!((n.keys_put, n.shared_keys), (5, 2));
    }

    #[test]
    fn a_single_instance_or_few_keys_is_not_flagged() {
        let t = NamespaceTracker::new(3);
        for i in 0..10 {
            t.record_put("a", &format!("m@tp_rank:0@{i}"), false);
        }
        t.record_put("b", "m@tp_rank:0@ff", false);
        assert!(!t.report().namespaces[0].unshared);
        // Keys outside any namespace and anonymous callers are ignored.
        t.record_put("a", "other", false);
        t.record_put("", "m@tp_rank:0@1", false);
        assert_eq!(t.report().namespaces[0].keys_put, 11);
    }

    #[test]
    fn caps_bound_the_tracker() {
        let t = NamespaceTracker::new(1);
        for i in 0..MAX_NAMESPACES + 5 {
            t.record_put("a", &format!("m{i}@tp_rank:0@1"), false);
        }
        for i in 0..MAX_CLIENTS_PER_NAMESPACE + 3 {
            t.record_put(&format!("c{i}"), "m0@tp_rank:0@2", false);
        }
        let r = t.report();
        assert_eq!(r.namespaces.len(), MAX_NAMESPACES);
        assert_eq!(r.untracked, 5 + 4);
        let m0 = r
            .namespaces
            .iter()
            .find(|n| n.namespace == "m0@tp_rank:0")
            .expect("m0");
        assert_eq!(m0.clients.len(), MAX_CLIENTS_PER_NAMESPACE);
    }

    /// A figure, not an assertion: `cargo test -p lunakv-master --lib -- --ignored --nocapture
    /// record_cost`.
    #[test]
    #[ignore = "prints a figure"]
    fn record_cost() {
        let t = NamespaceTracker::new(64);
        let keys: Vec<String> = (0..100_000u64)
            .map(|i| format!("Qwen3-8B@tp_rank:{}@{i:016x}", i % 8))
            .collect();
        let start = std::time::Instant::now();
        for (i, k) in keys.iter().enumerate() {
            t.record_put(if i % 2 == 0 { "client-a" } else { "client-b" }, k, false);
        }
        let per_put = start.elapsed().as_nanos() as f64 / keys.len() as f64;
        let start = std::time::Instant::now();
        for k in &keys {
            let _ = namespace_of(k);
        }
        let per_parse = start.elapsed().as_nanos() as f64 / keys.len() as f64;
        println!("record_put: {per_put:.0} ns/op; namespace_of alone: {per_parse:.0} ns/op");
    }

    #[test]
    fn label_values_are_escaped() {
        let t = NamespaceTracker::new(1);
        t.record_put("a", "team-a\0m\"x\\@tp_rank:0@ab", false);
        let text = t.render_metrics();
        assert!(
            text.contains(
                "lunakv_namespace_keys_put_total{namespace=\"team-a/m\\\"x\\\\@tp_rank:0\"} 1"
            ),
            "{text}"
        );
    }
}
