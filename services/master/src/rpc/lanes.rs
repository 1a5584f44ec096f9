//! Threads that each run a current-thread runtime, for the quick connections
//! ([`crate::rpc::quick`]): a connection lives on one thread, whose own epoll wakes it.
//!
//! On the shared multi-thread runtime one worker waits in epoll for every socket and hands a
//! ready connection to a parked sibling through a futex: a thread switch per frame that a
//! perf profile of the master under `bench_meta.py` put at about 8% of its CPU (the
//! `futex_wake` and `park_condvar` stacks, docs/BENCH.md, "Metadata"). A lane is one thread
//! per core, and connections are dealt to the lanes in turn.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::runtime::{Builder, Handle};
use tokio::sync::oneshot;

/// The lanes' runtimes; spawning onto them needs no runtime context.
pub(crate) struct Lanes {
    handles: Vec<Handle>,
    next: AtomicUsize,
}

/// Stops the lanes when dropped: each thread leaves its runtime, whose tasks (the quick
/// connections) are dropped, closing their sockets. The drop returns once every lane thread
/// has ended, so a stopped master holds nothing of its state (its meta store's file lock, in
/// particular, which a master restarted in the same process takes again).
pub(crate) struct LanesGuard {
    stops: Vec<oneshot::Sender<()>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Drop for LanesGuard {
    fn drop(&mut self) {
        self.stops.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Lanes {
    /// Starts `n` (at least one) lane threads named `quick-<i>`.
    pub(crate) fn start(n: usize) -> std::io::Result<(Lanes, LanesGuard)> {
        let n = n.max(1);
        let (mut handles, mut stops) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let mut threads = Vec::with_capacity(n);
        for i in 0..n {
            let rt = Builder::new_current_thread().enable_all().build()?;
            handles.push(rt.handle().clone());
            let (stop, stopped) = oneshot::channel::<()>();
            stops.push(stop);
            let thread = std::thread::Builder::new()
                .name(format!("quick-{i}"))
                .spawn(move || {
                    // Returns when the guard drops its sender; dropping the runtime then drops
                    // every connection task still on it.
                    rt.block_on(async {
                        let _ = stopped.await;
                    });
                })?;
            threads.push(thread);
        }
        Ok((
            Lanes {
                handles,
                next: AtomicUsize::new(0),
            },
            LanesGuard { stops, threads },
        ))
    }

    /// Runs `task` on the next lane. After the lanes stopped, `task` is dropped unrun.
    pub(crate) fn spawn<F>(&self, task: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        drop(self.handles[i].spawn(task));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn tasks_are_dealt_in_turn_and_dropped_when_the_lanes_stop() {
        let (lanes, guard) = Lanes::start(2).expect("lanes");
        let (tx, rx) = mpsc::channel();
        for _ in 0..4 {
            let tx = tx.clone();
            lanes.spawn(async move {
                let name = std::thread::current().name().map(str::to_owned);
                tx.send(name).expect("send");
            });
        }
        let mut names: Vec<_> = (0..4)
            .map(|_| {
                rx.recv_timeout(std::time::Duration::from_secs(5))
                    .expect("ran")
            })
            .map(Option::unwrap_or_default)
            .collect();
        names.sort();
        assert_eq!(names, ["quick-0", "quick-0", "quick-1", "quick-1"]);

        // A task that never ends is dropped with its lane's runtime: its guard reports it.
        let (dropped_tx, dropped_rx) = mpsc::channel::<()>();
        struct OnDrop(mpsc::Sender<()>);
        impl Drop for OnDrop {
            fn drop(&mut self) {
                let _ = self.0.send(());
            }
        }
        let held = OnDrop(dropped_tx);
        lanes.spawn(async move {
            let _held = held;
            std::future::pending::<()>().await;
        });
        drop(guard);
        dropped_rx
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("the pending task is dropped when the lanes stop");

        // Spawning after the stop drops the task unrun, without a panic.
        let (late_tx, late_rx) = mpsc::channel::<()>();
        lanes.spawn(async move {
            let _ = late_tx.send(());
        });
        assert!(
            late_rx
                .recv_timeout(std::time::Duration::from_millis(200))
                .is_err()
        );
    }
}
