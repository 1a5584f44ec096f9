//! Compaction: sealed buckets that are mostly dead space rewritten in place, crash-safe
//! (the crate docs give the three steps).

use super::*;

impl DiskTier {
    /// Rewrites sealed buckets that are at least half dead, most dead first, until `want` bytes
    /// were reclaimed or no such bucket is left. The caller holds the writer lock.
    pub(crate) fn compact(&self, want: u64, stop: CompactStop) -> Result<u64, OffloadError> {
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
    pub(crate) fn compact_bucket(&self, id: u64, stop: CompactStop) -> Result<u64, OffloadError> {
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
}
