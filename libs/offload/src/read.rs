//! The read path (CRC-checked loads, dropped objects reported) and what the tier reports:
//! inventory and stats.

use super::*;

impl DiskTier {
    pub fn config(&self) -> &OffloadConfig {
        &self.cfg
    }

    /// Size of a disk object, if present.
    pub fn size_of(&self, generation: u64) -> Option<u64> {
        self.inner.lock().objects.get(&generation).map(|l| l.len)
    }

    /// The placement proof stored with object `generation`, if any.
    pub fn proof_of(&self, generation: u64) -> Option<[u8; PROOF_LEN]> {
        self.inner.lock().objects.get(&generation)?.proof
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
        if self.cfg.policy == EvictionPolicy::Clock {
            let mut g = self.inner.lock();
            // Only while it is still this object: a drop meanwhile must not leave a mark.
            if g.objects.contains_key(&generation) {
                g.referenced.insert(generation);
            }
        }
        if self.cfg.policy == EvictionPolicy::Lru {
            // Move it to the young end. Best effort: a failure leaves the old copy in place.
            let item = StoreItem {
                key: &loc.key,
                generation,
                bytes: dst,
                proof: loc.proof,
            };
            if let Err(e) = self.store(&[item], true) {
                tracing::debug!(error = %e, "LRU re-append failed");
            }
        }
        Ok(())
    }

    /// Forgets objects in memory (the index rows are gone or going); `report` queues them for
    /// the master.
    pub(crate) fn drop_objects(&self, gens: &[u64], report: bool) {
        if report {
            let _ = self.unindex(gens);
        }
        let mut g = self.inner.lock();
        for gen_ in gens {
            g.referenced.remove(gen_);
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
                        proof: l.proof,
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
                proof: l.proof,
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
            second_chances_total: c.second_chances.load(Ordering::Relaxed),
        }
    }
}
