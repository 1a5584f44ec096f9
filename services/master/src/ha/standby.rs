//! HA warm standby, the wire side (`ha_warm_standby`, docs/HA.md "Warm standby"): the leader
//! streams its index to each standby over `ReplicateIndex` (a snapshot, then every change), and
//! a standby keeps the copy in a [`WarmCopy`] that its next term's core starts from
//! ([`crate::core::MasterCore::preload_warm`]). The core's side is `core/warm.rs`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lunakv_proto::master as pb;
use parking_lot::Mutex;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use crate::core::{IndexChange, IndexEntry, IndexSnapshot, MasterCore, WarmReplicaLoc};
use crate::ha::metrics::HaMetrics;

/// Entries per snapshot message are cut at about this many bytes (gRPC's default limit is
/// 4 MiB; the standby accepts up to [`MAX_MESSAGE`]).
const PART_BYTES: usize = 1 << 20;
const MAX_MESSAGE: usize = 16 << 20;
/// Messages queued towards one standby before the leader waits for it (its feed keeps
/// buffering up to [`crate::core::warm::FEED_CAPACITY`] changes, then it resyncs).
const QUEUED_MESSAGES: usize = 16;
/// How often a stream checks that this master still leads the term it serves.
const LEADING_CHECK: Duration = Duration::from_millis(200);
/// Pause between a standby's attempts to subscribe.
const RETRY: Duration = Duration::from_millis(200);
/// Streams a leader serves at once: each holds a snapshot's worth of memory while it starts,
/// and a pool has a few standbys, not dozens.
pub const MAX_STREAMS: usize = 8;

static STREAMS: AtomicUsize = AtomicUsize::new(0);

/// One open stream, counted against [`MAX_STREAMS`] until dropped.
struct StreamSlot;

impl StreamSlot {
    fn take() -> Result<StreamSlot, Status> {
        if STREAMS.fetch_add(1, Ordering::AcqRel) >= MAX_STREAMS {
            STREAMS.fetch_sub(1, Ordering::AcqRel);
            return Err(Status::resource_exhausted(format!(
                "this leader already streams its index to {MAX_STREAMS} standbys (the most it \
                 serves); stop a master that is not a standby of this pool, or run fewer \
                 standbys"
            )));
        }
        Ok(StreamSlot)
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        STREAMS.fetch_sub(1, Ordering::AcqRel);
    }
}

// === leader side ===

/// The `ReplicateIndex` stream of `core`, until `still_leading` turns false or the standby
/// goes away. A standby that falls behind the feed's buffer gets a new snapshot. Refused
/// beyond [`MAX_STREAMS`] at once.
pub fn serve(
    core: Arc<MasterCore>,
    term: u64,
    standby: String,
    still_leading: impl Fn() -> bool + Send + 'static,
) -> Result<ReceiverStream<Result<pb::IndexUpdate, Status>>, Status> {
    let slot = StreamSlot::take()?;
    let (tx, rx) = mpsc::channel(QUEUED_MESSAGES);
    tokio::spawn(async move {
        let _slot = slot;
        let mut snapshots = 0u64;
        'resync: loop {
            let mut feed = core.subscribe_index();
            let snap = core.index_snapshot();
            snapshots += 1;
            tracing::info!(%standby, keys = snap.entries.len(), segments = snap.segments.len(), snapshots, "sending the index to a standby");
            for msg in snapshot_messages(term, snap) {
                if tx.send(Ok(msg)).await.is_err() {
                    return;
                }
            }
            let mut tick = tokio::time::interval(LEADING_CHECK);
            loop {
                let first = tokio::select! {
                    _ = tick.tick() => {
                        if !still_leading() {
                            return;
                        }
                        continue;
                    }
                    c = feed.recv() => c,
                };
                let mut changes = match first {
                    Ok(c) => vec![c],
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(%standby, missed = n, "a standby fell behind the index feed; sending it a new snapshot");
                        continue 'resync;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                let mut bytes = 0;
                while bytes < PART_BYTES {
                    match feed.try_recv() {
                        Ok(c) => {
                            bytes += change_bytes(&c);
                            changes.push(c);
                        }
                        Err(broadcast::error::TryRecvError::Lagged(_)) => continue 'resync,
                        Err(_) => break,
                    }
                }
                if tx.send(Ok(changes_message(term, &changes))).await.is_err() {
                    return;
                }
            }
        }
    });
    Ok(ReceiverStream::new(rx))
}

fn change_bytes(c: &IndexChange) -> usize {
    match c {
        IndexChange::Entry(e) => e.key.len() + 24 + e.replicas.len() * 48,
        _ => 256,
    }
}

fn entry_pb(e: &IndexEntry) -> pb::IndexEntry {
    pb::IndexEntry {
        key: e.key.clone(),
        generation: e.generation,
        size: e.size,
        replicas: e
            .replicas
            .iter()
            .map(|r| pb::IndexReplica {
                segment: r.segment.clone(),
                offset: r.offset,
                disk: r.disk,
            })
            .collect(),
    }
}

fn snapshot_messages(term: u64, snap: IndexSnapshot) -> Vec<pb::IndexUpdate> {
    let mut out = vec![pb::IndexUpdate {
        term,
        reset: true,
        mounted: snap
            .segments
            .iter()
            .map(|(d, c)| mounted_pb(d, c))
            .collect(),
        ..Default::default()
    }];
    let mut part = Vec::new();
    let mut bytes = 0;
    for e in &snap.entries {
        bytes += e.key.len() + 24 + e.replicas.len() * 48;
        part.push(entry_pb(e));
        if bytes >= PART_BYTES {
            out.push(pb::IndexUpdate {
                term,
                entries: std::mem::take(&mut part),
                ..Default::default()
            });
            bytes = 0;
        }
    }
    out.push(pb::IndexUpdate {
        term,
        entries: part,
        snapshot_done: true,
        ..Default::default()
    });
    out
}

fn changes_message(term: u64, changes: &[Arc<IndexChange>]) -> pb::IndexUpdate {
    let mut m = pb::IndexUpdate {
        term,
        ..Default::default()
    };
    for c in changes {
        match c.as_ref() {
            IndexChange::Mounted { desc, client_id } => m.mounted.push(mounted_pb(desc, client_id)),
            IndexChange::Unmounted { segment } => m.unmounted.push(segment.clone()),
            IndexChange::Entry(e) => m.entries.push(entry_pb(e)),
        }
    }
    m
}

// === standby side ===

#[derive(Default)]
struct CopyState {
    term: u64,
    synced: bool,
    segments: HashMap<String, (crate::core::SegmentDesc, String)>,
    entries: HashMap<String, IndexEntry>,
}

/// A standby's copy of the leader's index.
pub struct WarmCopy {
    state: Mutex<CopyState>,
    metrics: Option<(prometheus::IntGauge, prometheus::IntGauge)>,
}

impl WarmCopy {
    pub fn new(metrics: &HaMetrics) -> Arc<WarmCopy> {
        Arc::new(WarmCopy {
            state: Mutex::new(CopyState::default()),
            metrics: Some((
                metrics.warm_copy_keys.clone(),
                metrics.warm_copy_synced.clone(),
            )),
        })
    }

    /// Applies one message of the stream. Updates arrive in order: a segment's mount before
    /// the entries that name it, a key's changes in the order the leader made them.
    ///
    /// Mounted and unmounted changes in the same message as entries are applied first; the
    /// entries of an unmount arrive as their own changes, so the order between them does not
    /// matter.
    fn apply(&self, u: pb::IndexUpdate) {
        let mut s = self.state.lock();
        if u.reset || u.term != s.term {
            *s = CopyState {
                term: u.term,
                ..CopyState::default()
            };
        }
        for m in u.mounted {
            let Some(d) = m.segment else { continue };
            let Ok(mut desc) = crate::core::SegmentDesc::try_from(d) else {
                continue;
            };
            desc.data_secret = lunakv_transfer::MountSecret::from_slice(&m.data_secret);
            s.segments.insert(desc.name.clone(), (desc, m.client_id));
        }
        for name in u.unmounted {
            s.segments.remove(&name);
        }
        for e in u.entries {
            if e.replicas.is_empty() {
                s.entries.remove(&e.key);
                continue;
            }
            s.entries.insert(
                e.key.clone(),
                IndexEntry {
                    key: e.key,
                    generation: e.generation,
                    size: e.size,
                    replicas: e
                        .replicas
                        .into_iter()
                        .map(|r| WarmReplicaLoc {
                            segment: r.segment,
                            offset: r.offset,
                            disk: r.disk,
                        })
                        .collect(),
                },
            );
        }
        if u.snapshot_done {
            s.synced = true;
        }
        if let Some((keys, synced)) = &self.metrics {
            keys.set(s.entries.len() as i64);
            synced.set(i64::from(s.synced));
        }
    }

    /// Empties the copy and returns it when it is a whole copy of the index of `term`'s leader
    /// (the last leader this standby saw), and None otherwise.
    pub fn take(&self, term: u64) -> Option<IndexSnapshot> {
        let s = std::mem::take(&mut *self.state.lock());
        if let Some((keys, synced)) = &self.metrics {
            keys.set(0);
            synced.set(0);
        }
        if !s.synced || s.term != term || term == 0 {
            return None;
        }
        Some(IndexSnapshot {
            segments: s.segments.into_values().collect(),
            entries: s.entries.into_values().collect(),
        })
    }

    /// Keeps the copy in step with the leader at `address` until the task is aborted:
    /// subscribes, applies the stream, and subscribes again when it breaks.
    pub async fn follow(
        self: Arc<Self>,
        address: String,
        me: String,
        token: Option<String>,
        tls: Option<lunakv_tls::ClientTls>,
    ) {
        let mut logged = false;
        loop {
            match self
                .follow_once(&address, &me, token.as_deref(), tls.as_ref())
                .await
            {
                Ok(()) => {}
                Err(e) if !logged => {
                    tracing::info!(leader = %address, error = %e, "cannot follow the leader's index (retrying); a takeover by this standby would rebuild it from the owners");
                    logged = true;
                }
                Err(_) => {}
            }
            // The copy stays usable: the leader's death is what usually breaks the stream,
            // and the next subscription starts with a new snapshot anyway.
            tokio::time::sleep(RETRY).await;
        }
    }

    async fn follow_once(
        &self,
        address: &str,
        me: &str,
        token: Option<&str>,
        tls: Option<&lunakv_tls::ClientTls>,
    ) -> Result<(), Status> {
        let ep = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
            .map_err(|e| Status::invalid_argument(e.to_string()))?
            .connect_timeout(Duration::from_secs(2));
        let ch = lunakv_master_client::connect_endpoint(ep, tls, Duration::from_secs(2))
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let mut client =
            pb::master_client::MasterClient::new(ch).max_decoding_message_size(MAX_MESSAGE);
        let mut req = tonic::Request::new(pb::ReplicateIndexRequest {
            standby: me.to_string(),
        });
        if let Some(t) = token {
            let v = lunakv_master_client::bearer(t)
                .parse()
                .map_err(|_| Status::invalid_argument("the pool token is not a valid header"))?;
            req.metadata_mut().insert("authorization", v);
        }
        let mut stream = client.replicate_index(req).await?.into_inner();
        while let Some(u) = stream.message().await? {
            self.apply(u);
        }
        Ok(())
    }
}

/// A mounted segment on the replication stream, with its owner's mount secret.
fn mounted_pb(d: &crate::core::SegmentDesc, client_id: &str) -> pb::MountedSegment {
    pb::MountedSegment {
        segment: Some(d.into()),
        client_id: client_id.to_owned(),
        data_secret: d
            .data_secret
            .as_ref()
            .map(|s| s.as_bytes().to_vec())
            .unwrap_or_default(),
    }
}
