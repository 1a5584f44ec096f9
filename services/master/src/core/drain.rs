//! Drain jobs (upstream's `/api/v1/drain_jobs`): move every object off some segments before
//! their owner leaves, so the pool keeps its cache instead of losing a node's share of it.
//!
//! The master never touches bytes, so a drain splits as a put does. The master keeps the job,
//! marks its segments DRAINING (no new placements; reads still served), reserves a range on a
//! target segment for each object and hands the move to the source's owner in the answer to
//! its Ping ([`MasterCore::drain_ping`]). The owner copies the object (from its DRAM or its disk
//! tier) into that range under the same generation and reports it in its next Ping; the master
//! then swaps the replica in the index (a reader finds the old replica or the new one, and one
//! that still holds the old location after its FREE reads STALE and asks again) and FREEs the
//! source through its owner. An object with no room anywhere stays where it is, counted as
//! blocked and named in the report; a job that makes no more progress ends FAILED with that
//! list, never with an object dropped.
//!
//! The rate: at most `max_concurrency` moves of a job in flight (upstream's field) and at most
//! `drain_max_bytes_per_sec` handed out per second (a token bucket per job).
//!
//! Locks: the jobs' mutex is taken before a shard (then segments), never under one.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::time::{Instant, SystemTime};

use lunakv_transfer::PlacementProof;
use lunakv_transfer::cap::{READ_TTL, RIGHT_READ, RIGHT_WRITE, WRITE_TTL};

use super::jobs::{
    Active, DrainError, DrainReport, DrainRequest, Job, JobStatus, MAX_CONCURRENCY, MAX_JOBS,
    MAX_LISTED_BLOCKED, MAX_MOVE_TRIES, MAX_SEGMENTS, MOVE_TIMEOUT, MoveResult, MoveTask,
    new_job_id,
};
use super::puts::capability;
use super::state::MasterCore;
use super::types::{
    Caller, ObjectState, PendingFree, ReplicaLoc, ReplicaView, SegmentStatus, tiers_of,
};
use crate::alloc::align_up;

/// What planning one key found.
enum Plan {
    Move(Box<(MoveTask, Active)>),
    /// No segment has room for it (and it has no other copy).
    Blocked,
    /// Its put has not ended: try it in a later pass.
    Deferred,
    /// Nothing to move: gone, or no longer on the source (`None`), or no room elsewhere but a
    /// copy off the draining segments keeps it, so its source replica was dropped (its FREE).
    Done(Option<PendingFree>),
}

impl MasterCore {
    /// Creates a drain job: validates `req` as upstream does (sources mounted and OK, distinct;
    /// targets mounted, placeable, none a source), marks the sources DRAINING and returns the
    /// job id. The moves start with the owners' next Pings.
    pub fn create_drain(&self, req: &DrainRequest) -> Result<String, DrainError> {
        if req.segments.is_empty() {
            return Err(DrainError::Invalid(
                "segments is empty: name the segment(s) to drain, e.g. {\"segments\": \
                 [\"10.0.0.5:50052\"]}"
                    .into(),
            ));
        }
        if req.max_concurrency == 0 || req.max_concurrency > MAX_CONCURRENCY {
            return Err(DrainError::Invalid(format!(
                "max_concurrency {} is out of range: give 1..={MAX_CONCURRENCY} (moves in \
                 flight at once; default 4)",
                req.max_concurrency
            )));
        }
        if req.segments.len() > MAX_SEGMENTS || req.target_segments.len() > MAX_SEGMENTS {
            return Err(DrainError::Invalid(format!(
                "a request names at most {MAX_SEGMENTS} segments and {MAX_SEGMENTS} targets"
            )));
        }
        let sources: HashSet<&str> = req.segments.iter().map(String::as_str).collect();
        if sources.len() != req.segments.len() {
            return Err(DrainError::Invalid(
                "segments names a segment twice: name each once".into(),
            ));
        }
        let mut jobs = self.drains.lock();
        let mut segs = self.segments.lock();
        for name in &req.segments {
            let seg = segs
                .get(name)
                .ok_or_else(|| DrainError::SegmentNotFound(name.clone()))?;
            if seg.status != SegmentStatus::Ok {
                return Err(DrainError::NotAvailable(format!(
                    "segment {name:?} is {}: a segment drains only from OK (cancel the job that \
                     drains it, or mount it again)",
                    seg.status.name()
                )));
            }
        }
        for t in &req.target_segments {
            if sources.contains(t.as_str()) {
                return Err(DrainError::Invalid(format!(
                    "target segment {t:?} is also a source: a target must be another segment"
                )));
            }
            let seg = segs
                .get(t)
                .ok_or_else(|| DrainError::SegmentNotFound(t.clone()))?;
            if !seg.placeable() {
                return Err(DrainError::NotAvailable(format!(
                    "target segment {t:?} takes no placements now ({}; or its inventory is \
                     still arriving)",
                    seg.status.name()
                )));
            }
        }
        let mut mounts = HashMap::new();
        for name in &req.segments {
            if let Some(seg) = segs.get_mut(name) {
                seg.status = SegmentStatus::Draining;
                mounts.insert(name.clone(), seg.mount_id);
            }
        }
        drop(segs);
        if jobs.map.len() >= MAX_JOBS {
            let oldest = jobs
                .map
                .values()
                .filter(|j| j.status.finished())
                .min_by_key(|j| j.updated)
                .map(|j| j.id.clone());
            if let Some(id) = oldest {
                jobs.map.remove(&id);
            }
        }
        let now = SystemTime::now();
        let rate = req
            .max_bytes_per_sec
            .unwrap_or(self.cfg.drain_max_bytes_per_sec);
        let id = new_job_id();
        jobs.map.insert(
            id.clone(),
            Job {
                id: id.clone(),
                status: JobStatus::Created,
                created: now,
                updated: now,
                segments: req.segments.clone(),
                mounts,
                targets: req.target_segments.clone(),
                max_concurrency: req.max_concurrency,
                rate,
                tokens: rate as f64,
                refilled: Instant::now(),
                message: "Drain job created".into(),
                succeeded: 0,
                failed: 0,
                migrated_bytes: 0,
                queue: HashMap::new(),
                active: HashMap::new(),
                blocked: BTreeSet::new(),
                deferred: 0,
                progress: false,
                scanned: false,
                tries: HashMap::new(),
                given_up: BTreeSet::new(),
            },
        );
        tracing::info!(job_id = %id, segments = ?req.segments, targets = ?req.target_segments, max_concurrency = req.max_concurrency, max_bytes_per_sec = rate, "drain job created");
        Ok(id)
    }

    /// The job's report.
    pub fn query_drain(&self, job_id: &str) -> Result<DrainReport, DrainError> {
        self.drains
            .lock()
            .map
            .get(job_id)
            .map(Job::report)
            .ok_or_else(|| DrainError::JobNotFound(job_id.to_string()))
    }

    /// Cancels a job: no more moves are handed out and its DRAINING segments are OK again.
    /// Moves in flight still land (the object is then on the target, which loses nothing).
    /// A finished job is refused (upstream's UNAVAILABLE_IN_CURRENT_STATUS).
    pub fn cancel_drain(&self, job_id: &str) -> Result<(), DrainError> {
        let mut jobs = self.drains.lock();
        let job = jobs
            .map
            .get_mut(job_id)
            .ok_or_else(|| DrainError::JobNotFound(job_id.to_string()))?;
        if job.status.finished() {
            return Err(DrainError::NotAvailable(format!(
                "drain job {job_id} already ended {}",
                job.status.name()
            )));
        }
        job.status = JobStatus::Canceled;
        job.queue.clear();
        job.touch("Drain job canceled");
        self.restore_segments(&job.segments, &job.mounts);
        tracing::info!(job_id, "drain job canceled");
        Ok(())
    }

    /// The lifecycle status of a mounted segment.
    pub fn segment_status(&self, name: &str) -> Option<SegmentStatus> {
        self.segments.lock().get(name).map(|s| s.status)
    }

    /// Segments a job drained go back to OK (their mount unchanged).
    fn restore_segments(&self, names: &[String], mounts: &HashMap<String, u64>) {
        let mut segs = self.segments.lock();
        for n in names {
            if let Some(s) = segs
                .get_mut(n)
                .filter(|s| mounts.get(n) == Some(&s.mount_id))
            {
                s.status = SegmentStatus::Ok;
            }
        }
    }

    /// A Ping of `client_id`: lands the moves it reports, then hands it the next moves of the
    /// jobs that drain its segments. Returns the moves and the FREEs to send (the moved
    /// objects' sources, the targets of failed moves); `release` them.
    pub fn drain_ping(
        &self,
        caller: &Caller,
        client_id: &str,
        results: &[MoveResult],
    ) -> (Vec<MoveTask>, Vec<PendingFree>) {
        let mut frees = Vec::new();
        let mut tasks = Vec::new();
        let mut jobs = self.drains.lock();
        if jobs.map.is_empty() {
            return (tasks, frees);
        }
        // An owner reports at most what it was handed: anything else is ignored.
        for r in results {
            let Some(job) = jobs.map.get_mut(&r.job_id) else {
                continue;
            };
            let Some(a) = job.active.get(&r.key) else {
                continue;
            };
            if a.generation != r.generation || a.client_id != client_id {
                continue;
            }
            let a = job.active.remove(&r.key).expect("just found");
            self.land(job, &r.key, a, r, &mut frees);
        }
        let now = Instant::now();
        let owned: HashSet<String> = self
            .segments
            .lock()
            .iter()
            .filter(|(_, s)| s.client_id == client_id && caller.may_act_for(s.owner.as_ref()))
            .map(|(n, _)| n.clone())
            .collect();
        for job in jobs.map.values_mut() {
            // A canceled job's moves in flight still hold their targets until they land or
            // time out.
            self.expire_moves(job, now, &mut frees);
            if job.status.finished() {
                continue;
            }
            if !job.segments.iter().any(|s| owned.contains(s)) {
                continue;
            }
            self.schedule(job, client_id, &owned, now, &mut tasks, &mut frees);
        }
        (tasks, frees)
    }

    /// Whether a drain of one of `client_id`'s segments is running (its Pings come sooner).
    pub fn drain_running_for(&self, client_id: &str) -> bool {
        let jobs = self.drains.lock();
        if jobs.map.values().all(|j| j.status.finished()) {
            return false;
        }
        let segs = self.segments.lock();
        jobs.map.values().any(|j| {
            !j.status.finished()
                && j.segments
                    .iter()
                    .any(|s| segs.get(s).is_some_and(|s| s.client_id == client_id))
        })
    }

    /// One reported move: swapped into the index if the object is still the one moved and
    /// still on its source, else its target is freed.
    fn land(
        &self,
        job: &mut Job,
        key: &str,
        a: Active,
        r: &MoveResult,
        frees: &mut Vec<PendingFree>,
    ) {
        if !r.ok {
            tracing::warn!(job_id = %job.id, key, error = %r.error, "drain move failed; the object stays on its source");
            frees.push(a.target);
            job.move_failed(key, &a.source.segment);
            job.running();
            return;
        }
        let target_mounted = self
            .segments
            .lock()
            .get(&a.target.segment)
            .is_some_and(|s| s.mount_id == a.target.mount_id);
        let mut shard = self.shard(key).lock();
        let swapped = match shard
            .get_mut(key)
            .filter(|o| o.generation == a.generation && target_mounted)
        {
            Some(mut o) => {
                let at = o.replicas.iter().position(|x| same_replica(x, &a.source));
                match at {
                    Some(i) => {
                        let before = tiers_of(&o.replicas);
                        o.replicas[i] = ReplicaLoc {
                            segment: self.names.get(&a.target.segment),
                            mount_id: a.target.mount_id,
                            offset: a.target.offset,
                            disk: false,
                        };
                        self.emit_updated(key, (o.generation, o.size), before, &o.replicas);
                        true
                    }
                    None => false,
                }
            }
            None => false,
        };
        drop(shard);
        if swapped {
            frees.extend(self.frees_of(a.generation, std::slice::from_ref(&a.source)));
            job.succeeded += 1;
            job.migrated_bytes += a.size;
            job.progress = true;
            self.metrics.drain_moved_objects_total.inc();
            self.metrics.drain_moved_bytes_total.inc_by(a.size);
        } else {
            // Removed, evicted or put again meanwhile: nothing of it is left to move.
            frees.push(a.target);
        }
        job.running();
    }

    /// Moves handed out longer than [`MOVE_TIMEOUT`] ago are given up and tried again.
    fn expire_moves(&self, job: &mut Job, now: Instant, frees: &mut Vec<PendingFree>) {
        let late: Vec<String> = job
            .active
            .iter()
            .filter(|(_, a)| now.saturating_duration_since(a.handed) > MOVE_TIMEOUT)
            .map(|(k, _)| k.clone())
            .collect();
        for k in late {
            if let Some(a) = job.active.remove(&k) {
                tracing::warn!(job_id = %job.id, key = %k, client_id = %a.client_id, "drain move not reported in time; trying again");
                frees.push(a.target);
                job.move_failed(&k, &a.source.segment);
            }
        }
    }

    /// Plans `client_id`'s next moves of `job`, and ends the job when nothing is left.
    fn schedule(
        &self,
        job: &mut Job,
        client_id: &str,
        owned: &HashSet<String>,
        now: Instant,
        tasks: &mut Vec<MoveTask>,
        frees: &mut Vec<PendingFree>,
    ) {
        {
            let segs = self.segments.lock();
            let moved = job
                .segments
                .iter()
                .find(|s| segs.get(*s).map(|x| x.mount_id) != job.mounts.get(*s).copied());
            if let Some(s) = moved {
                let s = s.clone();
                drop(segs);
                job.status = JobStatus::Failed;
                job.touch(format!(
                    "Drain job failed: segment {s:?} was unmounted or mounted again during the \
                     drain; its objects that were not moved yet are gone with it"
                ));
                tracing::warn!(job_id = %job.id, segment = %s, "drain job failed: segment unmounted");
                for (_, a) in job.active.drain() {
                    frees.push(a.target);
                }
                return;
            }
        }
        let queued = job.queue.values().map(VecDeque::len).sum::<usize>();
        if queued == 0 && job.active.is_empty() && !self.next_pass(job) {
            return;
        }
        if job.status == JobStatus::Created {
            job.status = JobStatus::Planning;
        }
        job.refill(now);
        let sources: Vec<String> = job
            .segments
            .iter()
            .filter(|s| owned.contains(*s))
            .cloned()
            .collect();
        'plan: for seg in &sources {
            while job.active.len() < job.max_concurrency as usize && job.has_tokens() {
                let Some(key) = job.queue.get_mut(seg).and_then(VecDeque::pop_front) else {
                    continue 'plan;
                };
                if job.active.contains_key(&key) {
                    continue;
                }
                match self.plan(job, seg, &key, client_id, now) {
                    Plan::Move(planned) => {
                        let (task, active) = *planned;
                        if job.rate > 0 {
                            job.tokens -= task.size as f64;
                        }
                        job.active.insert(key, active);
                        tasks.push(task);
                    }
                    Plan::Blocked => {
                        job.blocked.insert(key);
                    }
                    Plan::Deferred => job.deferred += 1,
                    Plan::Done(free) => {
                        if let Some(f) = free {
                            frees.push(f);
                            job.succeeded += 1;
                            job.progress = true;
                        }
                    }
                }
            }
        }
        job.status = JobStatus::Running;
        if !tasks.is_empty() {
            job.touch("Drain job running");
        }
    }

    /// Starts another pass over the index when the last one ended; `false` when the job ended
    /// (nothing left, or nothing more can move).
    fn next_pass(&self, job: &mut Job) -> bool {
        if job.scanned && !job.progress && job.deferred == 0 {
            // A whole pass moved nothing: what is left fits nowhere.
            return self.finish(job);
        }
        let mut found: HashMap<String, VecDeque<String>> = HashMap::new();
        let mut any = false;
        for shard in &self.shards {
            let shard = shard.lock();
            for (k, o) in shard.iter() {
                for r in &o.replicas {
                    if job.segments.iter().any(|s| **s == *r.segment)
                        && job.mounts.get(&*r.segment) == Some(&r.mount_id)
                        && !job.given_up.contains(k)
                    {
                        found
                            .entry(r.segment.to_string())
                            .or_default()
                            .push_back(k.to_string());
                        any = true;
                    }
                }
            }
        }
        if !any {
            return self.finish(job);
        }
        job.queue = found;
        job.scanned = true;
        job.progress = false;
        job.deferred = 0;
        job.blocked.clear();
        true
    }

    /// Ends a job whose pass found nothing more to move: SUCCEEDED when its segments are empty
    /// (they stay DRAINED), else FAILED naming what is left (they are OK again, as upstream).
    fn finish(&self, job: &mut Job) -> bool {
        let left = job.blocked.len() + job.given_up.len();
        if left == 0 && job.deferred == 0 {
            let mut segs = self.segments.lock();
            for s in &job.segments {
                if let Some(seg) = segs
                    .get_mut(s)
                    .filter(|x| job.mounts.get(s) == Some(&x.mount_id))
                {
                    seg.status = SegmentStatus::Drained;
                }
            }
            drop(segs);
            job.status = JobStatus::Succeeded;
            job.touch(format!(
                "Drain job finished successfully: {} objects moved ({} bytes)",
                job.succeeded, job.migrated_bytes
            ));
            tracing::info!(job_id = %job.id, moved = job.succeeded, bytes = job.migrated_bytes, failed = job.failed, "drain job succeeded");
            return false;
        }
        let keys: Vec<String> = job
            .blocked
            .iter()
            .chain(job.given_up.iter())
            .take(MAX_LISTED_BLOCKED)
            .cloned()
            .collect();
        job.status = JobStatus::Failed;
        job.touch(format!(
            "Drain job failed: {} object(s) fit on no other segment and {} failed {MAX_MOVE_TRIES} \
             times; they stay readable on their source: {keys:?}{}",
            job.blocked.len(),
            job.given_up.len(),
            if left > keys.len() { " ..." } else { "" }
        ));
        tracing::warn!(job_id = %job.id, blocked = job.blocked.len(), failed = job.given_up.len(), keys = ?keys, "drain job failed: objects left on the source");
        self.restore_segments(&job.segments, &job.mounts);
        false
    }

    /// Plans `key`'s move off `source`: reserves a range on a target and builds the task.
    fn plan(&self, job: &Job, source: &str, key: &str, client_id: &str, now: Instant) -> Plan {
        let mut shard = self.shard(key).lock();
        let Some(o) = shard.get(key) else {
            return Plan::Done(None);
        };
        if o.state != ObjectState::Complete {
            return Plan::Deferred;
        }
        let (generation, size) = (o.generation, o.size);
        let replicas = o.replicas.clone();
        let Some(src) = replicas
            .iter()
            .find(|r| *r.segment == *source && job.mounts.get(source) == Some(&r.mount_id))
            .cloned()
        else {
            return Plan::Done(None);
        };
        let len = align_up(size).unwrap_or(u64::MAX);
        let mut segs = self.segments.lock();
        let holders: HashSet<&str> = replicas.iter().map(|r| &*r.segment).collect();
        let candidates: Vec<&String> = if job.targets.is_empty() {
            segs.keys().collect()
        } else {
            job.targets.iter().collect()
        };
        // The emptiest by share, as upstream picks a drain's target.
        let target = candidates
            .into_iter()
            .filter(|n| !holders.contains(n.as_str()))
            .filter_map(|n| segs.get(n.as_str()).map(|s| (n, s)))
            .filter(|(_, s)| s.placeable() && s.alloc.largest_free() >= len)
            .min_by(|(_, a), (_, b)| {
                let ua = a.alloc.used() as f64 / a.alloc.capacity().max(1) as f64;
                let ub = b.alloc.used() as f64 / b.alloc.capacity().max(1) as f64;
                ua.total_cmp(&ub)
            })
            .map(|(n, _)| n.clone());
        let Some(target) = target else {
            // Another copy off the draining segments keeps the object: drop this one.
            let other = replicas.iter().any(|r| {
                !job.segments.iter().any(|s| **s == *r.segment)
                    && segs
                        .get(&*r.segment)
                        .is_some_and(|s| s.mount_id == r.mount_id)
            });
            drop(segs);
            if !other {
                return Plan::Blocked;
            }
            if let Some(mut o) = shard.get_mut(key) {
                let before = tiers_of(&o.replicas);
                o.replicas.retain(|r| !same_replica(r, &src));
                self.emit_updated(key, (o.generation, o.size), before, &o.replicas);
            }
            drop(shard);
            return Plan::Done(self.frees_of(generation, &[src]).pop());
        };
        let (Some(tseg), true) = (segs.get(&target), segs.contains_key(source)) else {
            return Plan::Blocked;
        };
        let tdesc = tseg.desc.clone();
        let tmount = tseg.mount_id;
        let sdesc = segs.get(source).map(|s| s.desc.clone()).expect("checked");
        let Some(offset) = segs.get_mut(&target).and_then(|s| s.alloc.allocate(size)) else {
            return Plan::Blocked;
        };
        drop(segs);
        drop(shard);
        let mut source_view = ReplicaView {
            segment: sdesc,
            offset: if src.disk { 0 } else { src.offset },
            size,
            disk: src.disk,
            capability: None,
        };
        source_view.capability = capability(&source_view, generation, RIGHT_READ, READ_TTL);
        let mut target_view = ReplicaView {
            segment: tdesc.clone(),
            offset,
            size,
            disk: false,
            capability: None,
        };
        // The target keeps the proof with the entry, as a put's owner does, so the object
        // stays provable in its inventory.
        let proof = self
            .cfg
            .inventory_key
            .as_ref()
            .map(|k| PlacementProof::issue(k, key, generation, size));
        target_view.capability = capability(
            &target_view,
            generation,
            RIGHT_READ | RIGHT_WRITE,
            WRITE_TTL,
        )
        .map(|c| proof.map_or(c, |p| c.with_proof(p)));
        let task = MoveTask {
            job_id: job.id.clone(),
            key: key.to_string(),
            generation,
            size,
            source: source_view,
            target: target_view,
        };
        let active = Active {
            generation,
            size,
            source: src,
            client_id: client_id.to_string(),
            target: PendingFree {
                endpoint: tdesc.transfer_endpoint.clone(),
                segment: target,
                mount_id: tmount,
                generation,
                offset,
            },
            handed: now,
        };
        Plan::Move(Box::new((task, active)))
    }
}

fn same_replica(a: &ReplicaLoc, b: &ReplicaLoc) -> bool {
    *a.segment == *b.segment && a.mount_id == b.mount_id && a.offset == b.offset && a.disk == b.disk
}
