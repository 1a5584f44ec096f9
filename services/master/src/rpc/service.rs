//! The gRPC edge: converts prost messages into validated domain types ([`super::convert`]),
//! calls [`MasterCore`], and converts back. Per-item failures travel as Mooncake codes inside
//! the responses; only whole-call failures become a `tonic::Status`, in [`to_status`].

use std::sync::Arc;

use lunakv_meta::MetaStore;
use lunakv_proto::ErrorCode;
use lunakv_proto::master as pb;
use tokio::sync::Notify;
use tonic::{Request, Response, Status};

use crate::core::{
    Caller, ChainEnd, InventoryItem, Location, MasterCore, MoveResult, OpError, PutOptions,
    SegmentDesc, Touch, chain_stamp,
};
use crate::ha::election::HaState;
use crate::ha::recovery::{Access, RecoveryGate};
use crate::metrics::Rpc;
use crate::persist;
use crate::rpc::convert::{
    Placed, PutItem, SegmentTable, ServiceError, check_key, data_secret, key_regex, key_result,
    location, locations, namespace_report, put_start, put_starts, tenant_field, tenant_statuses,
    to_status,
};
use crate::slot::CoreSlot;

/// Most move results one Ping may report: an owner reports at most the moves it was handed.
const MAX_DRAIN_RESULTS: usize = 4 * crate::core::DRAIN_MAX_CONCURRENCY as usize;

/// Who made the call: the identity the auth layer found on its connection (mTLS), or none.
fn caller_of<T>(request: &Request<T>) -> Caller {
    request
        .extensions()
        .get::<Caller>()
        .cloned()
        .unwrap_or_default()
}

// === the service ===

/// Implements `lunakv.master.v1.Master` over a [`MasterCore`].
#[derive(Clone)]
pub struct MasterService {
    slot: Arc<CoreSlot>,
    meta: Arc<dyn MetaStore>,
    /// Woken on PutEnd so the eviction task checks the watermark promptly.
    put_end: Arc<Notify>,
    /// HA: the role and lease gate every RPC passes (None = single master, no gate).
    ha: Option<Arc<HaState>>,
    /// A single master's rebuild after a restart (HA keeps its own, per term, in `ha`).
    recovery: Arc<RecoveryGate>,
}

/// The gate every call passes before acting, whichever port it came on (gRPC, quick calls,
/// the admin API's writes): a single master's rebuild after a restart, or HA's role, local
/// lease deadline and recovery. Mounts are how a master rebuilds its index, so they pass during
/// recovery; reads pass when a warm copy answers them.
pub(crate) fn admit(
    slot: &CoreSlot,
    ha: Option<&HaState>,
    recovery: &RecoveryGate,
    access: Access,
) -> Result<Admitted, Status> {
    let started = std::time::Instant::now();
    let core = slot.get();
    let term = match ha {
        None if access != Access::Mount && !recovery.done(&core) => {
            return Err(RecoveryGate::refusal(
                "this lunakv-master has just restarted",
            ));
        }
        None => None,
        Some(ha) => Some(ha.admit(&core, access)?),
    };
    Ok(Admitted {
        core,
        term: term.map(|(t, _)| t),
        warm: term.is_some_and(|(_, w)| w),
        started,
    })
}

/// The gate before acknowledging a mutation [`admit`] let in: with HA, still leading in the
/// same term with a valid lease.
pub(crate) fn confirm(ha: Option<&HaState>, a: &Admitted) -> Result<(), Status> {
    match (ha, a.term) {
        (Some(ha), Some(term)) => ha.confirm(term),
        _ => Ok(()),
    }
}

/// A request admitted by the HA gate: the core of the current term, and the term to confirm
/// before acknowledging a mutation.
pub(crate) struct Admitted {
    pub(crate) core: Arc<MasterCore>,
    term: Option<u64>,
    /// A read admitted during the rebuild, answered from the warm copy.
    warm: bool,
    /// For `master_rpc_duration_seconds`.
    pub(crate) started: std::time::Instant,
}

impl MasterService {
    pub fn new(core: Arc<MasterCore>, meta: Arc<dyn MetaStore>, put_end: Arc<Notify>) -> Self {
        MasterService::with_slot(CoreSlot::new(core), meta, put_end, None, Arc::default())
    }

    /// A service over a swappable core, gated by `ha` when set.
    pub fn with_slot(
        slot: Arc<CoreSlot>,
        meta: Arc<dyn MetaStore>,
        put_end: Arc<Notify>,
        ha: Option<Arc<HaState>>,
        recovery: Arc<RecoveryGate>,
    ) -> Self {
        MasterService {
            slot,
            meta,
            put_end,
            ha,
            recovery,
        }
    }

    /// Counts a call that came as a quick frame (its handler counts it as any call too).
    pub(crate) fn count_quick_call(&self) {
        self.slot.get().metrics.quick_calls_total.inc();
    }

    /// The gate before acting ([`admit`]).
    fn admit(&self, access: Access) -> Result<Admitted, Status> {
        admit(&self.slot, self.ha.as_deref(), &self.recovery, access)
    }

    /// A read answered from the warm copy during the rebuild: a miss may only mean that the
    /// copy lagged the dead leader by a few changes, so it is refused "rebuilding" (the client
    /// retries) instead of answered "not found"; hits are answered at once.
    fn warm_checked(&self, a: &Admitted, missed: bool) -> Result<(), Status> {
        let (Some(ha), Some(term)) = (&self.ha, a.term) else {
            return Ok(());
        };
        if !a.warm {
            return Ok(());
        }
        if missed {
            return Err(ha.rebuilding(term));
        }
        ha.metrics.warm_reads_total.inc();
        Ok(())
    }

    /// The HA gate before acknowledging a mutation: still leading, same term, lease valid.
    fn confirm(&self, a: &Admitted) -> Result<(), Status> {
        confirm(self.ha.as_deref(), a)
    }

    async fn put_start_one(
        &self,
        core: &MasterCore,
        caller: &Caller,
        client_id: &str,
        (key, size, group): (String, u64, String),
        opts: &PutOptions,
    ) -> Result<Placed, OpError> {
        match PutItem::try_from((key, size, group)) {
            Ok(item) if item.group.is_some() => {
                let opts = PutOptions {
                    group: item.group,
                    ..opts.clone()
                };
                core.put_start_by(caller, client_id, &item.key, item.size, &opts)
                    .await
            }
            Ok(item) => {
                core.put_start_by(caller, client_id, &item.key, item.size, opts)
                    .await
            }
            Err(e) => Err(e),
        }
    }

    fn put_end_one(
        &self,
        core: &MasterCore,
        caller: &Caller,
        key: &str,
        (stamp, end): (std::time::Instant, ChainEnd),
    ) -> pb::KeyResult {
        let r = check_key(key).and_then(|()| core.put_end_at(caller, key, stamp, end));
        // Waking the background task for every put costs a thread switch each; it is woken
        // only when there is something to evict.
        if r.is_ok() && core.eviction_due() {
            self.put_end.notify_one();
        }
        key_result(r)
    }

    async fn put_revoke_one(
        &self,
        core: &MasterCore,
        caller: &Caller,
        client_id: &str,
        key: &str,
    ) -> pb::KeyResult {
        let r = match check_key(key) {
            Ok(()) => core.put_revoke_by(caller, client_id, key).await,
            Err(e) => Err(e),
        };
        key_result(r)
    }

    fn get_one(&self, core: &MasterCore, client_id: &str, key: &str) -> pb::ObjectLocation {
        location(check_key(key).and_then(|()| core.get_replica_list_for(client_id, key)))
    }

    /// `BatchExistKey` (`rpc` names it; a miss is an answer there, not a failure) or
    /// `BatchGetReplicaList`: the answer both transports send (gRPC, quick calls).
    pub(crate) async fn batch_locations(
        &self,
        rpc: Rpc,
        client_id: &str,
        keys: &[String],
    ) -> Result<pb::BatchObjectLocations, Status> {
        let a = self.admit(Access::Read)?;
        let missed = |e: &OpError| e.code == ErrorCode::ObjectNotFound;
        // A prefix reader (vLLM) reads an existence batch's leading run of hits and nothing
        // after its first miss: only that run is a read for leases and eviction order.
        let now = std::time::Instant::now();
        let mut pos = 0usize;
        let mut leading = true;
        let results = self
            .batch(
                &a,
                rpc,
                keys,
                |k| {
                    let touch = if leading || rpc != Rpc::BatchExistKey {
                        Touch::Read(chain_stamp(now, pos))
                    } else {
                        Touch::Look
                    };
                    pos += 1;
                    let r = check_key(k).and_then(|()| a.core.lookup(client_id, k, touch));
                    leading &= r.is_ok();
                    std::future::ready(r)
                },
                |r: &Result<Location, OpError>| match r {
                    Ok(_) => false,
                    Err(e) => rpc != Rpc::BatchExistKey || !missed(e),
                },
                |results| results,
            )
            .await?
            .into_inner();
        self.warm_checked(&a, results.iter().any(|r| r.as_ref().is_err_and(missed)))?;
        Ok(locations(results))
    }

    /// `BatchPutStart` for `caller`: the answer both transports send.
    pub(crate) async fn batch_put_starts(
        &self,
        caller: &Caller,
        req: pb::BatchPutStartRequest,
    ) -> Result<pb::BatchPutStartResponse, Status> {
        let a = self.admit(Access::Write)?;
        let opts = PutOptions::from(req.config);
        let client_id = req.client_id;
        self.batch(
            &a,
            Rpc::BatchPutStart,
            req.items,
            |item| {
                self.put_start_one(
                    &a.core,
                    caller,
                    &client_id,
                    (item.key, item.size, item.group_id),
                    &opts,
                )
            },
            Result::is_err,
            put_starts,
        )
        .await
        .map(Response::into_inner)
    }

    /// `BatchPutEnd` for `caller`: the answer both transports send.
    pub(crate) async fn batch_put_ends(
        &self,
        caller: &Caller,
        req: pb::BatchKeysRequest,
    ) -> Result<pb::BatchKeyResults, Status> {
        let a = self.admit(Access::Write)?;
        let keys = req.keys;
        if let Err(e) = a
            .core
            .check_reservations(caller, keys.iter().map(String::as_str))
        {
            return self
                .fail(&a, Rpc::BatchPutEnd, e.into())
                .map(Response::into_inner);
        }
        // The batch is one chain's missing blocks in prefix order (vLLM's save): deeper keys
        // are stamped older and the last is the chain's end (core::policy).
        let now = std::time::Instant::now();
        let n = keys.len();
        self.batch(
            &a,
            Rpc::BatchPutEnd,
            keys.into_iter().enumerate(),
            |(i, k)| {
                let order = (chain_stamp(now, i), ChainEnd::of(i, n));
                std::future::ready(self.put_end_one(&a.core, caller, &k, order))
            },
            key_failed,
            |results| pb::BatchKeyResults { results },
        )
        .await
        .map(Response::into_inner)
    }

    async fn remove_one(&self, core: &MasterCore, key: &str, force: bool) -> pb::KeyResult {
        let r = match check_key(key) {
            Ok(()) => core.remove(key, force).await,
            Err(e) => Err(e),
        };
        key_result(r)
    }

    /// Records the call and answers, after the HA gate confirms a mutation.
    fn done<T>(
        &self,
        a: &Admitted,
        rpc: Rpc,
        failed: bool,
        body: T,
    ) -> Result<Response<T>, Status> {
        a.core.metrics.record(rpc, failed, a.started.elapsed());
        self.confirm(a)?;
        Ok(Response::new(body))
    }

    fn fail<T>(&self, a: &Admitted, rpc: Rpc, e: ServiceError) -> Result<Response<T>, Status> {
        a.core.metrics.record(rpc, true, a.started.elapsed());
        self.confirm(a)?;
        Err(to_status(e))
    }

    /// Answers a batch as its singles, in order and one at a time, so each item sees the state
    /// the items before it left, as a client's sequence of singles would. The call counts as
    /// failed in the metrics when any result is `failed`.
    async fn batch<I, R, Fut, T>(
        &self,
        a: &Admitted,
        rpc: Rpc,
        items: impl IntoIterator<Item = I>,
        mut one: impl FnMut(I) -> Fut,
        failed: impl Fn(&R) -> bool,
        reply: impl FnOnce(Vec<R>) -> T,
    ) -> Result<Response<T>, Status>
    where
        Fut: std::future::Future<Output = R>,
    {
        let items = items.into_iter();
        let mut results = Vec::with_capacity(items.size_hint().0);
        for item in items {
            results.push(one(item).await);
        }
        let any_failed = results.iter().any(failed);
        self.done(a, rpc, any_failed, reply(results))
    }
}

fn key_failed(r: &pb::KeyResult) -> bool {
    r.code != 0
}

#[tonic::async_trait]
impl pb::master_server::Master for MasterService {
    async fn mount_segment(
        &self,
        request: Request<pb::MountSegmentRequest>,
    ) -> Result<Response<pb::MountSegmentResponse>, Status> {
        let a = self.admit(Access::Mount)?;
        let caller = caller_of(&request);
        let req = request.into_inner();
        let result: Result<pb::MountSegmentResponse, ServiceError> = async {
            let mut desc: SegmentDesc = req
                .segment
                .ok_or_else(|| ServiceError::Invalid("segment is missing".into()))?
                .try_into()?;
            desc.data_secret = data_secret(&req.data_secret)?;
            let inventory = req.inventory.into_iter().map(InventoryItem::from).collect();
            let out = a.core.mount_parts(
                &caller,
                &req.client_id,
                &req.cluster_id,
                desc.clone(),
                inventory,
                req.inventory_follows,
            )?;
            if !out.displaced.is_empty() {
                let core = a.core.clone();
                let displaced = out.displaced.clone();
                tokio::spawn(async move { core.release(displaced).await });
            }
            persist::save_segment(self.meta.as_ref(), &desc).await?;
            Ok(pb::MountSegmentResponse {
                accepted_objects: out.accepted,
                rejected_generations: out.rejected_generations,
            })
        }
        .await;
        match result {
            Ok(r) => self.done(&a, Rpc::MountSegment, false, r),
            Err(e) => self.fail(&a, Rpc::MountSegment, e),
        }
    }

    async fn mount_inventory(
        &self,
        request: Request<pb::MountInventoryRequest>,
    ) -> Result<Response<pb::MountSegmentResponse>, Status> {
        let a = self.admit(Access::Mount)?;
        let caller = caller_of(&request);
        let req = request.into_inner();
        let items = req.items.into_iter().map(InventoryItem::from).collect();
        let result = a.core.mount_inventory(
            &caller,
            &req.client_id,
            &req.segment_name,
            &req.instance_id,
            items,
            req.last,
        );
        match result {
            Ok(out) => {
                if !out.displaced.is_empty() {
                    let core = a.core.clone();
                    let displaced = out.displaced.clone();
                    tokio::spawn(async move { core.release(displaced).await });
                }
                let r = pb::MountSegmentResponse {
                    accepted_objects: out.accepted,
                    rejected_generations: out.rejected_generations,
                };
                self.done(&a, Rpc::MountInventory, false, r)
            }
            Err(e) => self.fail(&a, Rpc::MountInventory, e.into()),
        }
    }

    async fn unmount_segment(
        &self,
        request: Request<pb::UnmountSegmentRequest>,
    ) -> Result<Response<pb::UnmountSegmentResponse>, Status> {
        let a = self.admit(Access::Mount)?;
        let caller = caller_of(&request);
        let req = request.into_inner();
        let result: Result<u64, ServiceError> = async {
            let dropped = a.core.unmount_owned(
                &caller,
                &req.client_id,
                &req.segment_name,
                &req.instance_id,
            )?;
            persist::forget_segment(self.meta.as_ref(), &req.segment_name).await?;
            Ok(dropped)
        }
        .await;
        match result {
            Ok(dropped_objects) => self.done(
                &a,
                Rpc::UnmountSegment,
                false,
                pb::UnmountSegmentResponse { dropped_objects },
            ),
            Err(e) => self.fail(&a, Rpc::UnmountSegment, e),
        }
    }

    async fn ping(
        &self,
        request: Request<pb::PingRequest>,
    ) -> Result<Response<pb::PingResponse>, Status> {
        let a = self.admit(Access::Mount)?;
        let caller = caller_of(&request);
        let req = request.into_inner();
        if req.client_id.is_empty() {
            return self.fail(
                &a,
                Rpc::Ping,
                ServiceError::Invalid("client_id is empty: send the id used at mount".into()),
            );
        }
        let remount_required =
            a.core
                .ping(&req.client_id, &req.touched_keys, &req.mounted_segments);
        if !req.disk_dropped.is_empty() {
            let dropped: Vec<(String, u64)> = req
                .disk_dropped
                .into_iter()
                .map(|i| (i.key, i.generation))
                .collect();
            a.core.disk_dropped(&caller, &req.client_id, &dropped);
        }
        // Drain jobs: land the owner's finished moves, hand it the next ones. The FREEs of the
        // moved objects' sources go in the background: the owner's next Ping must not wait.
        let results: Vec<MoveResult> = req
            .drain_results
            .into_iter()
            .take(MAX_DRAIN_RESULTS)
            .map(|r| MoveResult {
                job_id: r.job_id,
                key: r.key,
                generation: r.generation,
                ok: r.ok,
                error: r.error,
            })
            .collect();
        let (moves, frees) = a.core.drain_ping(&caller, &req.client_id, &results);
        if !frees.is_empty() {
            let core = a.core.clone();
            tokio::spawn(async move { core.release(frees).await });
        }
        let next_ping_ms = if moves.is_empty() && !a.core.drain_running_for(&req.client_id) {
            0
        } else {
            crate::core::DRAIN_PING_MS
        };
        let mut segments = SegmentTable::default();
        self.done(
            &a,
            Rpc::Ping,
            false,
            pb::PingResponse {
                remount_required,
                view_version: u64::from(a.core.epoch()),
                drain_moves: moves
                    .iter()
                    .map(|m| pb::DrainMove {
                        job_id: m.job_id.clone(),
                        key: m.key.clone(),
                        generation: m.generation,
                        size: m.size,
                        source: Some(segments.replica(&m.source)),
                        target: Some(segments.replica(&m.target)),
                    })
                    .collect(),
                next_ping_ms,
                segments: segments.descriptors(),
            },
        )
    }

    async fn put_start(
        &self,
        request: Request<pb::PutStartRequest>,
    ) -> Result<Response<pb::PutStartResponse>, Status> {
        let a = self.admit(Access::Write)?;
        let caller = caller_of(&request);
        let req = request.into_inner();
        let opts = PutOptions::from(req.config);
        let r = self
            .put_start_one(
                &a.core,
                &caller,
                &req.client_id,
                (req.key, req.size, req.group_id),
                &opts,
            )
            .await;
        self.done(&a, Rpc::PutStart, r.is_err(), put_start(r))
    }

    async fn batch_put_start(
        &self,
        request: Request<pb::BatchPutStartRequest>,
    ) -> Result<Response<pb::BatchPutStartResponse>, Status> {
        let caller = caller_of(&request);
        self.batch_put_starts(&caller, request.into_inner())
            .await
            .map(Response::new)
    }

    async fn put_end(
        &self,
        request: Request<pb::PutEndRequest>,
    ) -> Result<Response<pb::KeyResult>, Status> {
        let a = self.admit(Access::Write)?;
        let caller = caller_of(&request);
        let key = request.into_inner().key;
        if let Err(e) = a.core.check_reservations(&caller, [key.as_str()]) {
            return self.fail(&a, Rpc::PutEnd, e.into());
        }
        let r = self.put_end_one(
            &a.core,
            &caller,
            &key,
            (std::time::Instant::now(), ChainEnd::No),
        );
        self.done(&a, Rpc::PutEnd, r.code != 0, r)
    }

    async fn batch_put_end(
        &self,
        request: Request<pb::BatchKeysRequest>,
    ) -> Result<Response<pb::BatchKeyResults>, Status> {
        let caller = caller_of(&request);
        self.batch_put_ends(&caller, request.into_inner())
            .await
            .map(Response::new)
    }

    async fn put_revoke(
        &self,
        request: Request<pb::PutRevokeRequest>,
    ) -> Result<Response<pb::KeyResult>, Status> {
        let a = self.admit(Access::Write)?;
        let caller = caller_of(&request);
        let req = request.into_inner();
        if let Err(e) = a.core.check_reservations(&caller, [req.key.as_str()]) {
            return self.fail(&a, Rpc::PutRevoke, e.into());
        }
        let r = self
            .put_revoke_one(&a.core, &caller, &req.client_id, &req.key)
            .await;
        self.done(&a, Rpc::PutRevoke, r.code != 0, r)
    }

    async fn batch_put_revoke(
        &self,
        request: Request<pb::BatchKeysRequest>,
    ) -> Result<Response<pb::BatchKeyResults>, Status> {
        let a = self.admit(Access::Write)?;
        let caller = caller_of(&request);
        let req = request.into_inner();
        if let Err(e) = a
            .core
            .check_reservations(&caller, req.keys.iter().map(String::as_str))
        {
            return self.fail(&a, Rpc::BatchPutRevoke, e.into());
        }
        self.batch(
            &a,
            Rpc::BatchPutRevoke,
            &req.keys,
            |k| self.put_revoke_one(&a.core, &caller, &req.client_id, k),
            key_failed,
            |results| pb::BatchKeyResults { results },
        )
        .await
    }

    async fn get_replica_list(
        &self,
        request: Request<pb::GetReplicaListRequest>,
    ) -> Result<Response<pb::ObjectLocation>, Status> {
        let a = self.admit(Access::Read)?;
        let req = request.into_inner();
        let r = self.get_one(&a.core, &req.client_id, &req.key);
        self.warm_checked(&a, r.code == ErrorCode::ObjectNotFound.as_i32())?;
        self.done(&a, Rpc::GetReplicaList, r.code != 0, r)
    }

    async fn batch_get_replica_list(
        &self,
        request: Request<pb::BatchGetReplicaListRequest>,
    ) -> Result<Response<pb::BatchObjectLocations>, Status> {
        let req = request.into_inner();
        self.batch_locations(Rpc::BatchGetReplicaList, &req.client_id, &req.keys)
            .await
            .map(Response::new)
    }

    async fn exist_key(
        &self,
        request: Request<pb::ExistKeyRequest>,
    ) -> Result<Response<pb::ObjectLocation>, Status> {
        let a = self.admit(Access::Read)?;
        // Like upstream, existence grants a lease too (the caller is about to read).
        let req = request.into_inner();
        let r = self.get_one(&a.core, &req.client_id, &req.key);
        // A miss is an answer, not a failure.
        let missed = r.code == ErrorCode::ObjectNotFound.as_i32();
        let failed = r.code != 0 && !missed;
        self.warm_checked(&a, missed)?;
        self.done(&a, Rpc::ExistKey, failed, r)
    }

    async fn batch_exist_key(
        &self,
        request: Request<pb::BatchExistKeyRequest>,
    ) -> Result<Response<pb::BatchObjectLocations>, Status> {
        let req = request.into_inner();
        self.batch_locations(Rpc::BatchExistKey, &req.client_id, &req.keys)
            .await
            .map(Response::new)
    }

    async fn remove(
        &self,
        request: Request<pb::RemoveRequest>,
    ) -> Result<Response<pb::KeyResult>, Status> {
        let a = self.admit(Access::Write)?;
        let req = request.into_inner();
        let r = self.remove_one(&a.core, &req.key, req.force).await;
        self.done(&a, Rpc::Remove, r.code != 0, r)
    }

    async fn batch_remove(
        &self,
        request: Request<pb::BatchRemoveRequest>,
    ) -> Result<Response<pb::BatchKeyResults>, Status> {
        let a = self.admit(Access::Write)?;
        let req = request.into_inner();
        let mut checked: Vec<Result<(), OpError>> = req.keys.iter().map(|k| check_key(k)).collect();
        let valid: Vec<usize> = (0..checked.len()).filter(|&i| checked[i].is_ok()).collect();
        // One removal of all valid keys: their owners get one FREE each for the batch.
        let removed = a
            .core
            .remove_many(valid.iter().map(|&i| req.keys[i].as_str()), req.force)
            .await;
        for (i, r) in valid.into_iter().zip(removed) {
            checked[i] = r;
        }
        let results: Vec<pb::KeyResult> = checked.into_iter().map(key_result).collect();
        let failed = results.iter().any(key_failed);
        self.done(
            &a,
            Rpc::BatchRemove,
            failed,
            pb::BatchKeyResults { results },
        )
    }

    async fn remove_all(
        &self,
        request: Request<pb::RemoveAllRequest>,
    ) -> Result<Response<pb::RemoveAllResponse>, Status> {
        let a = self.admit(Access::Write)?;
        let req = request.into_inner();
        let (code, message, removed) = match tenant_field(&req.tenant_id) {
            Ok(tenant) => (0, String::new(), a.core.remove_all(tenant, req.force).await),
            Err(e) => (ErrorCode::InvalidParams as i32, e.to_string(), 0),
        };
        self.done(
            &a,
            Rpc::RemoveAll,
            code != 0,
            pb::RemoveAllResponse {
                code,
                message,
                removed,
            },
        )
    }

    async fn remove_by_regex(
        &self,
        request: Request<pb::RemoveByRegexRequest>,
    ) -> Result<Response<pb::RemoveAllResponse>, Status> {
        let a = self.admit(Access::Write)?;
        let req = request.into_inner();
        let (code, message, removed) =
            match tenant_field(&req.tenant_id).and_then(|t| Ok((t, key_regex(&req.regex)?))) {
                Ok((tenant, re)) => (
                    0,
                    String::new(),
                    a.core.remove_by_regex(tenant, &re, req.force).await,
                ),
                Err(e) => (ErrorCode::InvalidParams as i32, e.to_string(), 0),
            };
        self.done(
            &a,
            Rpc::RemoveByRegex,
            code != 0,
            pb::RemoveAllResponse {
                code,
                message,
                removed,
            },
        )
    }

    async fn get_cluster_status(
        &self,
        _request: Request<pb::GetClusterStatusRequest>,
    ) -> Result<Response<pb::ClusterStatus>, Status> {
        let a = self.admit(Access::Write)?;
        let core = &a.core;
        let segments = core
            .segments()
            .into_iter()
            .map(|s| pb::SegmentStatus {
                segment: core.segment_desc(&s.name).as_ref().map(Into::into),
                client_id: s.client_id,
                used_bytes: s.used,
                object_count: s.objects,
                last_ping_ms_ago: s.last_ping_ms_ago,
                disk_capacity_bytes: s.disk_capacity,
                disk_used_bytes: s.disk_used,
                disk_object_count: s.disk_objects,
            })
            .collect();
        let (disk_capacity_bytes, disk_used_bytes, _) = core.disk_totals();
        Ok(Response::new(pb::ClusterStatus {
            cluster_id: core.config().cluster_id.clone(),
            segments,
            total_capacity_bytes: core.total_capacity(),
            allocated_bytes: core.allocated_bytes(),
            key_count: core.key_count(),
            active_clients: core.active_clients(),
            evicted_key_count: core.metrics.evicted_key_count.get(),
            master_version: env!("CARGO_PKG_VERSION").to_string(),
            enable_offload: core.config().enable_offload,
            disk_capacity_bytes,
            disk_used_bytes,
            promotion_on_hit: core.config().promotion_on_hit,
            kv_events_enabled: core.events().is_some(),
            kv_events_endpoint: core
                .events()
                .map(|e| e.endpoint.clone())
                .unwrap_or_default(),
            kv_events_replay_endpoint: core
                .events()
                .and_then(|e| e.replay_endpoint.clone())
                .unwrap_or_default(),
            kv_events_topic: core.events().map(|e| e.topic.clone()).unwrap_or_default(),
            kv_events_vllm_endpoint: core
                .events()
                .and_then(|e| e.vllm_endpoint.clone())
                .unwrap_or_default(),
            tenants: tenant_statuses(core),
            enable_multi_tenants: core.config().multi_tenants,
        }))
    }

    async fn offload_key(
        &self,
        request: Request<pb::OffloadKeyRequest>,
    ) -> Result<Response<pb::KeyResult>, Status> {
        let a = self.admit(Access::Write)?;
        let key = request.into_inner().key;
        let r = match check_key(&key) {
            Ok(()) => a.core.offload_key(&key).await,
            Err(e) => Err(e),
        };
        self.confirm(&a)?;
        Ok(Response::new(key_result(r)))
    }

    type ReplicateIndexStream =
        tokio_stream::wrappers::ReceiverStream<Result<pb::IndexUpdate, Status>>;

    async fn replicate_index(
        &self,
        request: Request<pb::ReplicateIndexRequest>,
    ) -> Result<Response<Self::ReplicateIndexStream>, Status> {
        let Some(ha) = self.ha.clone() else {
            return Err(Status::failed_precondition(
                "ReplicateIndex feeds HA standbys; this lunakv-master runs without --enable_ha",
            ));
        };
        // Served during the rebuild too: the copy then fills as the owners remount.
        let a = self.admit(Access::Mount)?;
        let term = a.term.unwrap_or_default();
        let standby = request.into_inner().standby;
        let stream = crate::ha::standby::serve(a.core.clone(), term, standby, move || {
            ha.leading_term() == Some(term)
        })?;
        Ok(Response::new(stream))
    }

    async fn get_namespace_stats(
        &self,
        _request: Request<pb::GetNamespaceStatsRequest>,
    ) -> Result<Response<pb::NamespaceStatsResponse>, Status> {
        let a = self.admit(Access::Write)?;
        Ok(Response::new(namespace_report(&a.core.namespaces.report())))
    }
}
