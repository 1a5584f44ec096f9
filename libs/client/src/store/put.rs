//! Writes: the master allocates replicas, the engine copies the bytes, the master commits
//! them (or the reservation is revoked).

use super::*;

impl StoreClient {
    // === puts ===

    pub fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        self.put_parts(key, &[value], &ReplicateConfig::default())
    }

    /// Puts one object made of several pieces (vLLM: one piece per layer), stored contiguously.
    pub fn put_parts(&self, key: &str, parts: &[&[u8]], cfg: &ReplicateConfig) -> Result<()> {
        let mut out = self.batch_put(&[(key, parts.to_vec())], cfg);
        out.pop().unwrap_or(Err(ClientError::Closed))
    }

    /// Puts many objects: one BatchPutStart, all bytes in one transfer batch, one BatchPutEnd.
    pub fn batch_put(
        &self,
        items: &[(&str, Vec<&[u8]>)],
        cfg: &ReplicateConfig,
    ) -> Vec<Result<()>> {
        let _span = op_span("put", items.len()).entered();
        let mut results: Vec<Option<Result<()>>> = (0..items.len()).map(|_| None).collect();
        if self.check_open().is_err() {
            return items.iter().map(|_| Err(ClientError::Closed)).collect();
        }
        // What the master and the owners know the keys as (this client's tenant's); the
        // pieces are borrowed as they are (8192 slices in a vLLM batch: no copy of the list).
        let scoped: Vec<Cow<'_, str>> = items.iter().map(|(k, _)| self.scoped(k)).collect();
        let keys: Vec<&str> = scoped.iter().map(|k| k.as_ref()).collect();
        let parts: Vec<&[&[u8]]> = items.iter().map(|(_, p)| p.as_slice()).collect();
        if let Some(why) = cfg.group_ids_mismatch(items.len()) {
            return items
                .iter()
                .map(|_| Err(ClientError::InvalidParams(why.clone())))
                .collect();
        }
        let mut started = Vec::new();
        let mut pb_items = Vec::new();
        for (i, (key, pieces)) in keys.iter().zip(&parts).enumerate() {
            let size: u64 = pieces.iter().map(|p| p.len() as u64).sum();
            if let Err(e) = self.check_key(key) {
                results[i] = Some(Err(e.into()));
            } else if size == 0 {
                results[i] = Some(Err(ClientError::InvalidParams(format!(
                    "object '{key}' has size 0: store at least one byte"
                ))));
            } else {
                started.push((i, size));
                pb_items.push(pb::PutStartItem {
                    key: (*key).to_owned(),
                    size,
                    group_id: cfg.group_of(i),
                });
            }
        }
        if !pb_items.is_empty() {
            match self.put_start(pb_items, cfg) {
                Err(e) => {
                    let msg = e.to_string();
                    for (i, _) in &started {
                        results[*i] = Some(Err(ClientError::Rpc {
                            addr: self.opts.master_server_address.clone(),
                            message: msg.clone(),
                        }));
                    }
                }
                Ok(resp) => self.finish_puts(&keys, &parts, &started, resp, &mut results),
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or(Err(ClientError::Closed)))
            .collect()
    }

    pub(super) fn finish_puts(
        &self,
        all_keys: &[&str],
        all_parts: &[&[&[u8]]],
        started: &[(usize, u64)],
        placements: pb::BatchPutStartResponse,
        results: &mut [Option<Result<()>>],
    ) {
        // Per started item: its location, and the index range of its write requests.
        let mut locs: Vec<Option<Location>> = Vec::with_capacity(started.len());
        for (j, (i, size)) in started.iter().enumerate() {
            let key = all_keys[*i];
            let loc = match placements.results.get(j) {
                None => Err(self.short_answer(SHORT_ANSWER_ITEMS)),
                Some(p) if p.code != 0 => {
                    Err(ClientError::from_item(key, *size, p.code, &p.message))
                }
                Some(p) => Location::try_from((p, *size, &placements.segments[..])).map_err(|m| {
                    ClientError::Rpc {
                        addr: self.opts.master_server_address.clone(),
                        message: format!("bad placement for '{key}': {m}"),
                    }
                }),
            };
            match loc {
                Ok(l) => locs.push(Some(l)),
                Err(e) => {
                    results[*i] = Some(Err(e));
                    locs.push(None);
                }
            }
        }
        let keys: Vec<&str> = started.iter().map(|(i, _)| all_keys[*i]).collect();
        let parts: Vec<&[&[u8]]> = started.iter().map(|(i, _)| all_parts[*i]).collect();
        for (j, r) in self
            .write_and_publish(&keys, &parts, &mut locs)
            .into_iter()
            .enumerate()
        {
            if let Some(r) = r {
                results[started[j].0] = Some(r);
            }
        }
    }

    /// One BatchPutStart: the master reserves room for each item and answers its placement
    /// (the results, and the segment table they index).
    pub(super) fn put_start(
        &self,
        items: Vec<pb::PutStartItem>,
        cfg: &ReplicateConfig,
    ) -> Result<pb::BatchPutStartResponse> {
        let req = pb::BatchPutStartRequest {
            client_id: self.client_id.clone(),
            items,
            config: Some(self.replicate_config(cfg)),
        };
        self.quick_or_rpc(Method::BatchPutStart, &req, |mut m| {
            let req = req.clone();
            async move { m.batch_put_start(req).await }
        })
    }

    /// Writes object `j` (`parts[j]`) to every replica of `locs[j]` in one transfer batch,
    /// revokes the objects whose transfer failed, and publishes the rest with one BatchPutEnd.
    /// A published object's location moves into the location cache (`locs[j]` becomes None);
    /// a failed one keeps it. One result per object, None where `locs[j]` was None.
    pub(super) fn write_and_publish(
        &self,
        keys: &[&str],
        parts: &[&[&[u8]]],
        locs: &mut [Option<Location>],
    ) -> Vec<Option<Result<()>>> {
        let mut results: Vec<Option<Result<()>>> = (0..keys.len()).map(|_| None).collect();
        let mut reqs = Vec::new();
        let mut owner = Vec::new();
        for (j, key) in keys.iter().enumerate() {
            let Some(loc) = &locs[j] else { continue };
            for r in &loc.replicas {
                reqs.push(TransferRequest::Write {
                    target: &r.target,
                    generation: loc.generation,
                    key,
                    offset: r.offset,
                    src: parts[j].to_vec(),
                });
                owner.push(j);
            }
        }
        let outcomes = if reqs.len() == 1 {
            vec![self.engine.execute(&mut reqs[0])]
        } else {
            self.engine.batch(&mut reqs)
        };
        drop(reqs);
        let mut failed: Vec<Option<TransferError>> = (0..keys.len()).map(|_| None).collect();
        for (k, r) in outcomes.into_iter().enumerate() {
            if let Err(e) = r {
                failed[owner[k]].get_or_insert(e);
            }
        }
        let mut end_keys = Vec::new();
        let mut end_idx = Vec::new();
        let mut revoke_keys = Vec::new();
        for (j, key) in keys.iter().enumerate() {
            if locs[j].is_none() {
                continue;
            }
            match failed[j].take() {
                Some(e) => {
                    revoke_keys.push((*key).to_owned());
                    results[j] = Some(Err(ClientError::Transfer {
                        key: (*key).to_owned(),
                        source: e,
                    }));
                }
                None => {
                    end_keys.push((*key).to_owned());
                    end_idx.push(j);
                }
            }
        }
        if !revoke_keys.is_empty() {
            let req = pb::BatchKeysRequest {
                client_id: self.client_id.clone(),
                keys: revoke_keys,
            };
            // Best effort: a put never ended is reclaimed by the master's discard timeout anyway.
            if let Err(e) = self.rpc(|mut m| {
                let req = req.clone();
                async move { m.batch_put_revoke(req).await }
            }) {
                tracing::warn!(error = %e, "put revoke failed; the master reclaims the space after its discard timeout");
            }
        }
        if end_keys.is_empty() {
            return results;
        }
        let req = pb::BatchKeysRequest {
            client_id: self.client_id.clone(),
            keys: end_keys,
        };
        // Keys whose PutEnd did not succeed are revoked: a put is either published or
        // abandoned, never left half-visible. After an HA failover the new leader may not know
        // the put at all (its PutEnd fails with "not found"); the revoke is then a no-op and the
        // bytes at the owner stay unpublished until the space is reused.
        let mut unpublished = Vec::new();
        match self.quick_or_rpc(Method::BatchPutEnd, &req, |mut m| {
            let req = req.clone();
            async move { m.batch_put_end(req).await }
        }) {
            Err(e) => {
                let msg = e.to_string();
                for j in end_idx {
                    unpublished.push(keys[j].to_owned());
                    results[j] = Some(Err(ClientError::Rpc {
                        addr: self.opts.master_server_address.clone(),
                        message: msg.clone(),
                    }));
                }
            }
            Ok(resp) => {
                for (n, j) in end_idx.into_iter().enumerate() {
                    let key = keys[j];
                    let size = locs[j].as_ref().map_or(0, |l| l.size);
                    let r = match resp.results.get(n) {
                        Some(r) if r.code == 0 => {
                            if let Some(loc) = locs[j].take() {
                                self.cache.insert(key, loc);
                            }
                            Ok(())
                        }
                        Some(r) => Err(ClientError::from_item(key, size, r.code, &r.message)),
                        None => Err(self.short_answer(SHORT_ANSWER_ITEMS)),
                    };
                    if r.is_err() {
                        unpublished.push(key.to_owned());
                    }
                    results[j] = Some(r);
                }
            }
        }
        if !unpublished.is_empty() && self.master.is_ha() {
            let req = pb::BatchKeysRequest {
                client_id: self.client_id.clone(),
                keys: unpublished,
            };
            if let Err(e) = self.rpc(|mut m| {
                let req = req.clone();
                async move { m.batch_put_revoke(req).await }
            }) {
                tracing::warn!(error = %e, "revoking unpublished puts failed; the master reclaims them after its discard timeout");
            }
        }
        results
    }
}
