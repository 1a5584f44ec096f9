//! The owner's heartbeat: one Ping per interval, which reports touched keys, what the disk tier
//! dropped and drain results, takes drain moves, and re-mounts when the master asks.

use std::time::Duration;

use lunakv_master_client::MasterLink;
use lunakv_proto::master as pb;
use lunakv_transfer::ProtocolChoice;
use tokio::sync::watch;

use crate::mount::Mounter;

/// Most keys reported per Ping; the rest wait for the next one.
const TOUCHED_KEYS_PER_PING: usize = 10_000;

pub(crate) async fn heartbeat(m: Mounter, every: Duration, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut healthy = true;
    // A new HA leader knows nobody: ping it at once (it answers remount_required and the
    // inventory goes over) instead of waiting for the next tick.
    let mut leader_changed = m.master.subscribe();
    // Right after a leader change the new leader may not serve yet (its election is still
    // settling): retry quickly for a moment instead of waiting for the next tick.
    let mut changed_at: Option<tokio::time::Instant> = None;
    // Drain jobs: the moves the master handed this owner, copied beside the heartbeat and
    // reported in the Ping after they ended.
    let mut drain = crate::drain::DrainWork::new(m.server.clone());
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            // Report at once and take the next moves.
            _ = drain.finished() => {}
            _ = leader_changed.changed() => changed_at = Some(tokio::time::Instant::now()),
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        let touched = m
            .server
            .as_ref()
            .map(|s| s.take_touched_keys(TOUCHED_KEYS_PER_PING))
            .unwrap_or_default();
        let dropped: Vec<pb::InventoryItem> = m
            .disk
            .as_ref()
            .map(|d| d.take_dropped())
            .unwrap_or_default()
            .into_iter()
            .map(|(key, generation, size)| pb::InventoryItem {
                key,
                offset: 0,
                size,
                generation,
                kind: pb::ReplicaKind::LocalDisk as i32,
                proof: Vec::new(),
            })
            .collect();
        let req = pb::PingRequest {
            client_id: m.client_id.clone(),
            touched_keys: touched,
            disk_dropped: dropped,
            mounted_segments: m
                .server
                .as_ref()
                .map(|s| vec![s.info().name])
                .unwrap_or_default(),
            drain_results: std::mem::take(&mut drain.results),
        };
        // Kept until a Ping carried them: a lost report would leave the master waiting for
        // the move's timeout.
        let sent_results = req.drain_results.clone();
        // One attempt per tick (the next tick retries); the ping of a paused leader is
        // abandoned as soon as the leader key names another master.
        let mut client = m.master.client();
        let ping = tokio::time::timeout(every * 3, client.ping(req));
        let outcome = tokio::select! {
            r = ping => Some(r),
            _ = leader_changed.changed() => None,
        };
        if !matches!(outcome, Some(Ok(Ok(_)))) {
            drain.results.splice(0..0, sent_results);
        }
        let Some(outcome) = outcome else {
            // Ping the new leader right away.
            changed_at = Some(tokio::time::Instant::now());
            tick.reset_immediately();
            continue;
        };
        if outcome.as_ref().is_ok_and(|r| r.is_err())
            && changed_at.is_some_and(|t| t.elapsed() < LEADER_SETTLE)
        {
            tick.reset_after(LEADER_SETTLE_RETRY);
        }
        match outcome {
            Ok(Ok(resp)) => {
                if !healthy {
                    tracing::info!(master = %m.master.addr(), "master reachable again");
                    healthy = true;
                }
                let resp = resp.into_inner();
                if !resp.drain_moves.is_empty() {
                    drain.start(crate::drain::Move::resolve_all(
                        resp.drain_moves,
                        &resp.segments,
                    ));
                }
                if resp.next_ping_ms > 0 {
                    tick.reset_after(Duration::from_millis(u64::from(resp.next_ping_ms)));
                }
                if resp.remount_required && m.server.is_some() {
                    // Not ready until the new master knows the segment again.
                    m.status.set(false);
                    tracing::warn!(master = %m.master.addr(), "master does not know this client (restarted, or a new HA leader): mounting again with inventory");
                    if let Err(e) = m.mount().await {
                        tracing::warn!(error = %e, "re-mount failed; retrying on the next ping");
                    }
                }
            }
            Ok(Err(status)) => {
                m.master.follow_redirect(&status);
                if healthy {
                    tracing::warn!(master = %m.master.addr(), error = %status.message(), "ping failed; will keep trying");
                    healthy = false;
                }
            }
            Err(_) => {
                if healthy {
                    tracing::warn!(master = %m.master.addr(), "ping timed out; will keep trying");
                    healthy = false;
                }
            }
        }
    }
}

/// How long after a leader change a failed ping is retried every [`LEADER_SETTLE_RETRY`].
const LEADER_SETTLE: Duration = Duration::from_secs(3);
const LEADER_SETTLE_RETRY: Duration = Duration::from_millis(50);

/// The heartbeat of a pure requester, which has no segment: it pings so that the master counts
/// it among active clients. Returns once `stop` turns true.
pub async fn requester_heartbeat(
    master: MasterLink,
    client_id: String,
    cluster_id: String,
    protocol: ProtocolChoice,
    every: Duration,
    stop: watch::Receiver<bool>,
) {
    let m = Mounter {
        master,
        client_id,
        cluster_id,
        protocol,
        enable_offload: false,
        server: None,
        disk: None,
        status: Default::default(),
    };
    heartbeat(m, every, stop).await
}
