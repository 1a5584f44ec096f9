//! Removal, caller buffers, closing, and the cluster views (status, namespace stats,
//! offload).

use lunakv_proto::views::{ClusterStatus, NamespaceReport};

use super::*;

impl StoreClient {
    pub fn remove(&self, key: &str, force: bool) -> Result<()> {
        self.batch_remove(&[key], force)
            .pop()
            .unwrap_or(Err(ClientError::Closed))
    }

    pub fn batch_remove(&self, keys: &[&str], force: bool) -> Vec<Result<()>> {
        for k in keys {
            self.cache.invalidate(&self.scoped(k), None);
        }
        self.per_key(
            keys,
            |keys| {
                let req = pb::BatchRemoveRequest {
                    client_id: self.client_id.clone(),
                    keys,
                    force,
                };
                self.rpc(|mut m| {
                    let req = req.clone();
                    async move { m.batch_remove(req).await }
                })
                .map(|r| (r.results, ()))
            },
            |key, r, ()| match r.code {
                0 => Ok(()),
                code => Err(ClientError::from_item(key, 0, code, &r.message)),
            },
        )
    }

    /// Upstream's upsert, before a put of the same keys: each key's current object is removed,
    /// so the put that follows places a new version. A missing key is fine; so is one another
    /// put has in progress (its removal is refused as not ready, and the put that follows then
    /// answers `OBJECT_ALREADY_EXISTS`, as any put of it would). A reader's lease
    /// does not block it: readers of the old version keep their owner-side pins until they are
    /// done, and a read after it finds the new version or a miss, never a mix (generations).
    pub fn prepare_upsert(&self, keys: &[&str]) -> Vec<Result<()>> {
        let first = self.batch_remove(keys, false);
        let leased: Vec<&str> = keys
            .iter()
            .zip(&first)
            .filter(|(_, r)| matches!(r, Err(e) if e.code() == ErrorCode::ObjectHasLease))
            .map(|(k, _)| *k)
            .collect();
        let mut forced = self.batch_remove(&leased, true).into_iter();
        first
            .into_iter()
            .map(|r| match r {
                Ok(()) => Ok(()),
                Err(e) if e.code() == ErrorCode::ObjectNotFound => Ok(()),
                Err(e) if e.code() == ErrorCode::ObjectHasLease => forced
                    .next()
                    .unwrap_or(Err(ClientError::Closed))
                    .or_else(|e| match e.code() {
                        ErrorCode::ObjectNotFound => Ok(()),
                        _ => Err(e),
                    }),
                Err(e) => Err(e),
            })
            .collect()
    }

    /// Removes every object of this client's tenant (leased ones too when `force`); returns
    /// how many were removed. Other tenants' objects stay.
    pub fn remove_all(&self, force: bool) -> Result<u64> {
        self.check_open()?;
        self.cache.clear();
        let req = pb::RemoveAllRequest {
            client_id: self.client_id.clone(),
            force,
            tenant_id: self.opts.tenant_id.clone(),
        };
        let r = self.rpc(|mut m| {
            let req = req.clone();
            async move { m.remove_all(req).await }
        })?;
        if r.code != 0 {
            return Err(ClientError::from_item("*", 0, r.code, &r.message));
        }
        Ok(r.removed)
    }

    /// Upstream's RemoveByRegex: removes every object of this client's tenant whose key
    /// matches `regex` (Rust regex syntax), leased and in-progress ones too when `force`;
    /// returns how many. Needs the admin token where the master has one, as RemoveAll does.
    pub fn remove_by_regex(&self, regex: &str, force: bool) -> Result<u64> {
        self.check_open()?;
        self.cache.clear();
        let req = pb::RemoveByRegexRequest {
            client_id: self.client_id.clone(),
            regex: regex.to_owned(),
            force,
            tenant_id: self.opts.tenant_id.clone(),
        };
        let r = self.rpc(|mut m| {
            let req = req.clone();
            async move { m.remove_by_regex(req).await }
        })?;
        if r.code != 0 {
            return Err(ClientError::from_item(regex, 0, r.code, &r.message));
        }
        Ok(r.removed)
    }

    /// Records a caller buffer that transfers will use. tcp and shm need no registration; it is
    /// kept so misuse (overlaps, unknown buffers) is reported the same way RDMA will need. A GPU
    /// buffer (vLLM registers its CUDA KV cache) is classified here once, so pieces inside it
    /// are copied by DMA without a driver call per piece (docs/GPU.md). Buffers given to
    /// `put_parts` / `get_into_parts` / `batch_*` may be device memory whether registered or not.
    pub fn register_buffer(&self, ptr: usize, len: usize) -> Result<()> {
        if ptr == 0 || len == 0 {
            return Err(ClientError::InvalidParams(format!(
                "register_buffer(ptr={ptr:#x}, size={len}): pointer and size must be non-zero"
            )));
        }
        let mut b = self.buffers.lock();
        let end = ptr.checked_add(len).ok_or_else(|| {
            ClientError::InvalidParams(format!(
                "register_buffer(ptr={ptr:#x}, size={len}) wraps the address space"
            ))
        })?;
        if let Some((&p, &l)) = b.range(..end).next_back()
            && p + l > ptr
        {
            return Err(ClientError::InvalidParams(format!(
                "buffer {ptr:#x}+{len} overlaps the registered buffer {p:#x}+{l}: unregister it first"
            )));
        }
        b.insert(ptr, len);
        let kind = lunakv_transfer::device::register_range(ptr, len);
        tracing::debug!(ptr, len, ?kind, "buffer registered");
        Ok(())
    }

    pub fn unregister_buffer(&self, ptr: usize) -> Result<()> {
        self.buffers
            .lock()
            .remove(&ptr)
            .map(|_| ())
            .ok_or_else(|| {
                ClientError::InvalidParams(format!("buffer {ptr:#x} was never registered"))
            })?;
        lunakv_transfer::device::unregister_range(ptr);
        Ok(())
    }

    /// Stops the heartbeat and, in embedded mode, unmounts this client's segment. Idempotent.
    pub fn close(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let _ = self.heartbeat_stop.send(true);
        // Staged session bytes go now, not when the last handle to the client drops.
        self.sessions.clear();
        // The device layer forgets this client's buffers (their memory may be freed next).
        for (&ptr, _) in std::mem::take(&mut *self.buffers.lock()).iter() {
            lunakv_transfer::device::unregister_range(ptr);
        }
        if let Some(h) = self.host.lock().take() {
            self.engine.detach_local(h.server());
            self.rt.block_on(h.shutdown())?;
        }
        Ok(())
    }

    /// The master's view of the pool: segments, capacity, usage, keys, clients (`lunakv status`).
    /// Follows the HA leader like every other call.
    pub fn cluster_status(&self) -> Result<ClusterStatus> {
        self.check_open()?;
        self.rpc(|mut m| async move { m.get_cluster_status(pb::GetClusterStatusRequest {}).await })
            .map(ClusterStatus::from)
    }

    /// The address of the master this client talks to now (the leader's, under HA).
    pub fn master_addr(&self) -> String {
        self.master.current_addr()
    }

    /// Whether the current master turns away callers that present no pool token
    /// (`LUNAKV_AUTH_TOKEN` on the master): one status call on a separate connection without
    /// credentials. `lunakv doctor` reports a master that answers it as open to strangers.
    pub fn master_refuses_anonymous(&self) -> Result<bool> {
        self.check_open()?;
        let addr = self.master.current_addr();
        self.rt
            .block_on(lunakv_master_client::probe::refuses_anonymous(
                &addr,
                Duration::from_secs(5),
            ))
    }

    /// Asks the master to move `key`'s DRAM copy to its owner's disk tier now (the SSD tier
    /// probe of `lunakv doctor`). Returns once the owner made the bytes durable.
    pub fn offload_key(&self, key: &str) -> Result<()> {
        self.check_open()?;
        let key = &*self.scoped(key);
        self.check_key(key)?;
        let req = pb::OffloadKeyRequest {
            client_id: self.client_id.clone(),
            key: key.to_owned(),
        };
        let r = self.rpc(|mut m| {
            let req = req.clone();
            async move { m.offload_key(req).await }
        })?;
        // The location changed (DRAM -> disk): forget the cached one.
        self.cache.invalidate(key, None);
        if r.code != 0 {
            return Err(ClientError::from_item(key, 0, r.code, &r.message));
        }
        Ok(())
    }

    /// The master's per key namespace bookkeeping (cross-instance key consistency).
    pub fn namespace_stats(&self) -> Result<NamespaceReport> {
        self.check_open()?;
        self.rpc(
            |mut m| async move { m.get_namespace_stats(pb::GetNamespaceStatsRequest {}).await },
        )
        .map(NamespaceReport::from)
    }
}
