//! Reads and lookups: locations from the cache or the master, bytes from the preferred
//! replica, another replica or a fresh location when one is stale.

use lunakv_proto::views::ReplicaDesc;

use super::*;

impl StoreClient {
    // === gets ===

    /// Returns the object's bytes.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let _span = op_span("get", 1).entered();
        self.check_open()?;
        let key = &*self.scoped(key);
        self.check_key(key)?;
        for attempt in 0..READ_ATTEMPTS {
            let loc = self.resolve(key, attempt > 0)?;
            let mut buf = vec![0u8; loc.size as usize];
            match self.read_replicas(key, &loc, &mut [&mut buf[..]]) {
                Ok(()) => return Ok(buf),
                Err(ReadError::Stale) => continue,
                // A cached location may name an owner that is gone: ask the master once.
                Err(ReadError::Failed(_)) if attempt == 0 => continue,
                Err(ReadError::Failed(e)) => return Err(e),
            }
        }
        Err(ClientError::ObjectNotFound(key.to_owned()))
    }

    /// Reads the object into `buf` (no intermediate copy) and returns its size.
    pub fn get_into(&self, key: &str, buf: &mut [u8]) -> Result<u64> {
        self.get_into_parts(key, &mut [buf])
    }

    /// Reads the object into several buffers in order (vLLM: one per layer). Their total length
    /// must be at least the object's size.
    pub fn get_into_parts(&self, key: &str, dst: &mut [&mut [u8]]) -> Result<u64> {
        let _span = op_span("get", 1).entered();
        self.check_open()?;
        let key = &*self.scoped(key);
        self.check_key(key)?;
        self.read_into_parts(key, dst)
    }

    /// [`Self::get_into_parts`] of a key already scoped and checked.
    fn read_into_parts(&self, key: &str, dst: &mut [&mut [u8]]) -> Result<u64> {
        for attempt in 0..READ_ATTEMPTS {
            let loc = self.resolve(key, attempt > 0)?;
            let have: u64 = dst.iter().map(|d| d.len() as u64).sum();
            let mut trimmed = trim(dst, loc.size).ok_or_else(|| ClientError::BufferTooSmall {
                key: key.to_owned(),
                need: loc.size,
                have,
            })?;
            match self.read_replicas(key, &loc, &mut trimmed) {
                Ok(()) => return Ok(loc.size),
                Err(ReadError::Stale) => continue,
                Err(ReadError::Failed(_)) if attempt == 0 => continue,
                Err(ReadError::Failed(e)) => return Err(e),
            }
        }
        Err(ClientError::ObjectNotFound(key.to_owned()))
    }

    /// Gets many objects into caller buffers; one master round trip for the keys not cached,
    /// then one transfer batch.
    pub fn batch_get_into(&self, keys: &[&str], dsts: &mut [Vec<&mut [u8]>]) -> Vec<Result<u64>> {
        assert_eq!(keys.len(), dsts.len(), "one destination list per key");
        let _span = op_span("batch_get", keys.len()).entered();
        let mut results: Vec<Option<Result<u64>>> = (0..keys.len()).map(|_| None).collect();
        if self.check_open().is_err() {
            return keys.iter().map(|_| Err(ClientError::Closed)).collect();
        }
        let scoped: Vec<Cow<'_, str>> = keys.iter().map(|k| self.scoped(k)).collect();
        let keys: Vec<&str> = scoped.iter().map(|k| k.as_ref()).collect();
        let keys = &keys[..];
        let mut locs: Vec<Option<Arc<Location>>> = vec![None; keys.len()];
        let mut misses = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            if let Err(e) = self.check_key(key) {
                results[i] = Some(Err(e.into()));
                continue;
            }
            match self.cache.get(key) {
                Some(l) => locs[i] = Some(l),
                None => misses.push(i),
            }
        }
        self.lookup_many(keys, &misses, &mut locs, &mut results);

        // One transfer batch over the first replica of each object; anything that fails
        // (stale, owner gone) goes through the single-object path, which refreshes and tries
        // the other replicas.
        let mut retry = Vec::new();
        {
            let mut reqs = Vec::new();
            let mut idx = Vec::new();
            for (i, dst) in dsts.iter_mut().enumerate() {
                if results[i].is_some() {
                    continue;
                }
                let Some(loc) = &locs[i] else { continue };
                let have: u64 = dst.iter().map(|d| d.len() as u64).sum();
                let Some(trimmed) = trim(dst, loc.size) else {
                    results[i] = Some(Err(ClientError::BufferTooSmall {
                        key: keys[i].to_owned(),
                        need: loc.size,
                        have,
                    }));
                    continue;
                };
                let r = &loc.replicas[self.preferred_replica(loc)];
                if r.disk {
                    // Disk-only: the single-object path asks the owner to LOAD it.
                    retry.push(i);
                    continue;
                }
                reqs.push(TransferRequest::Read {
                    target: &r.target,
                    generation: loc.generation,
                    offset: r.offset,
                    dst: trimmed,
                });
                idx.push(i);
            }
            let outcomes = self.engine.batch(&mut reqs);
            for (n, r) in outcomes.into_iter().enumerate() {
                let i = idx[n];
                let loc = locs[i].as_ref().map(|l| (l.generation, l.size));
                match (r, loc) {
                    (Ok(()), Some((_, size))) => results[i] = Some(Ok(size)),
                    (Err(_), Some((generation, _))) => {
                        self.cache.invalidate(keys[i], Some(generation));
                        retry.push(i);
                    }
                    _ => retry.push(i),
                }
            }
        }
        for i in retry {
            results[i] = Some(self.read_into_parts(keys[i], &mut dsts[i]));
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or(Err(ClientError::Closed)))
            .collect()
    }

    /// Gets many objects as owned bytes.
    pub fn batch_get(&self, keys: &[&str]) -> Vec<Result<Vec<u8>>> {
        keys.iter().map(|k| self.get(k)).collect()
    }

    pub(super) fn lookup_many(
        &self,
        keys: &[&str],
        misses: &[usize],
        locs: &mut [Option<Arc<Location>>],
        results: &mut [Option<Result<u64>>],
    ) {
        if misses.is_empty() {
            return;
        }
        let req = pb::BatchGetReplicaListRequest {
            client_id: self.client_id.clone(),
            keys: misses.iter().map(|&i| keys[i].to_owned()).collect(),
        };
        // A quick call, on this thread: a get that misses the location cache wakes no other.
        match self.quick_or_rpc(Method::BatchGetReplicaList, &req, |mut m| {
            let req = req.clone();
            async move { m.batch_get_replica_list(req).await }
        }) {
            Err(e) => {
                let msg = e.to_string();
                for &i in misses {
                    results[i] = Some(Err(ClientError::Rpc {
                        addr: self.opts.master_server_address.clone(),
                        message: msg.clone(),
                    }));
                }
            }
            Ok(resp) => {
                for (n, &i) in misses.iter().enumerate() {
                    match resp
                        .results
                        .get(n)
                        .map(|l| self.accept_location(keys[i], l, &resp.segments))
                    {
                        Some(Ok(l)) => locs[i] = Some(l),
                        Some(Err(e)) => results[i] = Some(Err(e)),
                        None => results[i] = Some(Err(self.short_answer(SHORT_ANSWER_KEYS))),
                    }
                }
            }
        }
    }

    /// The cached location, or the master's answer (which is then cached).
    pub(super) fn resolve(&self, key: &str, refresh: bool) -> Result<Arc<Location>> {
        if !refresh && let Some(l) = self.cache.get(key) {
            return Ok(l);
        }
        let req = pb::GetReplicaListRequest {
            client_id: self.client_id.clone(),
            key: key.to_owned(),
        };
        let resp = self.rpc(|mut m| {
            let req = req.clone();
            async move { m.get_replica_list(req).await }
        })?;
        self.accept_location(key, &resp, &[])
    }

    /// `batch` is the segment table of the batch answer `l` came in (empty for a single one).
    pub(super) fn accept_location(
        &self,
        key: &str,
        l: &pb::ObjectLocation,
        batch: &[pb::SegmentDescriptor],
    ) -> Result<Arc<Location>> {
        if l.code != 0 {
            self.cache.invalidate(key, None);
            return Err(ClientError::from_item(key, l.size, l.code, &l.message));
        }
        let loc = Location::try_from((l, batch)).map_err(|m| ClientError::Rpc {
            addr: self.opts.master_server_address.clone(),
            message: format!("bad location for '{key}': {m}"),
        })?;
        self.cache.insert(key, loc);
        self.cache
            .get(key)
            .ok_or_else(|| ClientError::ObjectNotFound(key.to_owned()))
    }

    /// Our own segment first (a plain memcpy), then same-host replicas (memcpy + a round trip).
    pub(super) fn preferred_replica(&self, loc: &Location) -> usize {
        let find = |f: &dyn Fn(&lunakv_transfer::Target) -> bool| {
            loc.replicas.iter().position(|r| !r.disk && f(&r.target))
        };
        find(&|t| self.engine.is_local(t))
            .or_else(|| find(&|t| self.engine.uses_shm(t)))
            .unwrap_or(0)
    }

    pub(super) fn read_replicas(
        &self,
        key: &str,
        loc: &Location,
        dst: &mut [&mut [u8]],
    ) -> std::result::Result<(), ReadError> {
        let first = self.preferred_replica(loc);
        let order = std::iter::once(first).chain((0..loc.replicas.len()).filter(|&i| i != first));
        let mut last = None;
        let mut stale = false;
        for i in order {
            let r = &loc.replicas[i];
            let got = if r.disk {
                self.engine.load(&r.target, loc.generation, dst)
            } else {
                self.engine.read(&r.target, loc.generation, r.offset, dst)
            };
            match got {
                Ok(()) => return Ok(()),
                Err(TransferError::Stale { .. }) => stale = true,
                Err(e) => {
                    tracing::debug!(key, replica = %r.segment_name, error = %e, "replica read failed; trying the next");
                    last = Some(e);
                }
            }
        }
        self.cache.invalidate(key, Some(loc.generation));
        match last {
            Some(e) if !stale => Err(ReadError::Failed(ClientError::Transfer {
                key: key.to_owned(),
                source: e,
            })),
            _ => Err(ReadError::Stale),
        }
    }

    // === metadata ===

    pub fn exists(&self, key: &str) -> Result<bool> {
        self.batch_exists(&[key])
            .pop()
            .unwrap_or(Err(ClientError::Closed))
    }

    /// Like upstream, existence grants a lease; the answer also warms the location cache so the
    /// get that usually follows skips the master.
    pub fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool>> {
        self.per_key(
            keys,
            |keys| {
                let req = pb::BatchExistKeyRequest {
                    client_id: self.client_id.clone(),
                    keys,
                };
                self.quick_or_rpc(Method::BatchExistKey, &req, |mut m| {
                    let req = req.clone();
                    async move { m.batch_exist_key(req).await }
                })
                .map(|r| (r.results, r.segments))
            },
            |key, l, segments| match ErrorCode::from_i32(l.code) {
                ErrorCode::Ok => {
                    if let Ok(loc) = Location::try_from((l, &segments[..])) {
                        self.cache.insert(key, loc);
                    }
                    Ok(true)
                }
                ErrorCode::ObjectNotFound => {
                    self.cache.invalidate(key, None);
                    Ok(false)
                }
                _ => Err(ClientError::from_item(key, 0, l.code, &l.message)),
            },
        )
    }

    /// One BatchGetReplicaList for `keys`: the locations, and the segment table they index.
    pub(super) fn batch_locations(
        &self,
        keys: Vec<String>,
    ) -> Result<(Vec<pb::ObjectLocation>, Vec<pb::SegmentDescriptor>)> {
        let req = pb::BatchGetReplicaListRequest {
            client_id: self.client_id.clone(),
            keys,
        };
        self.quick_or_rpc(Method::BatchGetReplicaList, &req, |mut m| {
            let req = req.clone();
            async move { m.batch_get_replica_list(req).await }
        })
        .map(|r| (r.results, r.segments))
    }

    /// The shape of every per-key batch call: invalid keys fail alone, the valid ones go to the
    /// master in one `call`, and each answer is mapped by `each`, with what the call answered
    /// for all of them (`S`: a segment table, or nothing). A failed call fails every key it
    /// carried; a short answer fails the keys it left out.
    pub(super) fn per_key<T, R, S>(
        &self,
        keys: &[&str],
        call: impl FnOnce(Vec<String>) -> Result<(Vec<R>, S)>,
        each: impl Fn(&str, &R, &S) -> Result<T>,
    ) -> Vec<Result<T>> {
        if self.check_open().is_err() {
            return keys.iter().map(|_| Err(ClientError::Closed)).collect();
        }
        let scoped: Vec<Cow<'_, str>> = keys.iter().map(|k| self.scoped(k)).collect();
        let keys: Vec<&str> = scoped.iter().map(|k| k.as_ref()).collect();
        let mut out: Vec<Option<Result<T>>> = (0..keys.len()).map(|_| None).collect();
        let mut ask = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            match self.check_key(k) {
                Ok(()) => ask.push(i),
                Err(e) => out[i] = Some(Err(e.into())),
            }
        }
        if !ask.is_empty() {
            let rpc_fail = |message: String| ClientError::Rpc {
                addr: self.opts.master_server_address.clone(),
                message,
            };
            match call(ask.iter().map(|&i| keys[i].to_owned()).collect()) {
                Err(e) => {
                    let msg = e.to_string();
                    for &i in &ask {
                        out[i] = Some(Err(rpc_fail(msg.clone())));
                    }
                }
                Ok((results, shared)) => {
                    for (n, &i) in ask.iter().enumerate() {
                        out[i] = Some(match results.get(n) {
                            Some(r) => each(keys[i], r, &shared),
                            None => Err(rpc_fail(SHORT_ANSWER_KEYS.to_owned())),
                        });
                    }
                }
            }
        }
        out.into_iter()
            .map(|r| r.unwrap_or(Err(ClientError::Closed)))
            .collect()
    }

    /// Every replica of each object as the master reports it, disk tiers included
    /// ([`Location`] keeps memory replicas only). One master round trip; backs the Python
    /// `batch_get_replica_desc`, which vLLM probes for the tier an object lives in.
    pub fn batch_replicas(&self, keys: &[&str]) -> Vec<Result<Vec<ReplicaDesc>>> {
        self.per_key(
            keys,
            |keys| self.batch_locations(keys),
            |key, l, batch| match l.code {
                0 => {
                    let segments = lunakv_master_client::segment_table(&l.segments, batch);
                    Ok(l.replicas
                        .iter()
                        .map(|r| ReplicaDesc::from((r, segments)))
                        .collect())
                }
                code => Err(ClientError::from_item(key, l.size, code, &l.message)),
            },
        )
    }

    /// The object's size in bytes (asks the master: sizes are cheap and must not be stale).
    pub fn get_size(&self, key: &str) -> Result<u64> {
        self.check_open()?;
        let key = &*self.scoped(key);
        self.check_key(key)?;
        let req = pb::ExistKeyRequest {
            client_id: self.client_id.clone(),
            key: key.to_owned(),
        };
        let l = self.rpc(|mut m| {
            let req = req.clone();
            async move { m.exist_key(req).await }
        })?;
        if l.code != 0 {
            return Err(ClientError::from_item(key, 0, l.code, &l.message));
        }
        Ok(l.size)
    }
}
