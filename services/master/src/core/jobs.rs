//! Drain jobs' records ([`super::drain`] runs them): their limits, their states and reports as
//! upstream's `/api/v1/drain_jobs` names them, the moves handed to owners, and each job's
//! queue, rate bucket and tries.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lunakv_proto::ErrorCode;

use super::types::{PendingFree, ReplicaLoc, ReplicaView};

/// A moved object's result that never came back (an owner that died, restarted or predates
/// drains) is given up after this long, its target freed and the object tried again.
pub const MOVE_TIMEOUT: Duration = Duration::from_secs(60);
/// A failed move is tried this many times in all before its object counts as failed for good
/// (upstream's kMaxDrainUnitRetries).
pub const MAX_MOVE_TRIES: u32 = 3;
/// Jobs kept for their reports: the oldest finished one goes when a new job would pass this.
pub const MAX_JOBS: usize = 64;
/// Keys a report names among the blocked ones (the count is always whole).
pub const MAX_LISTED_BLOCKED: usize = 100;
/// Most objects of one job in flight at once, whatever the request asks.
pub const MAX_CONCURRENCY: u32 = 4096;
/// Most segments one request may name (sources and targets each).
pub const MAX_SEGMENTS: usize = 1024;
/// How soon an owner with moves to do pings again (the answer's `next_ping_ms`).
pub const DRAIN_PING_MS: u32 = 20;

/// A job's state: upstream's JobStatus values and names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobStatus {
    Created = 0,
    Planning = 1,
    Running = 2,
    Succeeded = 3,
    Failed = 4,
    Canceled = 5,
}

impl JobStatus {
    pub fn name(self) -> &'static str {
        match self {
            JobStatus::Created => "CREATED",
            JobStatus::Planning => "PLANNING",
            JobStatus::Running => "RUNNING",
            JobStatus::Succeeded => "SUCCEEDED",
            JobStatus::Failed => "FAILED",
            JobStatus::Canceled => "CANCELED",
        }
    }

    pub fn finished(self) -> bool {
        matches!(
            self,
            JobStatus::Succeeded | JobStatus::Failed | JobStatus::Canceled
        )
    }
}

/// A drain request: upstream's CreateDrainJobRequest, plus lunakv's byte rate.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainRequest {
    pub segments: Vec<String>,
    #[serde(default)]
    pub target_segments: Vec<String>,
    #[serde(default = "default_concurrency")]
    pub max_concurrency: u32,
    /// Bytes handed out per second (lunakv; absent: the master's `drain_max_bytes_per_sec`,
    /// 0: unbounded).
    #[serde(default)]
    pub max_bytes_per_sec: Option<u64>,
}

pub(super) fn default_concurrency() -> u32 {
    4
}

/// Why a drain call was refused; [`DrainError::code`] is upstream's error code for it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DrainError {
    #[error("invalid drain request: {0}")]
    Invalid(String),
    #[error("segment {0:?} is not mounted")]
    SegmentNotFound(String),
    #[error("{0}")]
    NotAvailable(String),
    #[error("no drain job {0:?}: the master restarted since, or the id is wrong")]
    JobNotFound(String),
}

impl DrainError {
    pub fn code(&self) -> ErrorCode {
        match self {
            DrainError::Invalid(_) => ErrorCode::InvalidParams,
            DrainError::SegmentNotFound(_) => ErrorCode::SegmentNotFound,
            DrainError::NotAvailable(_) => ErrorCode::UnavailableInCurrentStatus,
            DrainError::JobNotFound(_) => ErrorCode::JobNotFound,
        }
    }
}

/// A job as its query answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrainReport {
    pub job_id: String,
    pub status: JobStatus,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    pub segments: Vec<String>,
    pub succeeded: u64,
    pub failed: u64,
    pub blocked: u64,
    pub active: u64,
    pub migrated_bytes: u64,
    pub message: String,
    /// Up to 100 of the keys that fit nowhere (or failed for good).
    pub blocked_keys: Vec<String>,
}

/// One object a drain hands to its owner (the domain form of `DrainMove`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoveTask {
    pub job_id: String,
    pub key: String,
    pub generation: u64,
    pub size: u64,
    pub source: ReplicaView,
    pub target: ReplicaView,
}

/// An owner's report of one move (the domain form of `DrainMoveResult`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoveResult {
    pub job_id: String,
    pub key: String,
    pub generation: u64,
    pub ok: bool,
    pub error: String,
}

/// A move handed out and not yet reported.
pub(super) struct Active {
    pub(super) generation: u64,
    pub(super) size: u64,
    pub(super) source: ReplicaLoc,
    /// The source's owner: only its Ping may report the move.
    pub(super) client_id: String,
    pub(super) target: PendingFree,
    pub(super) handed: Instant,
}

pub(super) struct Job {
    pub(super) id: String,
    pub(super) status: JobStatus,
    pub(super) created: SystemTime,
    pub(super) updated: SystemTime,
    pub(super) segments: Vec<String>,
    /// Each source's mount when the job began: a remount (the owner restarted) ends the job.
    pub(super) mounts: HashMap<String, u64>,
    pub(super) targets: Vec<String>,
    pub(super) max_concurrency: u32,
    /// Bytes per second handed out (0: unbounded) and the bucket's tokens.
    pub(super) rate: u64,
    pub(super) tokens: f64,
    pub(super) refilled: Instant,
    pub(super) message: String,
    pub(super) succeeded: u64,
    pub(super) failed: u64,
    pub(super) migrated_bytes: u64,
    /// Keys still to plan in this pass, per source segment.
    pub(super) queue: HashMap<String, VecDeque<String>>,
    /// Moves in flight, by key.
    pub(super) active: HashMap<String, Active>,
    /// This pass: keys with no room anywhere, and keys whose put had not ended.
    pub(super) blocked: BTreeSet<String>,
    pub(super) deferred: usize,
    /// A move succeeded in this pass: blocked keys get another pass.
    pub(super) progress: bool,
    /// The job has planned at least one pass.
    pub(super) scanned: bool,
    pub(super) tries: HashMap<String, u32>,
    pub(super) given_up: BTreeSet<String>,
}

/// Every drain job of this core.
#[derive(Default)]
pub(super) struct Jobs {
    pub(super) map: HashMap<String, Job>,
}

pub(super) fn ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A random UUID in its text form (upstream's job ids).
pub(super) fn new_job_id() -> String {
    let b: [u8; 16] = rand::random();
    let mut b = b;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Whether `s` is a UUID's text form (8-4-4-4-12 hex digits), as upstream parses job ids.
pub fn is_job_id(s: &str) -> bool {
    let parts: Vec<&str> = s.split('-').collect();
    parts.len() == 5
        && parts
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(p, n)| p.len() == n && p.bytes().all(|c| c.is_ascii_hexdigit()))
}

impl Job {
    pub(super) fn report(&self) -> DrainReport {
        let mut blocked_keys: Vec<String> = self
            .blocked
            .iter()
            .chain(self.given_up.iter())
            .take(MAX_LISTED_BLOCKED)
            .cloned()
            .collect();
        blocked_keys.dedup();
        DrainReport {
            job_id: self.id.clone(),
            status: self.status,
            created_at_ms: ms(self.created),
            updated_at_ms: ms(self.updated),
            segments: self.segments.clone(),
            succeeded: self.succeeded,
            failed: self.failed,
            blocked: self.blocked.len() as u64,
            active: self.active.len() as u64,
            migrated_bytes: self.migrated_bytes,
            message: self.message.clone(),
            blocked_keys,
        }
    }

    pub(super) fn touch(&mut self, message: impl Into<String>) {
        self.updated = SystemTime::now();
        self.message = message.into();
    }

    /// Progress of a job that still runs (a canceled one keeps its final message).
    pub(super) fn running(&mut self) {
        if self.status.finished() {
            self.updated = SystemTime::now();
        } else {
            self.touch("Drain job running");
        }
    }

    pub(super) fn refill(&mut self, now: Instant) {
        if self.rate == 0 {
            return;
        }
        let dt = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.refilled = now;
        // At most one second's worth banked: a pause does not buy a burst.
        self.tokens = (self.tokens + dt * self.rate as f64).min(self.rate as f64);
    }

    pub(super) fn has_tokens(&self) -> bool {
        self.rate == 0 || self.tokens > 0.0
    }

    /// A failed or abandoned move: counted, and tried again unless it used its tries.
    pub(super) fn move_failed(&mut self, key: &str, segment: &str) {
        self.failed += 1;
        let n = self.tries.entry(key.to_string()).or_default();
        *n += 1;
        if *n >= MAX_MOVE_TRIES {
            self.given_up.insert(key.to_string());
        } else {
            self.queue
                .entry(segment.to_string())
                .or_default()
                .push_back(key.to_string());
        }
    }
}
