//! The publisher thread: the only owner of the ZMQ sockets (libzmq sockets are not thread-safe),
//! so the index never touches them. It drains the queue into batches of at most
//! `max_batch_size`, sends each batch on the Mooncake stream (and the vLLM stream when set),
//! keeps the last `buffer_steps` Mooncake batches for replay and answers replay requests
//! between batches (within ~10 ms when idle).
//!
//! While events keep coming the thread gathers them for [`GATHER`] instead of waking per event:
//! a put then costs the index one `try_send` into a queue nobody is blocked on (no futex wake),
//! and the thread, libzmq's I/O thread and every subscriber wake once per batch, not per put.
//! On a 2-core machine those wake-ups were what events cost a put (docs/EVENTS.md, "Batching"
//! and "Benchmark").

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::pods::Pods;
use super::wire::{self, VllmEvent};
use super::{EventSink, EventStats, EventsConfig, PoolEvent};

/// Answers a replay ends with: the sequence and payload frames both eight 0xFF bytes (Mooncake's
/// marker is the payload; vLLM's subscriber reads the sequence as -1).
pub const END_SEQ: [u8; 8] = [0xFF; 8];

/// How long the thread waits for an event before it looks at replay requests again.
const IDLE_POLL: Duration = Duration::from_millis(10);

/// How long a busy stream gathers events into one batch: the most an event waits beyond its
/// predecessor's batch. A router learns of a block this much later, far below a request's
/// time in the queue.
pub const GATHER: Duration = Duration::from_millis(5);

/// Most models the vLLM stream keeps topics for. Model names come from the keys clients put, so
/// without a bound one client could grow the publisher's state (and every clear's fan-out)
/// without end; events of further models are dropped and counted (`too_many_models`).
pub const MAX_VLLM_MODELS: usize = 256;

/// Most batches sent between two looks at the replay socket and the monitors.
const MAX_BATCHES_PER_LOOK: usize = 64;

/// A publisher that could not start: the message names the setting and the fix.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    #[error(
        "{key} = {endpoint:?}: cannot {action}: {message}; give a free tcp://host:port (or \
         tcp://host:* for any port) or another ZMQ endpoint"
    )]
    Endpoint {
        key: &'static str,
        endpoint: String,
        action: &'static str,
        message: String,
    },
    #[error("cannot create the KV event socket: {0}")]
    Socket(String),
}

/// Where the streams are, as bound (a `*` port resolved).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct EventEndpoints {
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    pub vllm_endpoint: Option<String>,
    pub vllm_pods: Vec<String>,
}

/// The running publisher; dropping it stops the thread (queued events are flushed first).
pub struct Publisher {
    sink: EventSink,
    endpoints: EventEndpoints,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("endpoints", &self.endpoints)
            .finish_non_exhaustive()
    }
}

fn endpoint_err(
    key: &'static str,
    endpoint: &str,
    action: &'static str,
    e: zmq::Error,
) -> EventsError {
    EventsError::Endpoint {
        key,
        endpoint: endpoint.to_string(),
        action,
        message: e.to_string(),
    }
}

fn socket(ctx: &zmq::Context, kind: zmq::SocketType, hwm: i32) -> Result<zmq::Socket, EventsError> {
    let s = ctx
        .socket(kind)
        .map_err(|e| EventsError::Socket(e.to_string()))?;
    s.set_sndhwm(hwm)
        .and_then(|_| s.set_linger(0))
        .map_err(|e| EventsError::Socket(e.to_string()))?;
    Ok(s)
}

fn bound(s: &zmq::Socket, asked: &str) -> String {
    match s.get_last_endpoint() {
        Ok(Ok(e)) if !e.is_empty() => e,
        _ => asked.to_string(),
    }
}

/// vLLM's rule for its `endpoint`: a wildcard host or an ipc/inproc path binds, anything else
/// connects (llm-d's central mode binds the SUB side).
pub fn vllm_binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// Counts a stream's peers from its socket monitor.
struct Monitor {
    sock: zmq::Socket,
    stream: &'static str,
}

impl Monitor {
    fn attach(
        ctx: &zmq::Context,
        target: &zmq::Socket,
        stream: &'static str,
    ) -> Result<Monitor, EventsError> {
        let addr = format!("inproc://lunakv-events-monitor-{stream}");
        let events = zmq::SocketEvent::ACCEPTED.to_raw()
            | zmq::SocketEvent::CONNECTED.to_raw()
            | zmq::SocketEvent::DISCONNECTED.to_raw();
        target
            .monitor(&addr, i32::from(events))
            .map_err(|e| EventsError::Socket(e.to_string()))?;
        let sock = ctx
            .socket(zmq::PAIR)
            .map_err(|e| EventsError::Socket(e.to_string()))?;
        sock.connect(&addr)
            .map_err(|e| EventsError::Socket(e.to_string()))?;
        Ok(Monitor { sock, stream })
    }

    fn drain(&self, stats: &EventStats) {
        while let Ok(frames) = self.sock.recv_multipart(zmq::DONTWAIT) {
            let Some(first) = frames.first().filter(|f| f.len() >= 2) else {
                continue;
            };
            let event = u16::from_le_bytes([first[0], first[1]]);
            let gauge = stats.subscribers.with_label_values(&[self.stream]);
            if event == zmq::SocketEvent::ACCEPTED.to_raw()
                || event == zmq::SocketEvent::CONNECTED.to_raw()
            {
                gauge.inc();
            } else if event == zmq::SocketEvent::DISCONNECTED.to_raw() && gauge.get() > 0 {
                gauge.dec();
            }
        }
    }
}

struct Worker {
    cfg: EventsConfig,
    stats: Arc<EventStats>,
    rx: Receiver<PoolEvent>,
    stop: Arc<AtomicBool>,
    pub_sock: zmq::Socket,
    replay: Option<zmq::Socket>,
    vllm: Option<zmq::Socket>,
    /// The vLLM stream's pods now (names resolved again and again).
    pods: Pods,
    monitors: Vec<Monitor>,
    seq: u64,
    /// The next `event_id` of the `rfc1527` stream.
    event_id: u64,
    ring: VecDeque<(u64, Vec<u8>)>,
    /// Next sequence number per (pod, model) topic; pods that left are forgotten when the pod
    /// list changes (one that comes back restarts at 0, which subscribers read as a reset).
    vllm_seq: HashMap<(String, String), u64>,
    /// The pod list `vllm_seq` was last pruned for.
    vllm_seq_pods: Arc<Vec<String>>,
    /// Models the vLLM stream has announced blocks of: a clear goes to each one's topics.
    vllm_models: BTreeSet<String>,
    // Held so the sockets outlive nothing they depend on.
    _ctx: zmq::Context,
}

impl Publisher {
    /// Binds (or, for a vLLM endpoint without a wildcard, connects) the sockets, then starts the
    /// thread. Errors name the setting.
    pub fn start(cfg: EventsConfig, stats: Arc<EventStats>) -> Result<Publisher, EventsError> {
        let ctx = zmq::Context::new();
        let pub_sock = socket(&ctx, zmq::PUB, cfg.hwm)?;
        pub_sock
            .bind(&cfg.endpoint)
            .map_err(|e| endpoint_err(cfg.endpoint_key, &cfg.endpoint, "bind", e))?;
        let mut monitors = vec![Monitor::attach(&ctx, &pub_sock, "mooncake")?];
        let replay = match &cfg.replay_endpoint {
            Some(ep) => {
                // A whole ring must fit in one answer's send queue.
                let hwm = i32::try_from(cfg.buffer_steps.saturating_add(16)).unwrap_or(i32::MAX);
                let s = socket(&ctx, zmq::ROUTER, hwm)?;
                s.bind(ep).map_err(|e| {
                    endpoint_err("kv_event_publisher_replay_endpoint", ep, "bind", e)
                })?;
                Some(s)
            }
            None => None,
        };
        let vllm = match &cfg.vllm_endpoint {
            Some(ep) => {
                let s = socket(&ctx, zmq::PUB, cfg.hwm)?;
                if vllm_binds(ep) {
                    s.bind(ep)
                        .map_err(|e| endpoint_err("kv_events_vllm_endpoint", ep, "bind", e))?;
                } else {
                    s.connect(ep)
                        .map_err(|e| endpoint_err("kv_events_vllm_endpoint", ep, "connect", e))?;
                }
                monitors.push(Monitor::attach(&ctx, &s, "vllm")?);
                Some(s)
            }
            None => None,
        };
        let endpoints = EventEndpoints {
            endpoint: bound(&pub_sock, &cfg.endpoint),
            replay_endpoint: replay
                .as_ref()
                .zip(cfg.replay_endpoint.as_deref())
                .map(|(s, asked)| bound(s, asked)),
            topic: cfg.topic.clone(),
            vllm_endpoint: match (&vllm, &cfg.vllm_endpoint) {
                (Some(s), Some(ep)) if vllm_binds(ep) => Some(bound(s, ep)),
                (_, ep) => ep.clone(),
            },
            vllm_pods: cfg.vllm_pods.clone(),
        };
        for stream in ["mooncake", "vllm"] {
            stats.subscribers.with_label_values(&[stream]).set(0);
        }
        stats.enabled.set(1);
        let (sink, rx) = EventSink::channel(cfg.max_queue_size, stats.clone(), endpoints.clone());
        let stop = Arc::new(AtomicBool::new(false));
        let pods = Pods::start(if vllm.is_some() { &cfg.vllm_pods } else { &[] });
        let worker = Worker {
            cfg,
            pods,
            stats,
            rx,
            stop: stop.clone(),
            pub_sock,
            replay,
            vllm,
            monitors,
            seq: 0,
            event_id: 0,
            ring: VecDeque::new(),
            vllm_seq: HashMap::new(),
            vllm_seq_pods: Arc::default(),
            vllm_models: BTreeSet::new(),
            _ctx: ctx,
        };
        let thread = std::thread::Builder::new()
            .name("kv-events".into())
            .spawn(move || worker.run())
            .map_err(|e| EventsError::Socket(e.to_string()))?;
        Ok(Publisher {
            sink,
            endpoints,
            stop,
            thread: Some(thread),
        })
    }

    /// The index's end of the queue.
    pub fn sink(&self) -> EventSink {
        self.sink.clone()
    }

    pub fn endpoints(&self) -> &EventEndpoints {
        &self.endpoints
    }

    pub fn stats(&self) -> &Arc<EventStats> {
        self.sink.stats()
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn now_ts() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Worker {
    fn run(mut self) {
        let mut batch: Vec<PoolEvent> = Vec::with_capacity(self.cfg.max_batch_size);
        // Busy: the last look found events, so the next one sleeps and drains rather than
        // blocking on the queue (a blocked receiver makes every sender wake it).
        let mut busy = false;
        // A backlog was left after the last look's batches: look again without sleeping.
        let mut backlog = false;
        loop {
            let stopping = self.stop.load(Ordering::Relaxed);
            let first = if stopping {
                self.rx.try_recv().map_err(|_| RecvTimeoutError::Timeout)
            } else if busy {
                if !backlog {
                    std::thread::sleep(GATHER);
                }
                self.rx.try_recv().map_err(|e| match e {
                    std::sync::mpsc::TryRecvError::Empty => RecvTimeoutError::Timeout,
                    std::sync::mpsc::TryRecvError::Disconnected => RecvTimeoutError::Disconnected,
                })
            } else {
                self.rx.recv_timeout(IDLE_POLL)
            };
            busy = first.is_ok();
            backlog &= busy;
            match first {
                Ok(ev) => {
                    batch.push(ev);
                    self.drain_into(&mut batch);
                    self.publish(&batch);
                    batch.clear();
                    // Whatever is left beyond max_batch_size goes at once, batch by batch, up to
                    // a bound, so replay requests are still served under a flood.
                    backlog = true;
                    for _ in 0..MAX_BATCHES_PER_LOOK {
                        self.drain_into(&mut batch);
                        if batch.is_empty() {
                            backlog = false;
                            break;
                        }
                        self.publish(&batch);
                        batch.clear();
                    }
                }
                Err(RecvTimeoutError::Timeout) if stopping => break,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            self.serve_replays();
            for m in &self.monitors {
                m.drain(&self.stats);
            }
        }
        self.stats.enabled.set(0);
    }

    /// Moves queued events into `batch` until it holds `max_batch_size`.
    fn drain_into(&self, batch: &mut Vec<PoolEvent>) {
        while batch.len() < self.cfg.max_batch_size {
            match self.rx.try_recv() {
                Ok(ev) => batch.push(ev),
                Err(_) => break,
            }
        }
    }

    fn publish(&mut self, events: &[PoolEvent]) {
        let ts = now_ts();
        self.publish_mooncake(ts, events);
        if self.vllm.is_some() {
            self.publish_vllm(ts, events);
        }
    }

    fn publish_mooncake(&mut self, ts: f64, events: &[PoolEvent]) {
        let (payload, sent) = match self.cfg.mooncake_format {
            wire::MooncakeFormat::Array => (
                wire::encode_mooncake_batch(ts, events, self.cfg.block_size),
                events.len() as u64,
            ),
            wire::MooncakeFormat::Rfc1527 => {
                let ts_ms = (ts * 1000.0) as i64;
                let batch =
                    wire::encode_rfc1527_batch(ts_ms, events, &mut self.event_id, &self.cfg.rfc);
                if batch.skipped > 0 {
                    let d = self.stats.dropped.with_label_values(&["unparsed_key"]);
                    d.inc_by(batch.skipped);
                }
                // Nothing left to send: every event was skipped, or none changed a medium.
                let Some(payload) = batch.payload else {
                    return;
                };
                (payload, batch.events)
            }
        };
        let seq = self.seq;
        self.seq += 1;
        let frames: [&[u8]; 3] = [self.cfg.topic.as_bytes(), &seq.to_be_bytes(), &payload];
        // PUB never blocks: a subscriber at its high-water mark loses this batch (its sequence
        // shows the gap; replay has it). An error here is the socket failing.
        match self.pub_sock.send_multipart(frames, zmq::DONTWAIT) {
            Ok(()) => {
                let m = self.stats.published.with_label_values(&["mooncake"]);
                m.inc_by(sent);
                self.stats.batches.with_label_values(&["mooncake"]).inc();
            }
            Err(e) => {
                tracing::warn!(error = %e, events = sent, "KV event batch not sent");
                let d = self.stats.dropped.with_label_values(&["send_failed"]);
                d.inc_by(sent);
            }
        }
        // Kept only where a replay socket can ask for them.
        if self.cfg.buffer_steps > 0 && self.replay.is_some() {
            if self.ring.len() >= self.cfg.buffer_steps {
                self.ring.pop_front();
            }
            self.ring.push_back((seq, payload));
        }
    }

    fn publish_vllm(&mut self, ts: f64, events: &[PoolEvent]) {
        let (dram, ssd) = (&self.cfg.vllm_medium_dram, &self.cfg.vllm_medium_ssd);
        let mut by_model: HashMap<String, Vec<VllmEvent>> = HashMap::new();
        for ev in events {
            for (model, v) in wire::vllm_events(ev, dram, ssd) {
                match model {
                    Some(m) => {
                        let m = match self.cfg.vllm_served.served(&m) {
                            served if served == m => m,
                            served => served.to_string(),
                        };
                        if !self.vllm_models.contains(&m) {
                            if self.vllm_models.len() >= MAX_VLLM_MODELS {
                                let d = self.stats.dropped.with_label_values(&["too_many_models"]);
                                d.inc();
                                continue;
                            }
                            self.vllm_models.insert(m.clone());
                        }
                        by_model.entry(m).or_default().push(v);
                    }
                    None => {
                        for m in &self.vllm_models {
                            by_model.entry(m.clone()).or_default().push(v.clone());
                        }
                    }
                }
            }
        }
        let Some(sock) = &self.vllm else { return };
        let now = self.pods.now();
        if !Arc::ptr_eq(&now, &self.vllm_seq_pods) {
            let pool_level = self.cfg.vllm_pods.is_empty();
            self.vllm_seq
                .retain(|(pod, _), _| pool_level || now.contains(pod));
            self.vllm_seq_pods = now.clone();
        }
        // No pods configured: one pool-level topic. Names that resolve to nothing: no topic.
        let pods: Vec<&str> = if self.cfg.vllm_pods.is_empty() {
            vec!["lunakv"]
        } else {
            now.iter().map(String::as_str).collect()
        };
        for (model, evs) in by_model {
            let payload = wire::encode_vllm_batch(ts, evs.iter(), &self.cfg.vllm_wire);
            for pod in &pods {
                let topic = format!("kv@{pod}@{model}");
                let seq = self
                    .vllm_seq
                    .entry((pod.to_string(), model.clone()))
                    .or_insert(0);
                let frames: [&[u8]; 3] = [topic.as_bytes(), &seq.to_be_bytes(), &payload];
                *seq += 1;
                match sock.send_multipart(frames, zmq::DONTWAIT) {
                    Ok(()) => {
                        let m = self.stats.published.with_label_values(&["vllm"]);
                        m.inc_by(evs.len() as u64);
                        self.stats.batches.with_label_values(&["vllm"]).inc();
                    }
                    Err(zmq::Error::EAGAIN) => {
                        // A connecting PUB with no connection yet queues up to the HWM, then
                        // refuses: the batch is lost for that topic.
                        let d = self.stats.dropped.with_label_values(&["send_failed"]);
                        d.inc_by(evs.len() as u64);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, %topic, "vLLM-format KV event batch not sent");
                        let d = self.stats.dropped.with_label_values(&["send_failed"]);
                        d.inc_by(evs.len() as u64);
                    }
                }
            }
        }
    }

    /// Answers every waiting replay request: the stored batches from the asked sequence on,
    /// each `[envelope..., seq, payload]`, then `[envelope..., END_SEQ, END_SEQ]`. The envelope
    /// is the request without its last frame, so a DEALER that sent `["", seq]` (vLLM's
    /// subscriber) gets `["", seq, payload]`, and one that sent `[client_id, "", seq]` (Mooncake's
    /// guide) gets `[client_id, "", seq, payload]`.
    fn serve_replays(&mut self) {
        let Some(sock) = &self.replay else { return };
        while let Ok(frames) = sock.recv_multipart(zmq::DONTWAIT) {
            let Some((start, envelope)) = frames.split_last() else {
                continue;
            };
            let Ok(start) = <[u8; 8]>::try_from(start.as_slice()) else {
                tracing::debug!(
                    frames = frames.len(),
                    "replay request without an 8-byte start sequence ignored"
                );
                continue;
            };
            if envelope.is_empty() {
                continue;
            }
            self.stats.replay_requests.inc();
            let start = u64::from_be_bytes(start);
            let send = |seq: &[u8], payload: &[u8]| {
                let mut out: Vec<&[u8]> = envelope.iter().map(Vec::as_slice).collect();
                out.push(seq);
                out.push(payload);
                sock.send_multipart(out, zmq::DONTWAIT)
            };
            for (seq, payload) in self.ring.iter().filter(|(s, _)| *s >= start) {
                if send(&seq.to_be_bytes(), payload).is_err() {
                    break;
                }
            }
            let _ = send(&END_SEQ, &END_SEQ);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::ReplicaRef;
    use super::*;

    fn config() -> EventsConfig {
        EventsConfig {
            endpoint: "tcp://127.0.0.1:*".into(),
            endpoint_key: "kv_event_publisher_endpoint",
            mooncake_format: wire::MooncakeFormat::Rfc1527,
            rfc: wire::RfcWire {
                backend_id: "pool".into(),
                emit_legacy_compat: true,
                emit_object_key: true,
                block_size: 0,
            },
            replay_endpoint: None,
            topic: "mooncake".into(),
            hwm: 100_000,
            max_queue_size: 100_000,
            max_batch_size: 50,
            buffer_steps: 0,
            block_size: 0,
            vllm_endpoint: None,
            vllm_pods: vec![],
            vllm_medium_dram: "CPU".into(),
            vllm_medium_ssd: "STORAGE".into(),
            vllm_wire: wire::VllmWire {
                format: wire::VllmFormat::Tagged,
                int_hashes: true,
                block_size: 0,
                ownership: "lunakv".into(),
            },
            vllm_served: Default::default(),
        }
    }

    /// Model names come from clients' keys: past MAX_VLLM_MODELS the vLLM stream drops and
    /// counts instead of keeping a topic per name.
    #[test]
    fn the_vllm_stream_keeps_at_most_max_models() {
        let stats = Arc::new(EventStats::new());
        let p = Publisher::start(
            EventsConfig {
                vllm_endpoint: Some("tcp://127.0.0.1:*".into()),
                ..config()
            },
            stats.clone(),
        )
        .expect("publisher");
        let sink = p.sink();
        let extra = 10;
        for i in 0..MAX_VLLM_MODELS + extra {
            sink.emit(PoolEvent::Stored {
                key: format!("model{i}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{i:064x}"),
                replicas: vec![ReplicaRef {
                    disk: false,
                    endpoint: "127.0.0.1:1".into(),
                }],
            });
        }
        drop(p);
        let dropped = stats.dropped.with_label_values(&["too_many_models"]).get();
        assert_eq!(dropped, extra as u64);
    }

    /// A steady stream, one event every 200 us (a busy master's put ends), leaves in batches:
    /// the thread gathers instead of sending (and waking libzmq and every subscriber) per event,
    /// as it did before (100 batches for 100 events).
    #[test]
    fn a_steady_stream_goes_out_in_gathered_batches() {
        let stats = Arc::new(EventStats::new());
        let p = Publisher::start(config(), stats.clone()).expect("publisher");
        let sink = p.sink();
        let events = 100u64;
        for i in 0..events {
            sink.emit(PoolEvent::Stored {
                key: format!("k{i}"),
                replicas: vec![ReplicaRef {
                    disk: false,
                    endpoint: "127.0.0.1:1".into(),
                }],
            });
            std::thread::sleep(Duration::from_micros(200));
        }
        drop(p); // flushes what is queued
        let published = stats.published.with_label_values(&["mooncake"]).get();
        let batches = stats.batches.with_label_values(&["mooncake"]).get();
        assert_eq!(published, events, "every event sent");
        // Each 5 ms window holds ~25 events here; even with every sleep overshooting to 1 ms
        // a batch holds about 5. One message per event is what the thread did before.
        assert!(
            batches * 3 <= events,
            "{batches} batches for {events} events: at least 3 events per batch expected"
        );
    }
}
