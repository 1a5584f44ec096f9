//! Opening a tier: the index is checked against the bucket files, torn tails and
//! unfinished compactions are resolved (the crate docs say how).

use super::*;

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
        #[cfg(feature = "failpoints")]
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
                #[cfg(feature = "failpoints")]
                failpoint,
                #[cfg(feature = "failpoints")]
                written_since_start: AtomicU64::new(0),
            },
            report,
        ))
    }

    pub(crate) fn read_rows(
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
    pub(crate) fn compaction_committed(tmp: &Path, id: u64, rows: &[(u64, Option<Loc>)]) -> bool {
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
}
