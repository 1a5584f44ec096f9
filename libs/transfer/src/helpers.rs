//! The threads that share a batch with the caller: its in-process copies, or its units (one
//! connection each) to other processes' segments.
//!
//! A scoped thread spawned per batch cost the caller ~0.05 ms before it could start its own
//! share and the helper ~0.09 ms before it started (clone3 and a wake-up, on the CI VM):
//! a tenth of what a vLLM batch spends outside its copies, and a batch over shm spawned three.
//! The engine therefore keeps two small pools (rayon's, each started at the first batch that
//! needs it): `copy_threads - 1` threads named `lunakv-copy` for in-process copies, and
//! `conns_per_peer - 1` named `lunakv-unit` for units; each is lent to one batch at a time. A
//! batch that finds its pool lent to another caller's batch spawns scoped threads as before,
//! so concurrent callers never queue behind each other's work.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use parking_lot::Mutex;

pub(crate) struct CopyHelpers {
    /// Threads beside the caller.
    threads: usize,
    name: &'static str,
    /// `None` once building it failed (then every batch spawns).
    pool: OnceLock<Option<rayon::ThreadPool>>,
    lent: AtomicBool,
}

/// Gives the pool back when the batch is done, even when a share panicked.
struct Lent<'a>(&'a AtomicBool);

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl CopyHelpers {
    /// Up to `threads - 1` helpers beside the caller, named `name`.
    pub(crate) fn new(threads: usize, name: &'static str) -> CopyHelpers {
        CopyHelpers {
            threads: threads.saturating_sub(1),
            name,
            pool: OnceLock::new(),
            lent: AtomicBool::new(false),
        }
    }

    fn pool(&self) -> Option<&rayon::ThreadPool> {
        self.pool
            .get_or_init(|| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(self.threads)
                    .thread_name(|_| self.name.into())
                    .build()
                    .inspect_err(|e| {
                        tracing::warn!(error = %e, pool = self.name, "no helper pool; batches spawn their helpers")
                    })
                    .ok()
            })
            .as_ref()
    }

    /// The pool's threads, 0 until a batch first needed them.
    #[cfg(test)]
    pub(crate) fn started(&self) -> usize {
        self.pool
            .get()
            .and_then(Option::as_ref)
            .map_or(0, rayon::ThreadPool::current_num_threads)
    }

    /// Work sharing over `items`: the caller and `n` helpers each claim the next item until
    /// none is left, so a helper the scheduler starts late (a busy box) costs nothing: the
    /// caller simply does more. Returns what `each` returned for every item, in no set order.
    pub(crate) fn share<I: Send, T: Send, R: IntoIterator<Item = T>>(
        &self,
        n: usize,
        items: Vec<I>,
        each: impl Fn(I) -> R + Sync,
    ) -> Vec<T> {
        // The lock per slot is uncontended: each index is claimed once.
        let slots: Vec<Mutex<Option<I>>> = items.into_iter().map(|i| Mutex::new(Some(i))).collect();
        let next = AtomicUsize::new(0);
        self.run(n, || {
            let mut out = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(slot) = slots.get(i) else {
                    return out;
                };
                if let Some(item) = slot.lock().take() {
                    out.extend(each(item));
                }
            }
        })
    }

    /// Runs `work` on the caller's thread and on `n` helpers at once, and returns everything
    /// they returned. A panic in any of them is raised here once all have finished.
    pub(crate) fn run<T: Send>(&self, n: usize, work: impl Fn() -> Vec<T> + Sync) -> Vec<T> {
        if n == 0 {
            return work();
        }
        if n <= self.threads && !self.lent.swap(true, Ordering::Acquire) {
            let _lent = Lent(&self.lent);
            if let Some(pool) = self.pool() {
                let out = Mutex::new(Vec::new());
                pool.in_place_scope(|s| {
                    for _ in 0..n {
                        s.spawn(|_| {
                            let r = work();
                            out.lock().extend(r);
                        });
                    }
                    let r = work();
                    out.lock().extend(r);
                });
                return out.into_inner();
            }
        }
        std::thread::scope(|sc| {
            let handles: Vec<_> = (0..n).map(|_| sc.spawn(&work)).collect();
            let mut out = work();
            for h in handles {
                match h.join() {
                    Ok(r) => out.extend(r),
                    Err(p) => std::panic::resume_unwind(p),
                }
            }
            out
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_runs_its_shares_on_the_pool_and_a_concurrent_one_on_its_own_threads() {
        let h = CopyHelpers::new(2, "lunakv-copy");
        let names = |h: &CopyHelpers| {
            let mut v = h.run(1, || vec![std::thread::current().name().map(str::to_owned)]);
            v.sort();
            v
        };
        let main = std::thread::current().name().map(str::to_owned);
        // Caller and pool thread, twice: the pool is lent and given back.
        for _ in 0..2 {
            assert_eq!(names(&h), vec![main.clone(), Some("lunakv-copy".into())]);
        }
        // While one batch holds the pool, another caller's batch spawns its own helper and
        // does not wait for the first.
        let (hold, release) = std::sync::mpsc::channel::<()>();
        let (started, running) = std::sync::mpsc::channel::<()>();
        let release = Mutex::new(release);
        std::thread::scope(|sc| {
            let h = &h;
            let first = sc.spawn(move || {
                h.run(1, || {
                    if std::thread::current().name() == Some("lunakv-copy") {
                        started.send(()).unwrap();
                        release.lock().recv().unwrap();
                    }
                    vec![0]
                })
            });
            running.recv().unwrap();
            let second = h.run(1, || {
                vec![std::thread::current().name() == Some("lunakv-copy")]
            });
            assert_eq!(
                second,
                vec![false, false],
                "the second batch did not use the lent pool"
            );
            hold.send(()).unwrap();
            assert_eq!(first.join().unwrap(), vec![0, 0]);
        });
        // More helpers than the pool has: spawned, all shares run.
        assert_eq!(h.run(3, || vec![1]).len(), 4);
        assert_eq!(h.run(0, || vec![1]).len(), 1);
    }

    #[test]
    fn shared_items_are_each_done_once_whoever_claims_them() {
        let h = CopyHelpers::new(3, "lunakv-unit");
        for n in [0, 1, 2, 5] {
            let mut got = h.share(n, (0..100u32).collect(), |i| [i, i + 1000]);
            got.sort_unstable();
            let mut want: Vec<u32> = (0..100).chain(1000..1100).collect();
            want.sort_unstable();
            assert_eq!(got, want, "{n} helpers");
        }
    }

    #[test]
    fn a_share_that_panics_panics_the_batch_and_gives_the_pool_back() {
        let h = CopyHelpers::new(2, "lunakv-copy");
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            h.run(1, || -> Vec<u8> {
                if std::thread::current().name() == Some("lunakv-copy") {
                    panic!("share failed");
                }
                vec![1]
            })
        }));
        assert!(r.is_err());
        let names = h.run(1, || {
            vec![std::thread::current().name() == Some("lunakv-copy")]
        });
        assert!(
            names.contains(&true),
            "the pool was given back after the panic"
        );
    }
}
