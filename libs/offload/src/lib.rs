//! lunakv-offload: the SSD tier of a segment owner (`lunakv-store --enable_offload`).
//!
//! Objects the master evicts from DRAM are appended to large **bucket files**
//! (`bucket-<id>.bucket`, each at most 256 MiB or 500 objects, as upstream's bucket backend), and
//! a **redb index** (`index.redb`, replacing upstream's per-bucket `.meta` files) maps
//! `generation -> (key, bucket, offset, len, crc32)`.
//!
//! Durability and the fsync policy (why a torn write is never served):
//! 1. a batch's bytes are written with `pwrite` into the current bucket(s);
//! 2. every bucket touched is `fdatasync`ed (and the directory is fsynced when a bucket file was
//!    created, so the file itself survives a crash);
//! 3. only then are the batch's index rows committed in one redb transaction (redb's default
//!    durability fsyncs the commit);
//! 4. only then does [`DiskTier::store_batch`] return, and only then does the owner drop the DRAM
//!    copy and acknowledge the master.
//!
//! A crash (kill -9, power loss) before step 3 leaves unindexed bytes in a bucket tail: dead space,
//! never read. Every read verifies the CRC32 recorded at step 3; a mismatch (a flipped bit on the
//! device, a bucket file edited by hand) drops the object from the index, counts it and reports it
//! to the master ([`DiskTier::take_dropped`]). It is never served.
//!
//! One fsync per batch (not per object) keeps the write path near raw sequential bandwidth; the
//! master offloads whole eviction passes at once, so batches are large.
//!
//! Space: the total size of the bucket files stays under the configured limit
//! (`MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES`). When a batch does not fit, whole buckets go, oldest
//! first: FIFO, upstream's default. [`EvictionPolicy::Lru`] re-appends an object to the newest
//! bucket when it is read, so hot objects move away from the eviction end (their old copy becomes
//! dead space). Recovery never appends to an old bucket: after a restart writes start in a new
//! bucket, so a torn tail is never overwritten or extended.
//!
//! Compaction (upstream has none: its dead space leaves only with a whole bucket, so LRU
//! re-appends and removals make it drop live objects while most of the limit is garbage): when a
//! batch does not fit, sealed buckets that are at least half dead are rewritten first, live
//! objects only, *in place of* the old file and under the same bucket id, so FIFO age order is
//! kept. Only if that frees too little do whole buckets go. The rewrite is crash-safe:
//! 1. live objects are copied (each CRC-checked) into `bucket-<id>.compact` and fdatasynced;
//! 2. the new offsets are committed to the index in one transaction;
//! 3. the `.compact` file is renamed over the bucket and the directory fsynced.
//!
//! At open, a leftover `.compact` file means a crash between 1 and 3: if every index row of that
//! bucket checks out (bounds and CRC) against the `.compact` file, step 2 happened and the rename
//! is finished; otherwise it is deleted and the old bucket stays. Readers that picked up the old
//! file before the switch keep reading it through their open handle.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

/// Upstream's bucket size bound.
pub const BUCKET_MAX_BYTES: u64 = 256 << 20;
/// Upstream's bucket key-count bound.
pub const BUCKET_MAX_KEYS: usize = 500;
/// Failpoint for crash tests: the process aborts (as with kill -9) once this many bucket bytes
/// have been written since start, in the middle of a write, before the fsync and the index commit.
pub const FAILPOINT_CRASH_AFTER_BYTES: &str = "LUNAKV_FAILPOINT_OFFLOAD_CRASH_AFTER_BYTES";

const INDEX_FILE: &str = "index.redb";
const OBJECTS: TableDefinition<'static, u64, &[u8]> = TableDefinition::new("objects");

/// Which disk objects go first when the size limit is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EvictionPolicy {
    /// Oldest written first (upstream's default).
    #[default]
    Fifo,
    /// Least recently read first (a read re-appends the object to the newest bucket).
    Lru,
}

impl std::str::FromStr for EvictionPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fifo" => Ok(EvictionPolicy::Fifo),
            "lru" => Ok(EvictionPolicy::Lru),
            other => Err(format!(
                "unknown offload eviction policy {other:?}: use \"fifo\" (default) or \"lru\""
            )),
        }
    }
}

/// How a [`DiskTier`] is opened.
#[derive(Debug, Clone)]
pub struct OffloadConfig {
    /// Directory of the bucket files and the index (`MOONCAKE_OFFLOAD_FILE_STORAGE_PATH`).
    pub dir: PathBuf,
    /// Most bytes of bucket files (`MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES`).
    pub limit_bytes: u64,
    pub policy: EvictionPolicy,
    pub bucket_max_bytes: u64,
    pub bucket_max_keys: usize,
}

impl OffloadConfig {
    pub fn new(dir: impl Into<PathBuf>, limit_bytes: u64) -> OffloadConfig {
        OffloadConfig {
            dir: dir.into(),
            limit_bytes,
            policy: EvictionPolicy::Fifo,
            bucket_max_bytes: BUCKET_MAX_BYTES,
            bucket_max_keys: BUCKET_MAX_KEYS,
        }
    }
}

/// Errors of the disk tier. Messages name the path and the fix.
#[derive(Debug, thiserror::Error)]
pub enum OffloadError {
    #[error(
        "offload directory {dir}: {what}: {source}; create it and make it writable by this process \
         (MOONCAKE_OFFLOAD_FILE_STORAGE_PATH), e.g. mount a volume at /data/mooncake-offload"
    )]
    Dir {
        dir: String,
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error(
        "offload index {path}: {message}; is another lunakv-store using this directory? each \
         store-client needs its own MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"
    )]
    Index { path: String, message: String },
    #[error(
        "writing bucket {path} failed: {source}; the disk may be full or failing: free space, lower \
         MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES, or check the device"
    )]
    Write {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error(
        "an object of {size} bytes is larger than the offload size limit of {limit} bytes; raise \
         MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES"
    )]
    TooLarge { size: u64, limit: u64 },
}

/// Why a read from disk did not return bytes.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("generation {0} is not on disk")]
    NotFound(u64),
    #[error("buffer of {have} bytes for an object of {need} bytes")]
    BufferSize { need: u64, have: u64 },
    #[error(
        "object {key:?} (generation {generation}) failed its checksum (stored {expected:#010x}, read \
         {actual:#010x}): dropped, never served; check the device"
    )]
    Corrupt {
        key: String,
        generation: u64,
        expected: u32,
        actual: u32,
    },
    #[error("reading bucket {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: io::Error,
    },
}

/// One object on disk (what the owner reports to the master at mount).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskObject {
    pub key: String,
    pub generation: u64,
    pub size: u64,
}

/// What [`DiskTier::open`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    pub objects: u64,
    pub bytes: u64,
    /// Index rows whose bucket was missing or too short (dropped).
    pub dropped_rows: u64,
    /// Bucket files without a live object (deleted: torn tails of unfinished batches, leftovers).
    pub deleted_buckets: u64,
    /// Compactions interrupted after their index commit, finished at open.
    pub compactions_finished: u64,
    /// Compactions interrupted before their index commit, discarded at open (old bucket kept).
    pub compactions_discarded: u64,
}

/// Counters and gauges for /metrics and `lunakv status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskStats {
    pub objects: u64,
    /// Bytes of live objects.
    pub live_bytes: u64,
    /// Bytes of bucket files (live objects plus dead space), what the limit bounds.
    pub used_bytes: u64,
    pub capacity_bytes: u64,
    pub bytes_written_total: u64,
    pub objects_written_total: u64,
    pub loads_total: u64,
    pub bytes_loaded_total: u64,
    pub evicted_objects_total: u64,
    pub corrupt_objects_total: u64,
    pub write_errors_total: u64,
    /// Buckets rewritten without their dead space.
    pub compactions_total: u64,
    /// Bytes of dead space those rewrites returned.
    pub compacted_bytes_total: u64,
}

#[derive(Debug, Clone)]
struct Loc {
    bucket: u64,
    offset: u64,
    len: u64,
    crc: u32,
    key: String,
}

impl Loc {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(28 + self.key.len());
        v.extend_from_slice(&self.bucket.to_le_bytes());
        v.extend_from_slice(&self.offset.to_le_bytes());
        v.extend_from_slice(&self.len.to_le_bytes());
        v.extend_from_slice(&self.crc.to_le_bytes());
        v.extend_from_slice(self.key.as_bytes());
        v
    }

    fn decode(b: &[u8]) -> Option<Loc> {
        let u64_at = |i: usize| -> Option<u64> {
            Some(u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?))
        };
        Some(Loc {
            bucket: u64_at(0)?,
            offset: u64_at(8)?,
            len: u64_at(16)?,
            crc: u32::from_le_bytes(b.get(24..28)?.try_into().ok()?),
            key: String::from_utf8(b.get(28..)?.to_vec()).ok()?,
        })
    }
}

struct Bucket {
    file: Arc<File>,
    path: PathBuf,
    /// Bytes reserved in the file (written or being written).
    size: u64,
    /// Objects appended (live or not): the key-count bound.
    appended: usize,
    /// Generations whose live copy is in this bucket.
    live: HashSet<u64>,
}

#[derive(Default)]
struct Inner {
    objects: HashMap<u64, Loc>,
    /// Bucket id order is age order.
    buckets: BTreeMap<u64, Bucket>,
    current: Option<u64>,
    next_bucket: u64,
    used: u64,
    live_bytes: u64,
    dropped: Vec<DiskObject>,
}

#[derive(Default)]
struct Counters {
    bytes_written: AtomicU64,
    objects_written: AtomicU64,
    loads: AtomicU64,
    bytes_loaded: AtomicU64,
    evicted: AtomicU64,
    corrupt: AtomicU64,
    write_errors: AtomicU64,
    compactions: AtomicU64,
    compacted_reclaimed: AtomicU64,
}

/// The disk tier of one segment owner. `Send + Sync`: writes are serialized (one appender),
/// reads run in parallel with each other and with writes.
pub struct DiskTier {
    cfg: OffloadConfig,
    db: Database,
    inner: Mutex<Inner>,
    /// Serializes appenders: bucket offsets are reserved and the batch committed in order.
    writer: Mutex<()>,
    counters: Counters,
    failpoint: Option<u64>,
    written_since_start: AtomicU64,
}

/// One object handed to [`DiskTier::store_batch`].
#[derive(Debug, Clone, Copy)]
pub struct StoreItem<'a> {
    pub key: &'a str,
    pub generation: u64,
    /// The object's bytes, in pieces (written in order).
    pub bytes: &'a [u8],
}

fn bucket_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("bucket-{id:016}.bucket"))
}

fn compact_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("bucket-{id:016}.compact"))
}

fn parse_compact_name(name: &str) -> Option<u64> {
    name.strip_prefix("bucket-")?
        .strip_suffix(".compact")?
        .parse()
        .ok()
}

/// Where a compaction run stops early, leaving its files as a crash would (crash tests only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(test), allow(dead_code))]
enum CompactStop {
    Never,
    BeforeIndexCommit,
    BeforeRename,
}

fn parse_bucket_name(name: &str) -> Option<u64> {
    name.strip_prefix("bucket-")?
        .strip_suffix(".bucket")?
        .parse()
        .ok()
}

fn index_err(path: &Path) -> impl Fn(String) -> OffloadError + '_ {
    move |message| OffloadError::Index {
        path: path.display().to_string(),
        message,
    }
}

impl DiskTier {
    /// Opens (creating if needed) the tier in `cfg.dir` and recovers its index: rows whose bytes
    /// are not fully on disk are dropped, bucket files holding no indexed object are deleted.
    pub fn open(cfg: OffloadConfig) -> Result<(DiskTier, RecoveryReport), OffloadError> {
        let dir = cfg.dir.clone();
        let dir_err = |what: &'static str| {
            let dir = dir.display().to_string();
            move |source| OffloadError::Dir { dir, what, source }
        };
        std::fs::create_dir_all(&dir).map_err(dir_err("cannot create"))?;
        // Probe writability now, so a read-only mount is a startup error rather than a failure
        // at the first eviction.
        let probe = dir.join(".lunakv-write-probe");
        File::create(&probe).map_err(dir_err("not writable"))?;
        let _ = std::fs::remove_file(&probe);

        let index_path = dir.join(INDEX_FILE);
        let ierr = index_err(&index_path);
        let db = Database::create(&index_path).map_err(|e| ierr(e.to_string()))?;
        let mut report = RecoveryReport::default();

        // Buckets on disk.
        let mut files: BTreeMap<u64, (PathBuf, u64)> = BTreeMap::new();
        let mut compacts: Vec<(u64, PathBuf)> = Vec::new();
        for e in std::fs::read_dir(&dir).map_err(dir_err("cannot list"))? {
            let e = e.map_err(dir_err("cannot list"))?;
            let name = e.file_name();
            let Some(name) = name.to_str() else {
                continue;
            };
            if let Some(id) = parse_compact_name(name) {
                compacts.push((id, e.path()));
                continue;
            }
            let Some(id) = parse_bucket_name(name) else {
                continue;
            };
            let len = e.metadata().map_err(dir_err("cannot stat a bucket"))?.len();
            files.insert(id, (e.path(), len));
        }
        if !compacts.is_empty() {
            // The index table may not exist yet in a directory that never committed a row.
            let txn = db.begin_write().map_err(|e| ierr(e.to_string()))?;
            txn.open_table(OBJECTS).map_err(|e| ierr(e.to_string()))?;
            txn.commit().map_err(|e| ierr(e.to_string()))?;
            let rows = Self::read_rows(&db, &ierr)?;
            for (id, tmp) in compacts {
                let finished = Self::compaction_committed(&tmp, id, &rows);
                if finished {
                    let dst = bucket_path(&dir, id);
                    std::fs::rename(&tmp, &dst).map_err(dir_err("cannot finish a compaction"))?;
                    let len = std::fs::metadata(&dst)
                        .map_err(dir_err("cannot stat a bucket"))?
                        .len();
                    files.insert(id, (dst, len));
                    report.compactions_finished += 1;
                } else {
                    let _ = std::fs::remove_file(&tmp);
                    report.compactions_discarded += 1;
                }
            }
            File::open(&dir)
                .and_then(|d| d.sync_all())
                .map_err(dir_err("cannot sync"))?;
        }

        // Index rows, checked against the files.
        let mut objects: HashMap<u64, Loc> = HashMap::new();
        let mut bad_rows = Vec::new();
        {
            let txn = db.begin_write().map_err(|e| ierr(e.to_string()))?;
            txn.open_table(OBJECTS).map_err(|e| ierr(e.to_string()))?;
            txn.commit().map_err(|e| ierr(e.to_string()))?;
            let txn = db.begin_read().map_err(|e| ierr(e.to_string()))?;
            let table = txn.open_table(OBJECTS).map_err(|e| ierr(e.to_string()))?;
            for row in table.iter().map_err(|e| ierr(e.to_string()))? {
                let (k, v) = row.map_err(|e| ierr(e.to_string()))?;
                let generation = k.value();
                let loc = Loc::decode(v.value());
                let ok = loc.as_ref().is_some_and(|l| {
                    files
                        .get(&l.bucket)
                        .is_some_and(|(_, len)| l.offset.saturating_add(l.len) <= *len)
                });
                match (ok, loc) {
                    (true, Some(loc)) => {
                        objects.insert(generation, loc);
                    }
                    _ => bad_rows.push(generation),
                }
            }
        }
        if !bad_rows.is_empty() {
            tracing::warn!(
                rows = bad_rows.len(),
                "offload index rows whose bytes are missing on disk: dropped"
            );
            let txn = db.begin_write().map_err(|e| ierr(e.to_string()))?;
            {
                let mut t = txn.open_table(OBJECTS).map_err(|e| ierr(e.to_string()))?;
                for g in &bad_rows {
                    t.remove(*g).map_err(|e| ierr(e.to_string()))?;
                }
            }
            txn.commit().map_err(|e| ierr(e.to_string()))?;
            report.dropped_rows = bad_rows.len() as u64;
        }

        let mut inner = Inner {
            next_bucket: files.keys().next_back().map_or(1, |id| id + 1),
            ..Inner::default()
        };
        for (id, (path, len)) in files {
            let live: HashSet<u64> = objects
                .iter()
                .filter(|(_, l)| l.bucket == id)
                .map(|(g, _)| *g)
                .collect();
            if live.is_empty() {
                // Torn tail of a batch that never committed, or a bucket whose objects all went.
                let _ = std::fs::remove_file(&path);
                report.deleted_buckets += 1;
                continue;
            }
            let file = File::open(&path).map_err(dir_err("cannot open a bucket"))?;
            inner.used += len;
            inner.buckets.insert(
                id,
                Bucket {
                    file: Arc::new(file),
                    path,
                    size: len,
                    appended: live.len(),
                    live,
                },
            );
        }
        inner.live_bytes = objects.values().map(|l| l.len).sum();
        report.objects = objects.len() as u64;
        report.bytes = inner.live_bytes;
        inner.objects = objects;
        let failpoint = std::env::var(FAILPOINT_CRASH_AFTER_BYTES)
            .ok()
            .and_then(|v| v.trim().parse().ok());
        tracing::info!(dir = %dir.display(), objects = report.objects, bytes = report.bytes, dropped_rows = report.dropped_rows, deleted_buckets = report.deleted_buckets, limit = cfg.limit_bytes, "offload tier opened");
        Ok((
            DiskTier {
                cfg,
                db,
                inner: Mutex::new(inner),
                writer: Mutex::new(()),
                counters: Counters::default(),
                failpoint,
                written_since_start: AtomicU64::new(0),
            },
            report,
        ))
    }

    pub fn config(&self) -> &OffloadConfig {
        &self.cfg
    }

    fn read_rows(
        db: &Database,
        ierr: &impl Fn(String) -> OffloadError,
    ) -> Result<Vec<(u64, Option<Loc>)>, OffloadError> {
        let txn = db.begin_read().map_err(|e| ierr(e.to_string()))?;
        let table = txn.open_table(OBJECTS).map_err(|e| ierr(e.to_string()))?;
        let mut rows = Vec::new();
        for row in table.iter().map_err(|e| ierr(e.to_string()))? {
            let (k, v) = row.map_err(|e| ierr(e.to_string()))?;
            rows.push((k.value(), Loc::decode(v.value())));
        }
        Ok(rows)
    }

    /// Whether the index already points into the `.compact` file of bucket `id` (step 2 of a
    /// compaction committed): every row of that bucket is in bounds and its CRC matches there.
    fn compaction_committed(tmp: &Path, id: u64, rows: &[(u64, Option<Loc>)]) -> bool {
        let Ok(file) = File::open(tmp) else {
            return false;
        };
        let Ok(len) = file.metadata().map(|m| m.len()) else {
            return false;
        };
        let mut any = false;
        let mut buf = Vec::new();
        for loc in rows.iter().filter_map(|(_, l)| l.as_ref()) {
            if loc.bucket != id {
                continue;
            }
            any = true;
            if loc.offset.saturating_add(loc.len) > len {
                return false;
            }
            buf.resize(loc.len as usize, 0);
            if file.read_exact_at(&mut buf, loc.offset).is_err() || crc32fast::hash(&buf) != loc.crc
            {
                return false;
            }
        }
        any
    }

    /// Writes the objects durably (see the crate docs for the order of writes and fsyncs).
    /// Returns the generations now on disk, in input order; objects already on disk count as
    /// stored. An error means none of the batch was indexed.
    pub fn store_batch(&self, items: &[StoreItem<'_>]) -> Result<Vec<u64>, OffloadError> {
        self.store(items, false)
    }

    fn store(&self, items: &[StoreItem<'_>], relocate: bool) -> Result<Vec<u64>, OffloadError> {
        let _w = self.writer.lock();
        let mut done = Vec::new();
        let mut todo: Vec<&StoreItem<'_>> = Vec::new();
        {
            let g = self.inner.lock();
            for it in items {
                if !relocate && g.objects.contains_key(&it.generation) {
                    done.push(it.generation);
                } else if todo.iter().all(|t| t.generation != it.generation) {
                    todo.push(it);
                }
            }
        }
        if todo.is_empty() {
            return Ok(done);
        }
        for it in &todo {
            if it.bytes.len() as u64 > self.cfg.limit_bytes {
                return Err(OffloadError::TooLarge {
                    size: it.bytes.len() as u64,
                    limit: self.cfg.limit_bytes,
                });
            }
        }
        let need: u64 = todo.iter().map(|t| t.bytes.len() as u64).sum();
        let over = {
            let g = self.inner.lock();
            (g.used + need.min(self.cfg.limit_bytes)).saturating_sub(self.cfg.limit_bytes)
        };
        if over > 0 {
            // Reclaim dead space before dropping live objects; best effort.
            if let Err(e) = self.compact(over, CompactStop::Never) {
                tracing::warn!(error = %e, "offload compaction failed; dropping whole buckets instead");
            }
        }
        // Reserve: room under the limit, then a (bucket, offset) per object.
        let mut placed: Vec<(u64, u64, Arc<File>, PathBuf)> = Vec::with_capacity(todo.len());
        let mut new_bucket = false;
        {
            let mut g = self.inner.lock();
            self.make_room(&mut g, need.min(self.cfg.limit_bytes))?;
            for it in &todo {
                let len = it.bytes.len() as u64;
                let fits = g
                    .current
                    .and_then(|id| g.buckets.get(&id))
                    .is_some_and(|b| {
                        b.appended < self.cfg.bucket_max_keys
                            && (b.size == 0 || b.size + len <= self.cfg.bucket_max_bytes)
                    });
                if !fits {
                    let id = g.next_bucket;
                    g.next_bucket += 1;
                    let path = bucket_path(&self.cfg.dir, id);
                    let file = std::fs::OpenOptions::new()
                        .create(true)
                        .truncate(true)
                        .read(true)
                        .write(true)
                        .open(&path)
                        .map_err(|source| {
                            self.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                            OffloadError::Write {
                                path: path.display().to_string(),
                                source,
                            }
                        })?;
                    g.buckets.insert(
                        id,
                        Bucket {
                            file: Arc::new(file),
                            path,
                            size: 0,
                            appended: 0,
                            live: HashSet::new(),
                        },
                    );
                    g.current = Some(id);
                    new_bucket = true;
                }
                let id = g.current.unwrap_or_default();
                let Some(b) = g.buckets.get_mut(&id) else {
                    continue;
                };
                let off = b.size;
                b.size += len;
                b.appended += 1;
                let (file, path) = (b.file.clone(), b.path.clone());
                g.used += len;
                placed.push((id, off, file, path));
            }
        }
        let r = self.write_and_commit(&todo, &placed, new_bucket);
        let mut g = self.inner.lock();
        match r {
            Ok(locs) => {
                for (it, loc) in todo.iter().zip(locs) {
                    let len = loc.len;
                    let bucket = loc.bucket;
                    if let Some(old) = g.objects.insert(it.generation, loc) {
                        g.live_bytes -= old.len;
                        if let Some(b) = g.buckets.get_mut(&old.bucket) {
                            b.live.remove(&it.generation);
                        }
                    }
                    g.live_bytes += len;
                    if let Some(b) = g.buckets.get_mut(&bucket) {
                        b.live.insert(it.generation);
                    }
                    done.push(it.generation);
                }
                self.counters
                    .bytes_written
                    .fetch_add(need, Ordering::Relaxed);
                self.counters
                    .objects_written
                    .fetch_add(todo.len() as u64, Ordering::Relaxed);
                self.reclaim_empty(&mut g);
                Ok(done)
            }
            Err(e) => {
                self.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                // The reserved tail may hold partial bytes: seal the bucket so nothing appends
                // after garbage; the space leaves with the bucket.
                g.current = None;
                self.reclaim_empty(&mut g);
                Err(e)
            }
        }
    }

    fn write_and_commit(
        &self,
        todo: &[&StoreItem<'_>],
        placed: &[(u64, u64, Arc<File>, PathBuf)],
        new_bucket: bool,
    ) -> Result<Vec<Loc>, OffloadError> {
        let werr = |path: &Path| {
            let path = path.display().to_string();
            move |source| OffloadError::Write { path, source }
        };
        let mut locs = Vec::with_capacity(todo.len());
        for (it, (id, off, file, path)) in todo.iter().zip(placed) {
            let len = it.bytes.len() as u64;
            if let Some(limit) = self.failpoint {
                let before = self.written_since_start.fetch_add(len, Ordering::SeqCst);
                if before + len > limit {
                    // Simulated crash in the middle of a write: part of the object reaches the
                    // file, nothing is fsynced or indexed.
                    let part = (limit.saturating_sub(before) as usize).min(it.bytes.len());
                    let _ = file.write_all_at(&it.bytes[..part], *off);
                    tracing::error!(
                        failpoint = FAILPOINT_CRASH_AFTER_BYTES,
                        "failpoint reached: aborting mid-write"
                    );
                    std::process::abort();
                }
            }
            file.write_all_at(it.bytes, *off).map_err(werr(path))?;
            locs.push(Loc {
                bucket: *id,
                offset: *off,
                len,
                crc: crc32fast::hash(it.bytes),
                key: it.key.to_owned(),
            });
        }
        let mut synced: Vec<u64> = Vec::new();
        for (id, _, file, path) in placed {
            if !synced.contains(id) {
                file.sync_data().map_err(werr(path))?;
                synced.push(*id);
            }
        }
        if new_bucket {
            File::open(&self.cfg.dir)
                .and_then(|d| d.sync_all())
                .map_err(werr(&self.cfg.dir))?;
        }
        let ipath = self.cfg.dir.join(INDEX_FILE);
        let ierr = index_err(&ipath);
        let txn = self.db.begin_write().map_err(|e| ierr(e.to_string()))?;
        {
            let mut t = txn.open_table(OBJECTS).map_err(|e| ierr(e.to_string()))?;
            for (it, loc) in todo.iter().zip(&locs) {
                t.insert(it.generation, loc.encode().as_slice())
                    .map_err(|e| ierr(e.to_string()))?;
            }
        }
        txn.commit().map_err(|e| ierr(e.to_string()))?;
        Ok(locs)
    }

    /// Rewrites sealed buckets that are at least half dead, most dead first, until `want` bytes
    /// were reclaimed or no such bucket is left. The caller holds the writer lock.
    fn compact(&self, want: u64, stop: CompactStop) -> Result<u64, OffloadError> {
        let mut reclaimed = 0;
        let mut tried = HashSet::new();
        while reclaimed < want {
            let pick = {
                let g = self.inner.lock();
                g.buckets
                    .iter()
                    .filter(|(id, _)| g.current != Some(**id) && !tried.contains(*id))
                    .map(|(id, b)| {
                        let live: u64 = b
                            .live
                            .iter()
                            .filter_map(|x| g.objects.get(x))
                            .map(|l| l.len)
                            .sum();
                        (*id, b.size.saturating_sub(live), live)
                    })
                    .filter(|(_, dead, live)| *dead > 0 && *dead >= *live)
                    .max_by_key(|(_, dead, _)| *dead)
                    .map(|(id, _, _)| id)
            };
            let Some(id) = pick else {
                break;
            };
            tried.insert(id);
            reclaimed += self.compact_bucket(id, stop)?;
        }
        Ok(reclaimed)
    }

    /// Rewrites bucket `id` with its live objects only (see the crate docs for the steps and why
    /// a crash at any point loses nothing). Returns the bytes reclaimed.
    fn compact_bucket(&self, id: u64, stop: CompactStop) -> Result<u64, OffloadError> {
        let (old_file, path, old_size, mut live) = {
            let g = self.inner.lock();
            let Some(b) = g.buckets.get(&id) else {
                return Ok(0);
            };
            let live: Vec<(u64, Loc)> = b
                .live
                .iter()
                .filter_map(|x| g.objects.get(x).map(|l| (*x, l.clone())))
                .collect();
            (b.file.clone(), b.path.clone(), b.size, live)
        };
        live.sort_by_key(|(_, l)| l.offset);
        let tmp = compact_path(&self.cfg.dir, id);
        let werr = |p: &Path| {
            let path = p.display().to_string();
            move |source| OffloadError::Write { path, source }
        };
        let new_file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&tmp)
            .map_err(werr(&tmp))?;
        let mut moved: Vec<(u64, Loc, u64)> = Vec::with_capacity(live.len());
        let mut corrupt = Vec::new();
        let mut buf = Vec::new();
        let mut off = 0u64;
        for (gen_, loc) in &live {
            buf.resize(loc.len as usize, 0);
            old_file
                .read_exact_at(&mut buf, loc.offset)
                .map_err(werr(&path))?;
            if crc32fast::hash(&buf) != loc.crc {
                corrupt.push(*gen_);
                continue;
            }
            new_file.write_all_at(&buf, off).map_err(werr(&tmp))?;
            moved.push((*gen_, loc.clone(), off));
            off += loc.len;
        }
        let cleanup = |e: OffloadError| {
            let _ = std::fs::remove_file(&tmp);
            e
        };
        new_file.sync_data().map_err(werr(&tmp)).map_err(cleanup)?;
        if stop == CompactStop::BeforeIndexCommit {
            return Ok(0);
        }
        let ipath = self.cfg.dir.join(INDEX_FILE);
        let ierr = index_err(&ipath);
        let commit = || -> Result<(), OffloadError> {
            let txn = self.db.begin_write().map_err(|e| ierr(e.to_string()))?;
            {
                let mut t = txn.open_table(OBJECTS).map_err(|e| ierr(e.to_string()))?;
                for (gen_, loc, new_off) in &moved {
                    let row = Loc {
                        offset: *new_off,
                        ..loc.clone()
                    };
                    t.insert(*gen_, row.encode().as_slice())
                        .map_err(|e| ierr(e.to_string()))?;
                }
            }
            txn.commit().map_err(|e| ierr(e.to_string()))
        };
        commit().map_err(cleanup)?;
        if stop == CompactStop::BeforeRename {
            return Ok(0);
        }
        // From here on the index points into the new file: finish even if the rename fails
        // (recovery would finish it), and never delete the .compact file.
        std::fs::rename(&tmp, &path).map_err(werr(&path))?;
        File::open(&self.cfg.dir)
            .and_then(|d| d.sync_all())
            .map_err(werr(&self.cfg.dir))?;
        let mut stale = Vec::new();
        {
            let mut g = self.inner.lock();
            for (gen_, loc, new_off) in &moved {
                match g.objects.get_mut(gen_) {
                    Some(l) if l.bucket == id && l.offset == loc.offset => l.offset = *new_off,
                    // Dropped meanwhile: its re-written row must go again.
                    _ => stale.push(*gen_),
                }
            }
            if let Some(b) = g.buckets.get_mut(&id) {
                b.file = Arc::new(new_file);
                b.size = off;
            }
            g.used -= old_size - off;
        }
        if !stale.is_empty() {
            self.unindex(&stale)?;
        }
        if !corrupt.is_empty() {
            self.counters
                .corrupt
                .fetch_add(corrupt.len() as u64, Ordering::Relaxed);
            tracing::error!(bucket = %path.display(), objects = corrupt.len(), "corrupt offloaded objects found while compacting: dropped");
            self.drop_objects(&corrupt, true);
        }
        let reclaimed = old_size - off;
        self.counters.compactions.fetch_add(1, Ordering::Relaxed);
        self.counters
            .compacted_reclaimed
            .fetch_add(reclaimed, Ordering::Relaxed);
        tracing::debug!(
            bucket = id,
            reclaimed,
            live = moved.len(),
            "offload bucket compacted"
        );
        Ok(reclaimed)
    }

    /// Closes the bucket being appended to: the next write starts a new one. A shutdown drain
    /// calls it first, so everything it writes sits after every older object and the size limit
    /// (oldest bucket first) drops those older objects before any drained one.
    pub fn seal(&self) {
        let _w = self.writer.lock();
        let mut g = self.inner.lock();
        g.current = None;
        self.reclaim_empty(&mut g);
    }

    /// Drops whole buckets, oldest first, until `need` more bytes fit under the limit.
    fn make_room(&self, g: &mut Inner, need: u64) -> Result<(), OffloadError> {
        let mut victims = Vec::new();
        let mut used = g.used;
        for (&id, b) in &g.buckets {
            if used + need <= self.cfg.limit_bytes {
                break;
            }
            used -= b.size;
            victims.push(id);
        }
        if victims.is_empty() {
            return Ok(());
        }
        let gens: Vec<u64> = victims
            .iter()
            .filter_map(|id| g.buckets.get(id))
            .flat_map(|b| b.live.iter().copied())
            .collect();
        self.unindex(&gens)?;
        for id in victims {
            if g.current == Some(id) {
                g.current = None;
            }
            if let Some(b) = g.buckets.remove(&id) {
                g.used -= b.size;
                let _ = std::fs::remove_file(&b.path);
            }
        }
        for gen_ in gens {
            if let Some(l) = g.objects.remove(&gen_) {
                g.live_bytes -= l.len;
                g.dropped.push(DiskObject {
                    key: l.key,
                    generation: gen_,
                    size: l.len,
                });
                self.counters.evicted.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Deletes sealed buckets that hold no live object any more.
    fn reclaim_empty(&self, g: &mut Inner) {
        let empty: Vec<u64> = g
            .buckets
            .iter()
            .filter(|(id, b)| b.live.is_empty() && g.current != Some(**id))
            .map(|(id, _)| *id)
            .collect();
        for id in empty {
            if let Some(b) = g.buckets.remove(&id) {
                g.used -= b.size;
                let _ = std::fs::remove_file(&b.path);
            }
        }
    }

    fn unindex(&self, gens: &[u64]) -> Result<(), OffloadError> {
        if gens.is_empty() {
            return Ok(());
        }
        let ipath = self.cfg.dir.join(INDEX_FILE);
        let ierr = index_err(&ipath);
        let txn = self.db.begin_write().map_err(|e| ierr(e.to_string()))?;
        {
            let mut t = txn.open_table(OBJECTS).map_err(|e| ierr(e.to_string()))?;
            for g in gens {
                t.remove(*g).map_err(|e| ierr(e.to_string()))?;
            }
        }
        txn.commit().map_err(|e| ierr(e.to_string()))
    }

    /// Size of a disk object, if present.
    pub fn size_of(&self, generation: u64) -> Option<u64> {
        self.inner.lock().objects.get(&generation).map(|l| l.len)
    }

    /// Reads object `generation` into `dst` (exactly its size) and verifies its checksum. A
    /// corrupt object is dropped from the index and queued for [`Self::take_dropped`].
    pub fn load(&self, generation: u64, dst: &mut [u8]) -> Result<(), LoadError> {
        let (loc, file, path) = {
            let g = self.inner.lock();
            let loc = g
                .objects
                .get(&generation)
                .cloned()
                .ok_or(LoadError::NotFound(generation))?;
            let b = g
                .buckets
                .get(&loc.bucket)
                .ok_or(LoadError::NotFound(generation))?;
            (loc, b.file.clone(), b.path.clone())
        };
        if dst.len() as u64 != loc.len {
            return Err(LoadError::BufferSize {
                need: loc.len,
                have: dst.len() as u64,
            });
        }
        // The Arc keeps the file open even if FIFO deletes the bucket meanwhile.
        file.read_exact_at(dst, loc.offset)
            .map_err(|source| LoadError::Io {
                path: path.display().to_string(),
                source,
            })?;
        let actual = crc32fast::hash(dst);
        if actual != loc.crc {
            self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
            let err = LoadError::Corrupt {
                key: loc.key.clone(),
                generation,
                expected: loc.crc,
                actual,
            };
            tracing::error!(error = %err, bucket = %path.display(), offset = loc.offset, "corrupt offloaded object");
            self.drop_objects(&[generation], true);
            return Err(err);
        }
        self.counters.loads.fetch_add(1, Ordering::Relaxed);
        self.counters
            .bytes_loaded
            .fetch_add(loc.len, Ordering::Relaxed);
        if self.cfg.policy == EvictionPolicy::Lru {
            // Move it to the young end. Best effort: a failure leaves the old copy in place.
            let item = StoreItem {
                key: &loc.key,
                generation,
                bytes: dst,
            };
            if let Err(e) = self.store(&[item], true) {
                tracing::debug!(error = %e, "LRU re-append failed");
            }
        }
        Ok(())
    }

    /// Removes objects (the master removed or replaced them). Unknown generations are ignored.
    pub fn remove(&self, gens: &[u64]) -> Result<(), OffloadError> {
        let _w = self.writer.lock();
        let present: Vec<u64> = {
            let g = self.inner.lock();
            gens.iter()
                .copied()
                .filter(|x| g.objects.contains_key(x))
                .collect()
        };
        self.unindex(&present)?;
        self.drop_objects(&present, false);
        Ok(())
    }

    /// Forgets objects in memory (the index rows are gone or going); `report` queues them for
    /// the master.
    fn drop_objects(&self, gens: &[u64], report: bool) {
        if report {
            let _ = self.unindex(gens);
        }
        let mut g = self.inner.lock();
        for gen_ in gens {
            if let Some(l) = g.objects.remove(gen_) {
                g.live_bytes -= l.len;
                if let Some(b) = g.buckets.get_mut(&l.bucket) {
                    b.live.remove(gen_);
                }
                if report {
                    g.dropped.push(DiskObject {
                        key: l.key,
                        generation: *gen_,
                        size: l.len,
                    });
                }
            }
        }
        self.reclaim_empty(&mut g);
    }

    /// Objects dropped since the last call (size limit, corruption), to tell the master.
    pub fn take_dropped(&self) -> Vec<DiskObject> {
        std::mem::take(&mut self.inner.lock().dropped)
    }

    /// Every object on disk (reported at mount).
    pub fn inventory(&self) -> Vec<DiskObject> {
        let g = self.inner.lock();
        let mut v: Vec<DiskObject> = g
            .objects
            .iter()
            .map(|(gen_, l)| DiskObject {
                key: l.key.clone(),
                generation: *gen_,
                size: l.len,
            })
            .collect();
        v.sort_by_key(|o| o.generation);
        v
    }

    pub fn stats(&self) -> DiskStats {
        let g = self.inner.lock();
        let c = &self.counters;
        DiskStats {
            objects: g.objects.len() as u64,
            live_bytes: g.live_bytes,
            used_bytes: g.used,
            capacity_bytes: self.cfg.limit_bytes,
            bytes_written_total: c.bytes_written.load(Ordering::Relaxed),
            objects_written_total: c.objects_written.load(Ordering::Relaxed),
            loads_total: c.loads.load(Ordering::Relaxed),
            bytes_loaded_total: c.bytes_loaded.load(Ordering::Relaxed),
            evicted_objects_total: c.evicted.load(Ordering::Relaxed),
            corrupt_objects_total: c.corrupt.load(Ordering::Relaxed),
            write_errors_total: c.write_errors.load(Ordering::Relaxed),
            compactions_total: c.compactions.load(Ordering::Relaxed),
            compacted_bytes_total: c.compacted_reclaimed.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests;
