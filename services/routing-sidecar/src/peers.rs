//! Which upstreams (the decode engine, prefill engines, their bootstrap servers) cannot be
//! connected to, logged without flooding.
//!
//! The sidecar starts with its pod, usually minutes before vLLM has loaded its model, and every
//! request in that time (llm-d's scheduler scraping `/metrics` through it, a probe, a client)
//! used to log one WARN line. Now the first connection failure to a peer logs one WARN line
//! naming it, further failures are counted and reported at most every [`REPORT_EVERY`], and the
//! first success logs one INFO line. [`wait_for_decoder`] makes the decode engine's startup
//! visible the same way before any request arrives. Failures that are not connection failures
//! (an engine answering 500) are still logged per request by the proxy.

use std::collections::HashMap;
use std::fmt::Display;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use lunakv_telemetry::wait::{Backoff, REPORT_EVERY, Throttle};
use parking_lot::Mutex;

/// Peers tracked by name at once; beyond that they share one entry (one line per period).
const MAX_TRACKED: usize = 1024;
/// The shared entry's name.
const OTHERS: &str = "<other peers>";
/// One TCP connect attempt of [`wait_for_decoder`].
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Role names, as they appear in log lines.
pub const DECODE_ENGINE: &str = "decode engine";
pub const PREFILL_ENGINE: &str = "prefill engine";
pub const PREFILL_BOOTSTRAP: &str = "prefill bootstrap";

#[derive(Debug)]
struct Down {
    since: Instant,
    failures: u64,
    since_report: u64,
    throttle: Throttle,
}

/// What [`PeerLog::unreachable`] did, for tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logged {
    /// The first failure: one WARN line.
    First,
    /// A report after the period: one WARN line with the count.
    Again,
    /// Counted only.
    Quiet,
}

/// Unreachable peers; see the module docs.
#[derive(Debug)]
pub struct PeerLog {
    every: Duration,
    down: Mutex<HashMap<String, Down>>,
    /// Entries in `down`: a success checks this one atomic before taking the lock.
    n_down: AtomicUsize,
}

impl Default for PeerLog {
    fn default() -> Self {
        PeerLog::new(REPORT_EVERY)
    }
}

impl PeerLog {
    pub fn new(every: Duration) -> PeerLog {
        PeerLog {
            every,
            down: Mutex::new(HashMap::new()),
            n_down: AtomicUsize::new(0),
        }
    }

    /// A connection to `peer` (a `role`) failed with `error`.
    pub fn unreachable(&self, role: &str, peer: &str, error: &dyn Display) -> Logged {
        self.unreachable_at(Instant::now(), role, peer, error)
    }

    fn unreachable_at(&self, now: Instant, role: &str, peer: &str, error: &dyn Display) -> Logged {
        let mut down = self.down.lock();
        let key = if down.len() >= MAX_TRACKED && !down.contains_key(peer) {
            OTHERS
        } else {
            peer
        };
        let d = match down.get_mut(key) {
            Some(d) => d,
            None => {
                let mut throttle = Throttle::new(self.every);
                throttle.ready(now);
                down.insert(
                    key.to_string(),
                    Down {
                        since: now,
                        failures: 1,
                        since_report: 0,
                        throttle,
                    },
                );
                self.n_down.store(down.len(), Ordering::Relaxed);
                tracing::warn!(
                    "{role} at {peer} is unreachable ({error}); requests that need it fail until \
                     it answers (an engine may still be loading its model). Further failures \
                     are counted and reported at most every {} s",
                    self.every.as_secs()
                );
                return Logged::First;
            }
        };
        d.failures += 1;
        d.since_report += 1;
        if !d.throttle.ready(now) {
            tracing::debug!(%peer, %error, "{role} still unreachable");
            return Logged::Quiet;
        }
        tracing::warn!(
            "{role} at {peer} still unreachable after {} s ({} failures since the last report): \
             {error}",
            now.saturating_duration_since(d.since).as_secs(),
            d.since_report
        );
        d.since_report = 0;
        Logged::Again
    }

    /// A connection to `peer` worked: one INFO line if it was unreachable.
    pub fn reachable(&self, role: &str, peer: &str) {
        // The hot path: nothing is down, no lock.
        if self.n_down.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut down = self.down.lock();
        if let Some(d) = down.remove(peer) {
            self.n_down.store(down.len(), Ordering::Relaxed);
            drop(down);
            tracing::info!(
                "{role} at {peer} is reachable (was unreachable for {:.1} s, {} failures)",
                d.since.elapsed().as_secs_f64(),
                d.failures
            );
        }
    }

    pub fn is_down(&self, peer: &str) -> bool {
        self.n_down.load(Ordering::Relaxed) > 0 && self.down.lock().contains_key(peer)
    }
}

/// Dials the decode engine (`authority`, logged as `peer`) with backoff until it accepts a
/// connection, so its startup shows in the log (one WARN line, one every 30 s, one INFO line)
/// before any request arrives. Ends at the first success, or at once when a request got
/// through first.
pub async fn wait_for_decoder(peers: Arc<PeerLog>, authority: String, peer: String) {
    let mut backoff = Backoff::default();
    loop {
        let error =
            match tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(&authority))
                .await
            {
                Ok(Ok(_)) => {
                    peers.reachable(DECODE_ENGINE, &peer);
                    return;
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no answer to a TCP connect within {PROBE_TIMEOUT:?}"),
            };
        peers.unreachable(DECODE_ENGINE, &peer, &error);
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_then_one_per_period_then_one_when_back() {
        let log = PeerLog::new(Duration::from_secs(30));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(
            log.unreachable_at(t0, "decode engine", "d", &"refused"),
            Logged::First
        );
        // A request a second for a minute: two more lines (at 30 s and 60 s).
        let lines = (1..=60)
            .map(|s| log.unreachable_at(at(s), "decode engine", "d", &"refused"))
            .filter(|l| *l != Logged::Quiet)
            .count();
        assert_eq!(lines, 2);
        // Each peer has its own count.
        assert_eq!(
            log.unreachable_at(at(61), "prefill engine", "p", &"x"),
            Logged::First
        );
        assert!(log.is_down("d") && log.is_down("p"));
        log.reachable("decode engine", "d");
        assert!(!log.is_down("d") && log.is_down("p"));
        // Down again later: a first line again.
        assert_eq!(
            log.unreachable_at(at(90), "decode engine", "d", &"x"),
            Logged::First
        );
    }

    #[test]
    fn peers_beyond_the_cap_share_one_entry() {
        let log = PeerLog::new(Duration::from_secs(30));
        let t0 = Instant::now();
        for i in 0..MAX_TRACKED {
            log.unreachable_at(t0, "prefill engine", &format!("p{i}"), &"x");
        }
        assert_eq!(
            log.unreachable_at(t0, "prefill engine", "new1", &"x"),
            Logged::First
        );
        assert_eq!(
            log.unreachable_at(t0, "prefill engine", "new2", &"x"),
            Logged::Quiet
        );
        assert_eq!(log.down.lock().len(), MAX_TRACKED + 1);
    }
}
