//! Eviction under `--eviction_policy=cslru` ([`super::policy`] says what the policy is and
//! why): trim the protected segment to its share, then take probation's oldest blocks until
//! the target is freed.

use std::hash::BuildHasher;
use std::time::{Duration, Instant};

use super::policy::{Candidate, MAX_QUEUED, MIN_QUEUED, Oldest, QUEUED_SHARE, Tier};
use super::state::MasterCore;
use super::types::{Object, ObjectState};

/// A group whose newest member was put this recently may still be waiting for members (as in
/// the lru order): its members are taken only when nothing else is left.
const GROUP_SETTLE: Duration = Duration::from_secs(5);

/// What a pass over the queues may take.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// Unleased, unpinned, settled objects only.
    Strict,
    /// Members of groups still settling too (the other TP ranks' shards may still come).
    Settling,
    /// Leased and soft-pinned ones too (never hard-pinned or unfinished): a lease keeps a
    /// reader's lookup answered, but under pressure it must not freeze the pool. A reader whose
    /// object went meanwhile gets a miss from the owner (its generation is gone), never another
    /// object's bytes.
    Pressed,
}

impl MasterCore {
    /// Frees at least `target` bytes of DRAM in cslru order. Returns keys evicted.
    pub(super) async fn evict_cslru(&self, target: u64) -> u64 {
        let _guard = self.eviction_lock.lock().await;
        self.trim_protected();
        let mut frees = Vec::new();
        let mut offloads = Vec::new();
        let mut freed = 0u64;
        let mut evicted = Vec::new();
        let mut skipped_leased = 0u64;
        'passes: for pass in [Pass::Strict, Pass::Settling, Pass::Pressed] {
            let mut rescanned = false;
            while freed < target {
                // The protected segment only once a fresh scan found probation empty.
                let Some((c, protected)) = self.next_victim(rescanned) else {
                    if rescanned {
                        continue 'passes;
                    }
                    self.rescan();
                    rescanned = true;
                    continue;
                };
                let now = Instant::now();
                if !self.group_may_go(&c.key, pass, now) {
                    continue;
                }
                let mut leased = false;
                let mut proven = false;
                let ok = |o: &Object| {
                    proven = o.tier.proven();
                    let same = o.generation == c.generation
                        && o.state == ObjectState::Complete
                        && !o.hard_pinned
                        && o.tier.protected() == protected
                        && o.last_access == c.stamp;
                    leased = same && (self.reading(o, now) || o.soft_pinned(now));
                    let young = o.group.is_some()
                        && now.saturating_duration_since(o.put_start) < GROUP_SETTLE;
                    same && match pass {
                        Pass::Strict => !(leased || young),
                        Pass::Settling => !leased,
                        Pass::Pressed => true,
                    }
                };
                match self.evict_one(&c.key, ok, &mut frees, &mut offloads) {
                    Some(bytes) => {
                        freed += bytes;
                        evicted.push((self.hasher.hash_one(&*c.key), proven));
                    }
                    None if leased => skipped_leased += 1,
                    None => {}
                }
            }
            break;
        }
        if skipped_leased > 0 {
            self.metrics
                .eviction_lease_skipped_total
                .inc_by(skipped_leased);
        }
        let n = evicted.len() as u64;
        if n > 0 {
            let mut recent = self.recent.lock();
            for (h, proven) in evicted {
                recent.ghost.remember(h, proven);
            }
            drop(recent);
            tracing::debug!(evicted = n, freed, target, "eviction pass (cslru)");
            self.metrics.evicted(n);
            self.metrics.successful_evictions_total.inc();
        }
        self.release(frees).await;
        self.run_offloads(offloads).await;
        // Taking one member of a group breaks it: the rest goes whole now (docs/GROUPS.md),
        // and counts as evicted, as the lru order counts a group it takes.
        let rest = self.drop_broken_groups().await;
        if rest > 0 {
            self.metrics.evicted(rest);
        }
        n + rest
    }

    /// The next candidate: a chain end put since the last scan (taken only while its stamp is
    /// unchanged: a read moves it), else probation's oldest, else (with `protected_ok`: probation is
    /// empty) the protected segment's oldest; `true` with a protected one.
    fn next_victim(&self, protected_ok: bool) -> Option<(Candidate, bool)> {
        if let Some(c) = self.recent.lock().cold.pop_front() {
            return Some((c, false));
        }
        let mut q = self.queues.lock();
        if let Some(c) = q.probation.pop_front() {
            return Some((c, false));
        }
        if !protected_ok {
            return None;
        }
        q.protected.pop_front().map(|c| (c, true))
    }

    /// Demotes the protected segment's oldest blocks (CLOCK: one banked chance spent, or back to
    /// probation's recent end) until it holds at most its share of the pool.
    fn trim_protected(&self) {
        let capacity = self.total_capacity();
        let share = {
            let mut recent = self.recent.lock();
            recent.capacity = capacity;
            (capacity as f64 * recent.share.get()) as u64
        };
        let mut over = self.protected_bytes().saturating_sub(share);
        let mut rescanned = false;
        while over > 0 {
            let next = self.queues.lock().protected.pop_front();
            let Some(c) = next else {
                if rescanned {
                    return;
                }
                self.rescan();
                rescanned = true;
                continue;
            };
            let now = Instant::now();
            let mut shard = self.shard(&c.key).lock();
            let Some(mut o) = shard
                .get_mut(&c.key)
                .filter(|o| o.generation == c.generation && o.tier.protected())
                .filter(|o| o.last_access == c.stamp)
            else {
                continue;
            };
            o.last_access = now;
            match o.tier.spend() {
                Some(t) => o.tier = t,
                None => {
                    over = over.saturating_sub(o.dram_bytes());
                    o.tier = Tier::DEMOTED;
                }
            }
        }
    }

    /// Whether the group of `key` (if any) may go whole in this pass: no member unfinished or
    /// hard-pinned, and in the strict pass none leased or soft-pinned (docs/GROUPS.md). Taking
    /// the candidate then breaks the group and the rest follows it.
    fn group_may_go(&self, key: &str, pass: Pass, now: Instant) -> bool {
        let group = self
            .shard(key)
            .lock()
            .get(key)
            .and_then(|o| o.group.clone());
        let Some(group) = group else {
            return true;
        };
        self.groups.members(&group).iter().all(|m| {
            self.shard(m).lock().get(m).is_none_or(|o| {
                o.state == ObjectState::Complete
                    && !o.hard_pinned
                    && (pass == Pass::Pressed || !(self.reading(o, now) || o.soft_pinned(now)))
            })
        })
    }

    /// Whether a reader may still be about to copy `o`: its lease was granted (or renewed)
    /// within the read window ([`READ_WINDOW`](super::types::READ_WINDOW) unless a test set another).
    pub(super) fn reading(&self, o: &Object, now: Instant) -> bool {
        o.lease_until.is_some_and(|until| {
            until > now
                && until.saturating_duration_since(now) + self.cfg.read_window > self.cfg.lease_ttl
        })
    }

    /// DRAM bytes of protected objects in the whole index.
    pub(super) fn protected_bytes(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| s.lock().usage().protected_bytes())
            .sum()
    }

    /// Finds the oldest complete DRAM objects of probation and of the protected segment (a
    /// sixteenth of the keys each, within [`MIN_QUEUED`]..=[`MAX_QUEUED`]): one pass over the
    /// index whose cost the next evictions share.
    fn rescan(&self) {
        let queued = (self.key_count() as usize / QUEUED_SHARE).clamp(MIN_QUEUED, MAX_QUEUED);
        let mut probation = Oldest::new(queued);
        let mut protected = Oldest::new(queued);
        let mut keys = 0usize;
        for shard in &self.shards {
            let shard = shard.lock();
            keys += shard.len();
            for (k, o) in shard.iter() {
                if o.state != ObjectState::Complete
                    || o.hard_pinned
                    || o.replicas.iter().all(|r| r.disk)
                {
                    continue;
                }
                let side = if o.tier.protected() {
                    &mut protected
                } else {
                    &mut probation
                };
                side.offer(o.last_access, k, o.generation);
            }
        }
        self.recent.lock().ghost.fit(keys);
        let mut q = self.queues.lock();
        q.probation = probation.into_queue();
        q.protected = protected.into_queue();
    }
}
