//! Pool KV events (docs/EVENTS.md): what the master's index gains and loses, published off the
//! request path on two ZMQ PUB streams.
//!
//! - The index emits a [`PoolEvent`] through an [`EventSink`] where it changes: a put's end or
//!   an inventory bringing a key back (stored), eviction, offload, promotion, remove, a dead
//!   owner's unmount (replicas changed), `remove_all`, and the start of a core (a leader term or
//!   a restart: everything before it is void). Emitting is one `try_send` into a bounded queue;
//!   a full queue drops the event and counts it. Nothing on a request path ever waits on
//!   publishing.
//! - One thread ([`publisher`]) owns the ZMQ sockets: it drains the queue into batches, encodes
//!   them ([`wire`]) in Mooncake's format (and, when configured, vLLM's), sends them with a
//!   high-water mark, keeps the last batches for replay and answers replay requests.

mod event;
pub mod pods;
pub mod publisher;
pub mod wire;

pub use event::{PoolEvent, ReplicaRef, Tiers};

use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

/// The events' settings, from the master config (`kv_event_publisher_*`, `kv_events_*`).
#[derive(Debug, Clone, PartialEq)]
pub struct EventsConfig {
    /// Mooncake stream: PUB socket, bound.
    pub endpoint: String,
    /// The key that named `endpoint`, for errors.
    pub endpoint_key: &'static str,
    /// Mooncake stream: upstream main's RFC #1527 maps or the older arrays.
    pub mooncake_format: wire::MooncakeFormat,
    /// Mooncake stream, `rfc1527`: upstream main's per-event settings.
    pub rfc: wire::RfcWire,
    /// ROUTER socket answering replay requests; `None` = no replay.
    pub replay_endpoint: Option<String>,
    pub topic: String,
    /// ZMQ send high-water mark of the PUB sockets, in messages.
    pub hwm: i32,
    /// Events waiting for the publisher thread; more are dropped and counted.
    pub max_queue_size: usize,
    /// Most events in one batch.
    pub max_batch_size: usize,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Tokens per block, as the events report it (0 = not known).
    pub block_size: u32,
    /// vLLM-format stream, when set: PUB socket, bound when the endpoint has a wildcard
    /// (`*`, `::`) or is ipc://, connected otherwise (vLLM's rule; llm-d's central mode binds
    /// the SUB side and publishers connect).
    pub vllm_endpoint: Option<String>,
    /// Pods (`address:port` of each serving endpoint) the vLLM stream announces pool blocks
    /// for: one topic `kv@<pod>@<model>` each.
    pub vllm_pods: Vec<String>,
    /// `medium` of a DRAM copy / an SSD copy on the vLLM stream.
    pub vllm_medium_dram: String,
    pub vllm_medium_ssd: String,
    /// vLLM stream: encoding, hash type, block size, ownership.
    pub vllm_wire: wire::VllmWire,
    /// vLLM stream: the model name of a key's topic.
    pub vllm_served: lunakv_config::master::ServedModelNames,
}

impl EventsConfig {
    /// The events' settings, or `None` when `enable_kv_event_publish` is off.
    pub fn from_master(c: &lunakv_config::master::MasterConfig) -> Option<EventsConfig> {
        if !c.enable_kv_event_publish {
            return None;
        }
        let opt = |s: &str| (!s.is_empty()).then(|| s.to_string());
        let (endpoint_key, endpoint) = c.kv_events_mooncake_endpoint();
        let block_size = u32::try_from(c.kv_event_block_size).unwrap_or(0);
        // Both bounds apply; upstream's 0 ("unbounded") leaves lunakv's own, so the master's
        // memory stays bounded whatever a subscriber does.
        let max_queue_size = match c.kv_events_queue_capacity {
            0 => c.kv_event_publisher_max_queue_size,
            cap => cap.min(c.kv_event_publisher_max_queue_size),
        };
        Some(EventsConfig {
            endpoint: endpoint.to_string(),
            endpoint_key,
            mooncake_format: if c.kv_events_mooncake_format == "array" {
                wire::MooncakeFormat::Array
            } else {
                wire::MooncakeFormat::Rfc1527
            },
            rfc: wire::RfcWire {
                backend_id: if c.kv_events_backend_id.is_empty() {
                    c.cluster_id.clone()
                } else {
                    c.kv_events_backend_id.clone()
                },
                emit_legacy_compat: c.kv_events_emit_legacy_compat,
                emit_object_key: c.kv_events_emit_object_key,
                block_size,
            },
            replay_endpoint: opt(&c.kv_event_publisher_replay_endpoint),
            topic: c.kv_event_publisher_topic.clone(),
            hwm: i32::try_from(c.kv_event_publisher_hwm).unwrap_or(i32::MAX),
            max_queue_size: max_queue_size as usize,
            max_batch_size: c.kv_event_publisher_max_batch_size.max(1) as usize,
            buffer_steps: c.kv_event_publisher_buffer_steps as usize,
            block_size,
            vllm_endpoint: opt(&c.kv_events_vllm_endpoint),
            vllm_pods: c
                .kv_events_vllm_pods
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
            vllm_medium_dram: c.kv_events_vllm_medium_dram.clone(),
            vllm_medium_ssd: c.kv_events_vllm_medium_ssd.clone(),
            vllm_wire: wire::VllmWire {
                format: if c.kv_events_vllm_format == "array" {
                    wire::VllmFormat::Array
                } else {
                    wire::VllmFormat::Tagged
                },
                int_hashes: c.kv_events_vllm_int_hashes,
                block_size,
                ownership: c.kv_events_vllm_ownership.clone(),
            },
            // validate() refused a value that does not parse.
            vllm_served: c.kv_events_vllm_served_models().unwrap_or_default(),
        })
    }
}

/// The events' metrics, in their own registry: they outlive the per-term core.
pub struct EventStats {
    pub registry: Registry,
    /// Events handed to the publisher, per stream (`mooncake`, `vllm`).
    pub published: IntCounterVec,
    pub batches: IntCounterVec,
    /// Events lost before any subscriber could see them, per reason (`queue_full`,
    /// `send_failed`).
    pub dropped: IntCounterVec,
    /// Connected subscribers (peers of the bound PUB socket; for a connecting vLLM stream, 1
    /// while the connection is up).
    pub subscribers: IntGaugeVec,
    pub replay_requests: IntCounter,
    pub enabled: IntGauge,
}

impl std::fmt::Debug for EventStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventStats").finish_non_exhaustive()
    }
}

impl Default for EventStats {
    fn default() -> Self {
        EventStats::new()
    }
}

impl EventStats {
    pub fn new() -> EventStats {
        let r = Registry::new();
        let counter_vec = |name: &str, help: &str, label: &str| {
            let c = IntCounterVec::new(Opts::new(name, help), &[label]).expect("static metric");
            r.register(Box::new(c.clone())).expect("unique metric");
            c
        };
        let published = counter_vec(
            "master_kv_events_published_total",
            "KV events sent on each stream",
            "stream",
        );
        let batches = counter_vec(
            "master_kv_event_batches_published_total",
            "KV event batches (ZMQ messages) sent on each stream",
            "stream",
        );
        let dropped = counter_vec(
            "master_kv_events_dropped_total",
            "KV events lost before publishing: the publisher queue was full, the send failed, \
             the vLLM stream already had MAX_VLLM_MODELS models, or (kv_events_emit_object_key \
             off) the key names no block",
            "reason",
        );
        for reason in [
            "queue_full",
            "send_failed",
            "too_many_models",
            "unparsed_key",
        ] {
            dropped.with_label_values(&[reason]);
        }
        let subscribers = IntGaugeVec::new(
            Opts::new(
                "master_kv_event_subscribers",
                "Connected subscribers of each KV event stream",
            ),
            &["stream"],
        )
        .expect("static metric");
        r.register(Box::new(subscribers.clone()))
            .expect("unique metric");
        let replay_requests = IntCounter::new(
            "master_kv_event_replay_requests_total",
            "Replay requests answered on the replay endpoint",
        )
        .expect("static metric");
        r.register(Box::new(replay_requests.clone()))
            .expect("unique metric");
        let enabled = IntGauge::new(
            "master_kv_events_enabled",
            "1 when the master publishes KV events (enable_kv_event_publish)",
        )
        .expect("static metric");
        r.register(Box::new(enabled.clone()))
            .expect("unique metric");
        EventStats {
            registry: r,
            published,
            batches,
            dropped,
            subscribers,
            replay_requests,
            enabled,
        }
    }
}

/// The index's end of the event queue. Cloned into every core; [`EventSink::emit`] never
/// blocks.
#[derive(Debug, Clone)]
pub struct EventSink {
    tx: SyncSender<PoolEvent>,
    stats: Arc<EventStats>,
    endpoints: Arc<publisher::EventEndpoints>,
}

impl EventSink {
    /// A sink and the queue's other end, holding at most `capacity` events (0 = a rendezvous
    /// queue: an event is dropped unless the publisher is waiting for it).
    pub fn channel(
        capacity: usize,
        stats: Arc<EventStats>,
        endpoints: publisher::EventEndpoints,
    ) -> (EventSink, Receiver<PoolEvent>) {
        let (tx, rx) = sync_channel(capacity);
        let endpoints = Arc::new(endpoints);
        (
            EventSink {
                tx,
                stats,
                endpoints,
            },
            rx,
        )
    }

    /// Where the streams are (`lunakv status`).
    pub fn endpoints(&self) -> &publisher::EventEndpoints {
        &self.endpoints
    }

    /// Queues `ev` for publishing; a full queue (or a stopped publisher) drops it and counts.
    pub fn emit(&self, ev: PoolEvent) {
        match self.tx.try_send(ev) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.stats.dropped.with_label_values(&["queue_full"]).inc();
            }
            Err(TrySendError::Disconnected(_)) => {
                self.stats.dropped.with_label_values(&["send_failed"]).inc();
            }
        }
    }

    pub fn stats(&self) -> &Arc<EventStats> {
        &self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_drops_and_counts_without_blocking() {
        let stats = Arc::new(EventStats::new());
        let (sink, rx) = EventSink::channel(2, stats.clone(), Default::default());
        for _ in 0..5 {
            sink.emit(PoolEvent::RemovedAll);
        }
        assert_eq!(
            stats.dropped.with_label_values(&["queue_full"]).get(),
            3,
            "two fit, three dropped"
        );
        assert_eq!(rx.try_iter().count(), 2);
    }

    /// Upstream main's queue bound and lunakv's both apply, the smaller winning; upstream's 0
    /// ("unbounded") leaves lunakv's. The backend id falls back to the cluster's name.
    #[test]
    fn upstream_mains_settings_shape_the_publisher() {
        use lunakv_config::master::MasterConfig;
        let c = |cap: u64, max: u64, backend: &str| MasterConfig {
            enable_kv_event_publish: true,
            kv_events_queue_capacity: cap,
            kv_event_publisher_max_queue_size: max,
            kv_events_backend_id: backend.into(),
            ..MasterConfig::default()
        };
        let ec = |c: MasterConfig| EventsConfig::from_master(&c).expect("enabled");
        assert_eq!(ec(c(65536, 100_000, "")).max_queue_size, 65536);
        assert_eq!(ec(c(65536, 10, "")).max_queue_size, 10);
        assert_eq!(ec(c(0, 100_000, "")).max_queue_size, 100_000);
        assert_eq!(ec(c(0, 1, "")).rfc.backend_id, "mooncake_cluster");
        assert_eq!(ec(c(0, 1, "store-node-1")).rfc.backend_id, "store-node-1");
        let d = ec(MasterConfig {
            enable_kv_event_publish: true,
            kv_events_bind_endpoint: "tcp://0.0.0.0:5557".into(),
            ..MasterConfig::default()
        });
        assert_eq!(
            (d.endpoint.as_str(), d.endpoint_key),
            ("tcp://0.0.0.0:5557", "kv_events_bind_endpoint")
        );
        assert_eq!(d.mooncake_format, wire::MooncakeFormat::Rfc1527);
        assert_eq!(d.vllm_wire.format, wire::VllmFormat::Tagged);
        assert!(d.vllm_wire.int_hashes && d.rfc.emit_legacy_compat && d.rfc.emit_object_key);
    }

    #[test]
    fn tiers_of_replicas() {
        let r = |disk| ReplicaRef {
            disk,
            endpoint: "h:1".into(),
        };
        assert_eq!(
            Tiers::of(&[r(false), r(true)]),
            Tiers {
                dram: true,
                ssd: true
            }
        );
        assert_eq!(Tiers::of(&[]), Tiers::default());
    }
}
