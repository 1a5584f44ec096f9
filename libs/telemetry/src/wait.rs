//! Waiting for a peer at startup (the master, etcd, a decode engine) without crash-looping and
//! without flooding the log.
//!
//! A service started before its peer used to exit at once, so a Kubernetes DaemonSet or a
//! compose stack restarted it in a loop until the peer came up, or it logged one warning per
//! attempt. [`PeerWait`] is the shared policy instead: retry with [`Backoff`] (100 ms doubling
//! to 2 s), one WARN line when the wait starts (naming the peer and what for), then at most one
//! every [`REPORT_EVERY`] while still waiting, and one INFO line once the peer answers. What
//! retrying cannot fix (a bad address, a refusal) is the caller's to return at once.

use std::fmt::Display;
use std::time::{Duration, Instant};

/// First retry delay.
pub const FIRST_RETRY: Duration = Duration::from_millis(100);
/// Longest retry delay: a peer that comes up is noticed within this.
pub const MAX_RETRY: Duration = Duration::from_secs(2);
/// While still waiting, one line per this period.
pub const REPORT_EVERY: Duration = Duration::from_secs(30);

/// Retry delays: [`FIRST_RETRY`] doubling up to [`MAX_RETRY`] (by default).
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
    max: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::new(FIRST_RETRY, MAX_RETRY)
    }
}

impl Backoff {
    pub fn new(first: Duration, max: Duration) -> Backoff {
        Backoff { next: first, max }
    }

    /// The delay before the next attempt; each call doubles the following one up to the max.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next.min(self.max);
        self.next = (self.next * 2).min(self.max);
        d
    }
}

/// At most one report per period: the first call is always ready.
#[derive(Debug, Clone)]
pub struct Throttle {
    every: Duration,
    last: Option<Instant>,
}

impl Throttle {
    pub fn new(every: Duration) -> Throttle {
        Throttle { every, last: None }
    }

    /// Whether a report may go out at `now`; if so, the period starts again from `now`.
    pub fn ready(&mut self, now: Instant) -> bool {
        match self.last {
            Some(last) if now.saturating_duration_since(last) < self.every => false,
            _ => {
                self.last = Some(now);
                true
            }
        }
    }
}

/// One startup wait for one peer; see the module docs for what it logs.
#[derive(Debug)]
pub struct PeerWait {
    peer: String,
    purpose: String,
    limit: Option<Duration>,
    started: Instant,
    failures: u64,
    since_report: u64,
    backoff: Backoff,
    throttle: Throttle,
}

/// What [`PeerWait`] decided about one failure (also what its unit tests check).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Retry after this delay; the failure was logged (WARN).
    RetryLogged(Duration),
    /// Retry after this delay; nothing logged (a report went out less than 30 s ago).
    Retry(Duration),
    /// The wait's limit is spent: give up and report the error.
    GiveUp,
}

impl PeerWait {
    /// A wait for `peer` (e.g. "lunakv-master at 10.0.0.5:50051"), `purpose` saying what for
    /// (e.g. "to mount segment 10.0.0.7:50052"). Waits until told to stop unless
    /// [`PeerWait::limit`] says otherwise.
    pub fn new(peer: impl Into<String>, purpose: impl Into<String>) -> PeerWait {
        PeerWait {
            peer: peer.into(),
            purpose: purpose.into(),
            limit: None,
            started: Instant::now(),
            failures: 0,
            since_report: 0,
            backoff: Backoff::default(),
            throttle: Throttle::new(REPORT_EVERY),
        }
    }

    /// Give up once `limit` has passed since the wait started (`Some(ZERO)`: after the first
    /// failure, without logging it; `None`: never).
    pub fn limit(mut self, limit: Option<Duration>) -> PeerWait {
        self.limit = limit;
        self
    }

    /// Failed attempts so far.
    pub fn failures(&self) -> u64 {
        self.failures
    }

    /// How long this wait has lasted.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Records a failure that waiting can fix and logs it per the policy.
    pub fn failed(&mut self, error: &dyn Display) -> Verdict {
        self.failed_at(Instant::now(), error)
    }

    /// [`PeerWait::failed`] at a given instant (tests drive the clock).
    pub fn failed_at(&mut self, now: Instant, error: &dyn Display) -> Verdict {
        let waited = now.saturating_duration_since(self.started);
        let left = match self.limit {
            Some(limit) if waited >= limit => return Verdict::GiveUp,
            Some(limit) => Some(limit - waited),
            None => None,
        };
        self.failures += 1;
        self.since_report += 1;
        let delay = self.backoff.next_delay();
        let delay = left.map_or(delay, |l| delay.min(l));
        if !self.throttle.ready(now) {
            tracing::debug!(error = %error, "still waiting for {}", self.peer);
            return Verdict::Retry(delay);
        }
        if self.failures == 1 {
            let until = match self.limit {
                Some(l) => format!("for up to {} s", l.as_secs_f64().ceil() as u64),
                None => "until it answers or this process is stopped".to_string(),
            };
            tracing::warn!(
                "waiting for {} {}: {error}; retrying {until} (backoff {} ms to {} s), \
                 next report in {} s",
                self.peer,
                self.purpose,
                FIRST_RETRY.as_millis(),
                MAX_RETRY.as_secs(),
                REPORT_EVERY.as_secs()
            );
        } else {
            tracing::warn!(
                "still waiting for {} {} after {} s ({} failed attempts since the last report): \
                 {error}",
                self.peer,
                self.purpose,
                waited.as_secs(),
                self.since_report
            );
        }
        self.since_report = 0;
        Verdict::RetryLogged(delay)
    }

    /// [`PeerWait::failed`], then sleeps the delay; false when the limit is spent (nothing
    /// slept: the caller returns its error).
    pub async fn retry_after(&mut self, error: &dyn Display) -> bool {
        match self.failed(error) {
            Verdict::GiveUp => false,
            Verdict::Retry(d) | Verdict::RetryLogged(d) => {
                tokio::time::sleep(d).await;
                true
            }
        }
    }

    /// The peer answered: one INFO line if this wait had to wait at all.
    pub fn reached(&self) {
        if self.failures > 0 {
            tracing::info!(
                "{} answered after {:.1} s of waiting ({} failed attempts)",
                self.peer,
                self.started.elapsed().as_secs_f64(),
                self.failures
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_100ms_to_2s() {
        let mut b = Backoff::default();
        let ms: Vec<u128> = (0..8).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(ms, [100, 200, 400, 800, 1600, 2000, 2000, 2000]);
    }

    #[test]
    fn throttle_lets_one_report_through_per_period() {
        let t0 = Instant::now();
        let mut t = Throttle::new(Duration::from_secs(30));
        assert!(t.ready(t0));
        assert!(!t.ready(t0 + Duration::from_secs(29)));
        assert!(t.ready(t0 + Duration::from_secs(30)));
        assert!(!t.ready(t0 + Duration::from_secs(31)));
    }

    #[test]
    fn logs_once_then_every_30s() {
        let mut w = PeerWait::new("peer", "to test");
        let t0 = w.started;
        let e = "refused";
        assert!(matches!(w.failed_at(t0, &e), Verdict::RetryLogged(_)));
        // A minute of retries every 2 s: one more line at 30 s, one at 60 s.
        let logged = (1..=30)
            .map(|i| w.failed_at(t0 + Duration::from_secs(2 * i), &e))
            .filter(|v| matches!(v, Verdict::RetryLogged(_)))
            .count();
        assert_eq!(logged, 2);
        assert_eq!(w.failures(), 31);
    }

    #[test]
    fn a_limit_gives_up_and_caps_the_last_delay() {
        let mut w = PeerWait::new("peer", "to test").limit(Some(Duration::from_millis(150)));
        let t0 = w.started;
        assert_eq!(w.failed_at(t0, &"x"), Verdict::RetryLogged(FIRST_RETRY));
        // 50 ms left: the 200 ms delay is cut to it.
        assert_eq!(
            w.failed_at(t0 + Duration::from_millis(100), &"x"),
            Verdict::Retry(Duration::from_millis(50))
        );
        assert_eq!(
            w.failed_at(t0 + Duration::from_millis(150), &"x"),
            Verdict::GiveUp
        );
        // No wait at all: the first failure is the answer, and is not logged here.
        let mut now = PeerWait::new("peer", "to test").limit(Some(Duration::ZERO));
        assert_eq!(now.failed(&"x"), Verdict::GiveUp);
        assert_eq!(now.failures(), 0);
    }
}
