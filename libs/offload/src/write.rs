//! The write path: batches appended to buckets, fdatasynced, then indexed in one
//! transaction; room made by compaction or by dropping the oldest buckets.

use super::*;

impl DiskTier {
    /// Writes the objects durably (see the crate docs for the order of writes and fsyncs).
    /// Returns the generations now on disk, in input order; objects already on disk count as
    /// stored. An error means none of the batch was indexed.
    /// Objects the size limit drops to make room are queued for [`Self::take_dropped`].
    pub fn store_batch(&self, items: &[StoreItem<'_>]) -> Result<Vec<u64>, OffloadError> {
        self.store(items, false)
    }

    /// As [`Self::store_batch`], but the objects dropped to make room for this batch are
    /// returned rather than queued for [`Self::take_dropped`]: the caller (the owner's OFFLOAD)
    /// tells the master in its answer, so the master never calls them present meanwhile. On an
    /// error they are queued as usual, since the caller then has no answer to carry them in.
    pub fn store_batch_reporting(&self, items: &[StoreItem<'_>]) -> Result<Stored, OffloadError> {
        let mut dropped = Vec::new();
        match self.store_inner(items, false, &mut dropped) {
            Ok(stored) => Ok(Stored { stored, dropped }),
            Err(e) => {
                self.requeue_dropped(dropped);
                Err(e)
            }
        }
    }

    /// Queues drops a caller could not deliver (its answer was lost) for
    /// [`Self::take_dropped`], so the master still learns of them on the next Ping.
    pub fn requeue_dropped(&self, dropped: Vec<DiskObject>) {
        if !dropped.is_empty() {
            self.inner.lock().dropped.extend(dropped);
        }
    }

    pub(crate) fn store(
        &self,
        items: &[StoreItem<'_>],
        relocate: bool,
    ) -> Result<Vec<u64>, OffloadError> {
        let mut dropped = Vec::new();
        let r = self.store_inner(items, relocate, &mut dropped);
        self.requeue_dropped(dropped);
        r
    }

    /// Stores the batch; objects dropped to make room are appended to `dropped` (also when an
    /// error follows: they are gone from the index either way).
    fn store_inner(
        &self,
        items: &[StoreItem<'_>],
        relocate: bool,
        dropped: &mut Vec<DiskObject>,
    ) -> Result<Vec<u64>, OffloadError> {
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
        let mut need: u64 = todo.iter().map(|t| t.bytes.len() as u64).sum();
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
        // Second chances: the marked objects of the buckets this batch would drop go with it.
        let carried = if self.cfg.policy == EvictionPolicy::Clock && !relocate {
            self.second_chances(need)
        } else {
            Vec::new()
        };
        let carried_items: Vec<StoreItem<'_>> = carried
            .iter()
            .map(|c| StoreItem {
                key: &c.key,
                generation: c.generation,
                bytes: &c.bytes,
                proof: c.proof,
            })
            .collect();
        let keep: HashSet<u64> = carried.iter().map(|c| c.generation).collect();
        need += carried.iter().map(|c| c.bytes.len() as u64).sum::<u64>();
        let batch_len = todo.len();
        let todo: Vec<&StoreItem<'_>> = todo.into_iter().chain(&carried_items).collect();
        // Reserve: room under the limit, then a (bucket, offset) per object.
        let mut placed: Vec<(u64, u64, Arc<File>, PathBuf)> = Vec::with_capacity(todo.len());
        let mut new_bucket = false;
        {
            let mut g = self.inner.lock();
            dropped.extend(self.make_room(&mut g, need.min(self.cfg.limit_bytes), &keep)?);
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
                for (i, (it, loc)) in todo.iter().zip(locs).enumerate() {
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
                    // The carried ones (after the batch) were not the caller's.
                    if i < batch_len {
                        done.push(it.generation);
                    }
                }
                self.counters
                    .bytes_written
                    .fetch_add(need, Ordering::Relaxed);
                self.counters
                    .objects_written
                    .fetch_add(todo.len() as u64, Ordering::Relaxed);
                self.counters
                    .second_chances
                    .fetch_add(carried.len() as u64, Ordering::Relaxed);
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

    pub(crate) fn write_and_commit(
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
            #[cfg(feature = "failpoints")]
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
                proof: it.proof,
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

    /// Closes the bucket being appended to: the next write starts a new one. A shutdown drain
    /// calls it first, so everything it writes sits after every older object and the size limit
    /// (oldest bucket first) drops those older objects before any drained one.
    pub fn seal(&self) {
        let _w = self.writer.lock();
        let mut g = self.inner.lock();
        g.current = None;
        self.reclaim_empty(&mut g);
    }

    /// [`EvictionPolicy::Clock`]: the marked live objects of the buckets that room for `need`
    /// more bytes would drop, read back (CRC-checked) with their marks cleared. At most a
    /// quarter of the limit per batch, so a round always frees room; past that, marked objects
    /// go with their bucket. Runs under the writer lock: no bucket can go meanwhile.
    fn second_chances(&self, need: u64) -> Vec<Carried> {
        let budget = self.cfg.limit_bytes / 4;
        let mut picked: Vec<(u64, Loc, Arc<File>)> = Vec::new();
        {
            let mut g = self.inner.lock();
            let g = &mut *g;
            let mut used = g.used;
            let mut carried = 0u64;
            for b in g.buckets.values() {
                if used + need + carried <= self.cfg.limit_bytes {
                    break;
                }
                used -= b.size;
                for gen_ in &b.live {
                    if !g.referenced.contains(gen_) {
                        continue;
                    }
                    let Some(loc) = g.objects.get(gen_) else {
                        continue;
                    };
                    if carried + loc.len > budget {
                        continue;
                    }
                    carried += loc.len;
                    picked.push((*gen_, loc.clone(), b.file.clone()));
                }
            }
            for (gen_, _, _) in &picked {
                g.referenced.remove(gen_);
            }
        }
        let mut out = Vec::with_capacity(picked.len());
        for (generation, loc, file) in picked {
            let mut bytes = vec![0u8; loc.len as usize];
            // A failed or corrupt read just loses the second chance; the object goes with its
            // bucket and is reported as any drop.
            if file.read_exact_at(&mut bytes, loc.offset).is_err()
                || crc32fast::hash(&bytes) != loc.crc
            {
                continue;
            }
            out.push(Carried {
                generation,
                key: loc.key,
                proof: loc.proof,
                bytes,
            });
        }
        out
    }

    /// Drops whole buckets, oldest first, until `need` more bytes fit under the limit. Returns
    /// the live objects dropped with them; the caller decides how the master learns of them.
    /// Objects in `keep` (second chances being rewritten) stay indexed and readable in their
    /// old bucket, whose space already counts as free, until their new copy replaces them.
    pub(crate) fn make_room(
        &self,
        g: &mut Inner,
        need: u64,
        keep: &HashSet<u64>,
    ) -> Result<Vec<DiskObject>, OffloadError> {
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
            return Ok(Vec::new());
        }
        let gens: Vec<u64> = victims
            .iter()
            .filter_map(|id| g.buckets.get(id))
            .flat_map(|b| b.live.iter().copied())
            .filter(|gen_| !keep.contains(gen_))
            .collect();
        self.unindex(&gens)?;
        for id in victims {
            if g.current == Some(id) {
                g.current = None;
            }
            let Some(b) = g.buckets.get_mut(&id) else {
                continue;
            };
            if b.live.iter().any(|gen_| keep.contains(gen_)) {
                // Its bytes no longer count; it goes once the kept objects have moved out
                // (reclaim_empty), so a read meanwhile still finds them.
                g.used -= b.size;
                b.size = 0;
                b.live.retain(|gen_| keep.contains(gen_));
            } else if let Some(b) = g.buckets.remove(&id) {
                g.used -= b.size;
                let _ = std::fs::remove_file(&b.path);
            }
        }
        let mut dropped = Vec::with_capacity(gens.len());
        for gen_ in gens {
            g.referenced.remove(&gen_);
            if let Some(l) = g.objects.remove(&gen_) {
                g.live_bytes -= l.len;
                dropped.push(DiskObject {
                    key: l.key,
                    generation: gen_,
                    size: l.len,
                    proof: l.proof,
                });
                self.counters.evicted.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(dropped)
    }

    /// Deletes sealed buckets that hold no live object any more.
    pub(crate) fn reclaim_empty(&self, g: &mut Inner) {
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

    pub(crate) fn unindex(&self, gens: &[u64]) -> Result<(), OffloadError> {
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
}

/// An object given a second chance: its bytes, read back from the bucket about to go.
struct Carried {
    generation: u64,
    key: String,
    proof: Option<[u8; PROOF_LEN]>,
    bytes: Vec<u8>,
}
