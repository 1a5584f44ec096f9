//! A segment owner's side of drain jobs (docs/ARCHITECTURE.md, "Drain jobs"): the master hands
//! the owner of a draining segment moves in its Ping answers; the owner copies each object from
//! its own DRAM (or its disk tier) into the range the master reserved on another segment, under
//! the same generation, as a put's writer would, and reports the outcome in its next Ping. The
//! master then swaps the replica in its index and frees the source.

use std::sync::Arc;

use lunakv_proto::master as pb;
use lunakv_transfer::{SegmentServer, TransferEngine, TransferOptions, TransferRequest};

use lunakv_master_client::{LocationError, ReplicaLocation};

/// A move the master sent that cannot be used as it stands.
#[derive(Debug, Clone, thiserror::Error)]
enum Unusable {
    #[error("the move names no {0} replica")]
    Missing(&'static str),
    #[error("{which} replica: {source}")]
    Location {
        which: &'static str,
        source: LocationError,
    },
}

/// Why one move failed; its text goes back to the master in the result.
#[derive(Debug, thiserror::Error)]
enum MoveError {
    #[error(transparent)]
    Unusable(#[from] Unusable),
    #[error("the target replica is on disk: a drain writes only into DRAM")]
    DiskTarget,
    #[error("object of {0} bytes does not fit this process's address space")]
    TooLarge(u64),
    #[error("reading the source: {0}")]
    Read(lunakv_transfer::TransferError),
    #[error("writing the target: {0}")]
    Write(lunakv_transfer::TransferError),
    #[error("the owner did not get to this move")]
    NotRun,
}

/// One move of a Ping answer, its replicas resolved against that answer's segment table.
pub(crate) struct Move {
    job_id: String,
    key: String,
    generation: u64,
    size: u64,
    /// The source and the target, or why the master's move cannot be used.
    places: Result<(ReplicaLocation, ReplicaLocation), Unusable>,
}

impl Move {
    /// Resolves the moves of one Ping answer, whose segment table is `segments`.
    pub(crate) fn resolve_all(
        moves: Vec<pb::DrainMove>,
        segments: &[pb::SegmentDescriptor],
    ) -> Vec<Move> {
        moves
            .into_iter()
            .map(|m| {
                let loc = |r: &Option<pb::Replica>, which: &'static str| {
                    let r = r.as_ref().ok_or(Unusable::Missing(which))?;
                    ReplicaLocation::try_from((r, m.size, segments))
                        .map_err(|source| Unusable::Location { which, source })
                };
                let places =
                    loc(&m.source, "source").and_then(|src| Ok((src, loc(&m.target, "target")?)));
                Move {
                    job_id: m.job_id,
                    key: m.key,
                    generation: m.generation,
                    size: m.size,
                    places,
                }
            })
            .collect()
    }
}

/// Bytes of objects one write batch holds in buffers.
const BATCH_BYTES: u64 = 64 << 20;

/// Copies objects for drain jobs; one per owner, made at its first move.
pub(crate) struct Mover {
    engine: TransferEngine,
}

impl Mover {
    /// A mover whose reads of `server` (this owner's own segment) are in-process copies.
    pub(crate) fn new(server: Option<&Arc<SegmentServer>>) -> Mover {
        let engine = TransferEngine::new(TransferOptions::default());
        if let Some(s) = server {
            engine.attach_local(s);
        }
        Mover { engine }
    }

    /// Runs `moves` (blocking: call it off the runtime) and returns one result per move, in
    /// order. Sources are read one by one (in-process copies, or LOADs from the SSD tier), and
    /// the writes go as one transfer batch per [`BATCH_BYTES`] of objects, pipelined per
    /// target: the owner holds at most that much in buffers whatever the master hands it.
    pub(crate) fn run(&self, moves: &[Move]) -> Vec<pb::DrainMoveResult> {
        let mut results: Vec<Option<Result<(), MoveError>>> =
            (0..moves.len()).map(|_| None).collect();
        let mut start = 0;
        while start < moves.len() {
            let mut end = start;
            let mut bytes = 0u64;
            while end < moves.len() && (end == start || bytes + moves[end].size <= BATCH_BYTES) {
                bytes += moves[end].size;
                end += 1;
            }
            self.chunk(&moves[start..end], &mut results[start..end]);
            start = end;
        }
        moves
            .iter()
            .zip(results)
            .map(|(m, r)| {
                let r = r.unwrap_or(Err(MoveError::NotRun));
                if let Err(e) = &r {
                    tracing::warn!(key = %m.key, job_id = %m.job_id, error = %e, "drain move failed");
                }
                pb::DrainMoveResult {
                    job_id: m.job_id.clone(),
                    key: m.key.clone(),
                    generation: m.generation,
                    ok: r.is_ok(),
                    error: r.err().map(|e| e.to_string()).unwrap_or_default(),
                }
            })
            .collect()
    }

    /// Reads each move's source, then writes every one read as one batch.
    fn chunk(&self, moves: &[Move], results: &mut [Option<Result<(), MoveError>>]) {
        let mut read: Vec<(usize, ReplicaLocation, Vec<u8>)> = Vec::with_capacity(moves.len());
        for (i, m) in moves.iter().enumerate() {
            match self.read(m) {
                Ok((dst, buf)) => read.push((i, dst, buf)),
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        let mut reqs: Vec<TransferRequest<'_>> = read
            .iter()
            .map(|(i, dst, buf)| TransferRequest::Write {
                target: &dst.target,
                generation: moves[*i].generation,
                key: &moves[*i].key,
                offset: dst.offset,
                src: vec![&buf[..]],
            })
            .collect();
        let written = self.engine.batch(&mut reqs);
        for ((i, _, _), r) in read.iter().zip(written) {
            results[*i] = Some(r.map_err(MoveError::Write));
        }
    }

    /// The move's target, and its bytes read from the source.
    fn read(&self, m: &Move) -> Result<(ReplicaLocation, Vec<u8>), MoveError> {
        let (src, dst) = match &m.places {
            Ok((src, dst)) => (src, dst.clone()),
            Err(e) => return Err(e.clone().into()),
        };
        if dst.disk {
            return Err(MoveError::DiskTarget);
        }
        let len = usize::try_from(m.size).map_err(|_| MoveError::TooLarge(m.size))?;
        let mut buf = vec![0u8; len];
        if src.disk {
            self.engine
                .load(&src.target, m.generation, &mut [&mut buf[..]])
                .map_err(MoveError::Read)?;
        } else {
            self.engine
                .read(&src.target, m.generation, src.offset, &mut [&mut buf[..]])
                .map_err(MoveError::Read)?;
        }
        Ok((dst, buf))
    }
}

/// An owner's moves in progress: one batch at a time on a blocking thread, beside the
/// heartbeat, so a slow or dead target delays the moves, never the Pings that keep the owner
/// alive at the master (a stalled heartbeat past client_ttl would unmount the very segment
/// being drained).
pub(crate) struct DrainWork {
    server: Option<Arc<SegmentServer>>,
    mover: Option<Arc<Mover>>,
    running: Option<tokio::task::JoinHandle<Vec<pb::DrainMoveResult>>>,
    queued: Vec<Move>,
    /// Finished moves not yet reported.
    pub(crate) results: Vec<pb::DrainMoveResult>,
}

impl DrainWork {
    pub(crate) fn new(server: Option<Arc<SegmentServer>>) -> DrainWork {
        DrainWork {
            server,
            mover: None,
            running: None,
            queued: Vec::new(),
            results: Vec::new(),
        }
    }

    /// Starts `moves` now, or after the batch in progress.
    pub(crate) fn start(&mut self, moves: Vec<Move>) {
        if self.running.is_some() {
            self.queued.extend(moves);
            return;
        }
        let server = self.server.as_ref();
        let mover = self
            .mover
            .get_or_insert_with(|| Arc::new(Mover::new(server)))
            .clone();
        self.running = Some(tokio::task::spawn_blocking(move || mover.run(&moves)));
    }

    /// Resolves once the batch in progress ended (never while none runs): its results join
    /// [`Self::results`] and the queued moves start. Cancel-safe: dropped early, the batch
    /// goes on and a later call picks it up.
    pub(crate) async fn finished(&mut self) {
        let Some(h) = self.running.as_mut() else {
            return std::future::pending().await;
        };
        let r = h.await;
        self.running = None;
        match r {
            Ok(r) => self.results.extend(r),
            Err(e) => {
                tracing::warn!(error = %e, "drain moves panicked; the master retries them after its timeout")
            }
        }
        if !self.queued.is_empty() {
            let q = std::mem::take(&mut self.queued);
            self.start(q);
        }
    }
}
