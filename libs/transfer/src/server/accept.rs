//! Accepting connections: one std thread per admitted connection (tcp or the shm socket),
//! admission by peer address, and the eviction of a slow peer's connection for a newcomer.

use std::io::BufReader;
use std::net::{IpAddr, Shutdown, TcpListener};
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::conn::{End, Stream, serve};
use super::state::{Live, READ_BUF, SEND_TIMEOUT, Shared, UNVERIFIED_BODY_BUDGET};
use crate::guard::{AcceptBackoff, Evicted, Paced, Refusal, Slot, peer_name};
use crate::table::PinId;
use crate::tune_socket;

pub(super) fn accept_tcp(shared: Arc<Shared>, listener: TcpListener) {
    let mut backoff = AcceptBackoff::new("tcp");
    loop {
        let conn = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        match conn {
            Ok((stream, peer)) => {
                backoff.succeeded();
                let Some(slot) = admit(&shared, Some(peer.ip())) else {
                    continue;
                };
                tune_socket(&stream);
                let _ = stream.set_write_timeout(Some(SEND_TIMEOUT));
                // Once per connection, so the request path pays nothing for it.
                let _ = stream.set_read_timeout(Some(shared.request_timeout));
                if let Ok(clone) = stream.try_clone() {
                    spawn_conn(&shared, stream, Live::Tcp(clone), false, slot);
                }
            }
            Err(e) => backoff.failed(&e),
        }
    }
}

pub(super) fn accept_unix(shared: Arc<Shared>, listener: UnixListener) {
    let mut backoff = AcceptBackoff::new("shm");
    loop {
        let conn = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        match conn {
            Ok((stream, _)) => {
                backoff.succeeded();
                let Some(slot) = admit(&shared, None) else {
                    continue;
                };
                let _ = stream.set_write_timeout(Some(SEND_TIMEOUT));
                if let Ok(clone) = stream.try_clone() {
                    spawn_conn(&shared, stream, Live::Unix(clone), true, slot);
                }
            }
            Err(e) => backoff.failed(&e),
        }
    }
}

/// A slot for a new connection from `peer` (`None`: the shm socket), or `None` after counting
/// and (rate-limited) logging the refusal; the caller then drops the stream, closing it.
fn admit(shared: &Shared, peer: Option<IpAddr>) -> Option<Slot> {
    let refusal = match shared.admission.admit(peer) {
        Ok((slot, evicted)) => {
            if let Some(ev) = evicted {
                evict(shared, ev, peer);
            }
            return Some(slot);
        }
        Err(r) => r,
    };
    shared
        .counters
        .conns_refused
        .fetch_add(1, Ordering::Relaxed);
    if let Some(suppressed) = shared.refused_log.check(peer) {
        let peer_is_tcp = peer.is_some();
        let peer = peer_name(peer);
        match refusal {
            Refusal::Peer { open, cap } => tracing::warn!(
                %peer, open, cap, suppressed,
                "refusing a transfer connection: this peer holds the most connections one peer may (see lunakv-store --transfer_max_conns_per_peer)"
            ),
            Refusal::Global { open, cap } if peer_is_tcp => tracing::warn!(
                %peer, open, cap, suppressed,
                "refusing a transfer connection: the server holds the most connections it may, every one from a requester that completed a valid request (see lunakv-store --transfer_max_conns)"
            ),
            Refusal::Global { open, cap } => tracing::warn!(
                %peer, open, cap, suppressed,
                "refusing an shm connection: the shm socket holds the most connections its share of the fd limit allows (raise `ulimit -n`)"
            ),
        }
    }
    None
}

/// Closes connection `ev`, which never completed a valid request, to admit one from
/// `newcomer` into a full tcp table. Its thread sees the shutdown and ends quietly.
fn evict(shared: &Shared, ev: Evicted, newcomer: Option<IpAddr>) {
    if let Some(Live::Tcp(s)) = shared.conns.lock().get(&ev.id) {
        let _ = s.shutdown(Shutdown::Both);
    }
    let c = &shared.counters;
    c.evicted.fetch_add(1, Ordering::Relaxed);
    c.conns_refused.fetch_add(1, Ordering::Relaxed);
    if let Some(suppressed) = shared.evicted_log.check(Some(ev.peer)) {
        tracing::warn!(
            peer = %ev.peer, newcomer = %peer_name(newcomer), cap = shared.admission.caps.tcp, suppressed,
            "closing a transfer connection that never completed a valid request, to admit a new one: the tcp table is full (strangers holding connections? lower lunakv-store --transfer_max_conns_per_peer, or keep the transfer port from untrusted networks)"
        );
    }
}

/// Registers the connection (so shutdown can close it) and serves it on its own thread, which
/// holds its admission `slot` until it ends.
fn spawn_conn<S: Stream + Send + 'static>(
    shared: &Arc<Shared>,
    stream: S,
    live: Live,
    unix: bool,
    slot: Slot,
) {
    let id = slot.id();
    shared.conns.lock().insert(id, live);
    let s = shared.clone();
    let r = std::thread::Builder::new()
        .name(
            if unix {
                "lunakv-seg-shm"
            } else {
                "lunakv-seg-tcp"
            }
            .into(),
        )
        .spawn(move || {
            run_conn(&s, stream, unix, slot);
            s.conns.lock().remove(&id);
        });
    if let Err(e) = r {
        if shared.refused_log.check(None).is_some() {
            tracing::warn!(error = %e, "cannot spawn a connection thread; dropping the connection");
        }
        shared
            .counters
            .conns_refused
            .fetch_add(1, Ordering::Relaxed);
        shared.conns.lock().remove(&id);
    }
}

fn run_conn<S: Stream>(shared: &Shared, stream: S, unix: bool, slot: Slot) {
    let mut pins: Vec<(u64, u64, u64, PinId)> = Vec::new();
    let end = match stream.clone_stream() {
        Ok(r) => serve(
            shared,
            // The shm socket's peers are the owner's group on this host, and its requests
            // carry no bodies: only tcp requests have a deadline.
            BufReader::with_capacity(
                READ_BUF,
                Paced::new(r, (!unix).then_some(shared.request_timeout)),
            ),
            stream,
            unix,
            &mut pins,
            &slot,
        )
        .err()
        .unwrap_or(End::Closed),
        Err(e) => End::Io(e),
    };
    // A connection that dies releases its pins, so FREE never waits on a crashed reader.
    for (_, _, _, pin) in pins {
        shared.table.unpin(pin);
    }
    let peer = slot.peer();
    match end {
        End::Closed => {}
        // Closed for a newcomer: admission counted and logged it.
        _ if slot.evicted() => {}
        End::Io(e) => tracing::debug!(error = %e, "transfer connection closed"),
        End::Garbage(why) => {
            shared.counters.bad_frames.fetch_add(1, Ordering::Relaxed);
            if let Some(suppressed) = shared.bad_frame_log.check(peer) {
                tracing::warn!(peer = %peer_name(peer), %why, suppressed, "closing a transfer connection that sent a bad frame");
            }
        }
        End::TooSlow => {
            shared.counters.bad_frames.fetch_add(1, Ordering::Relaxed);
            shared.counters.too_slow.fetch_add(1, Ordering::Relaxed);
            if let Some(suppressed) = shared.slow_log.check(peer) {
                tracing::warn!(
                    peer = %peer_name(peer), deadline_ms = shared.request_timeout.as_millis() as u64,
                    min_rate_bytes_per_sec = crate::guard::MIN_REQUEST_RATE, suppressed,
                    "closing a transfer connection whose request did not arrive whole in time (a peer trickling bytes holds a connection though never idle; the deadline is lunakv-store --transfer_idle_timeout_sec when shorter than 30 s)"
                );
            }
        }
        End::Busy => {
            if let Some(suppressed) = shared.slow_log.check(peer) {
                tracing::warn!(
                    peer = %peer_name(peer), budget_bytes = UNVERIFIED_BODY_BUDGET, suppressed,
                    "closing a transfer connection: FREE/OFFLOAD bodies not yet authenticated hold their whole budget (replayed master requests? keep the transfer port from untrusted networks)"
                );
            }
        }
    }
    drop(slot);
}
