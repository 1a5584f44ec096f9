//! The MooncakeConnector half of the simulator: bootstrap registration (prefill), the side
//! channel where a decoder hands over its buffer descriptors (prefill), and the pull (decode).
//!
//! Flow, as vLLM's MooncakeConnector does it:
//! 1. The prefill engine registers `{engine_id, dp_rank, tp_rank, pp_rank, addr}` with the
//!    bootstrap and renews it; `addr` is this simulator's side channel (its HTTP address).
//! 2. A prefill request with `kv_transfer_params.do_remote_decode` computes the KV and parks it
//!    under its `transfer_id`.
//! 3. The decode engine queries the bootstrap, finds `remote_engine_id`'s worker, registers a
//!    receive region with its [`RegionServer`](lunakv_transfer::RegionServer), and POSTs `/sim/kv/transfer` with the
//!    transfer_id, its region endpoint and one address per block.
//! 4. The prefill engine waits for that transfer_id's prefill, WRITES the blocks into the
//!    decoder's region through `TransferEngine::batch_raw`, and answers FINISH (or ERROR).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use hyper::Method;
use lunakv_telemetry::wait::{MAX_RETRY, PeerWait, Verdict};
use lunakv_transfer::RawRequest;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::watch;

use crate::Sim;
use crate::client::CallError;

/// The side-channel message a decoder sends (vLLM's transfer metadata, simplified).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TransferRequestMsg {
    pub transfer_id: String,
    /// The engine the decoder expects to talk to (from `remote_engine_id`).
    pub remote_engine_id: String,
    pub decode_engine_id: String,
    /// The decoder's RegionServer, `host:port`.
    pub endpoint: String,
    /// Absolute address of each block in the decoder's registered memory.
    pub block_addrs: Vec<u64>,
    pub block_len: u64,
}

/// Why a transfer failed (turned into an ERROR answer or a decode error).
#[derive(Debug, thiserror::Error)]
pub enum PdError {
    #[error("bootstrap query failed: {0}")]
    Bootstrap(CallError),
    #[error("engine {0} is not registered with the bootstrap at {1}")]
    UnknownEngine(String, String),
    #[error("side channel to the prefill engine failed: {0}")]
    SideChannel(CallError),
    #[error("prefill engine answered ERROR: {0}")]
    Remote(String),
    #[error("local transfer setup failed: {0}")]
    Local(String),
}

/// Parked KV of one transfer_id: `None` until the prefill of it is done.
type Slot = watch::Sender<Option<Arc<Vec<u8>>>>;

/// Prefill-side state: KV waiting for its decoder.
#[derive(Default)]
pub struct Parked {
    slots: Mutex<HashMap<String, (Slot, Instant)>>,
}

impl Parked {
    fn slot(&self, id: &str) -> watch::Receiver<Option<Arc<Vec<u8>>>> {
        let mut s = self.slots.lock();
        s.entry(id.to_string())
            .or_insert_with(|| (watch::channel(None).0, Instant::now()))
            .0
            .subscribe()
    }

    /// Parks the KV of `id` (the prefill is done).
    pub fn put(&self, id: &str, kv: Vec<u8>) {
        let mut s = self.slots.lock();
        let e = s
            .entry(id.to_string())
            .or_insert_with(|| (watch::channel(None).0, Instant::now()));
        e.1 = Instant::now();
        e.0.send_replace(Some(Arc::new(kv)));
    }

    fn remove(&self, id: &str) {
        self.slots.lock().remove(id);
    }

    /// Drops transfers nobody collected within `ttl` (vLLM aborts them after 480 s).
    pub fn sweep(&self, ttl: Duration) {
        self.slots.lock().retain(|_, (_, at)| at.elapsed() < ttl);
    }

    pub fn len(&self) -> usize {
        self.slots.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Registers with the bootstrap and renews the lease until the process ends.
pub async fn register_loop(sim: Arc<Sim>, bootstrap: String) {
    let url = format!("{}/register", bootstrap.trim_end_matches('/'));
    let body = json!({
        "engine_id": sim.cfg.engine_id,
        "dp_rank": sim.cfg.dp_rank,
        "tp_rank": 0,
        "pp_rank": 0,
        "addr": format!("tcp://{}", sim.http_addr),
        "lease_ttl_ms": sim.cfg.lease.as_millis() as u64,
    });
    let renew_every = (sim.cfg.lease / 3).max(Duration::from_millis(50));
    // The bootstrap may come up after this engine (compose starts it beside the prefill engine,
    // once etcd is healthy): retry with backoff and warn once per wait, not once per attempt.
    let peer = format!("the bootstrap at {}", bootstrap.trim_end_matches('/'));
    let mut wait = Some(PeerWait::new(
        peer.clone(),
        format!("to register engine {}", sim.cfg.engine_id),
    ));
    loop {
        match sim
            .client
            .call(Method::POST, &url, Some(&body), Duration::from_secs(3))
            .await
        {
            Ok(_) => {
                if let Some(w) = wait.take() {
                    w.reached();
                    tracing::info!(%url, engine_id = %sim.cfg.engine_id, "registered with the bootstrap");
                    sim.registered.store(true, Ordering::SeqCst);
                }
                tokio::time::sleep(renew_every).await;
            }
            Err(e) => {
                // A renewal that fails starts a new wait (its lease runs out meanwhile).
                let w = wait.get_or_insert_with(|| {
                    PeerWait::new(
                        peer.clone(),
                        format!("to renew the registration of engine {}", sim.cfg.engine_id),
                    )
                });
                // Decided before the await: `retry_after` would hold a `&dyn Display` across it,
                // and this loop runs on a spawned (Send) task.
                let delay = match w.failed(&e) {
                    Verdict::Retry(d) | Verdict::RetryLogged(d) => d,
                    Verdict::GiveUp => MAX_RETRY,
                };
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// Prefill side: serves one side-channel request; returns the JSON answer.
pub async fn serve_transfer(sim: Arc<Sim>, msg: TransferRequestMsg) -> serde_json::Value {
    let err = |m: String| json!({ "status": "ERROR", "message": m });
    if msg.remote_engine_id != sim.cfg.engine_id {
        return err(format!(
            "engine id mismatch: this is {}, the decoder expected {}",
            sim.cfg.engine_id, msg.remote_engine_id
        ));
    }
    // Wait for our prefill of this transfer_id (the decoder may ask first).
    let mut rx = sim.parked.slot(&msg.transfer_id);
    let kv = tokio::time::timeout(sim.cfg.transfer_timeout, async {
        loop {
            if let Some(kv) = rx.borrow_and_update().clone() {
                return Some(kv);
            }
            if rx.changed().await.is_err() {
                return None;
            }
        }
    })
    .await;
    let kv = match kv {
        Ok(Some(kv)) => kv,
        Ok(None) => return err("transfer was dropped".into()),
        Err(_) => {
            sim.parked.remove(&msg.transfer_id);
            return err(format!(
                "no prefill for transfer {} within {:?}",
                msg.transfer_id, sim.cfg.transfer_timeout
            ));
        }
    };
    let bl = msg.block_len as usize;
    let need = msg.block_addrs.len() * bl;
    if bl == 0 || need > kv.len() {
        return err(format!(
            "decoder asked for {} blocks of {} bytes, prefill has {} bytes",
            msg.block_addrs.len(),
            bl,
            kv.len()
        ));
    }
    let engine = sim.transfer.clone();
    let endpoint = msg.endpoint.clone();
    let addrs = msg.block_addrs.clone();
    let kv2 = kv.clone();
    // The KV write into the decoder's memory: one span, parent of the decoder's RAW_WRITEs.
    let span = lunakv_telemetry::trace_span(|| {
        tracing::info_span!(
            "kv_write",
            otel.kind = "client",
            blocks = addrs.len(),
            bytes = need
        )
    });
    let res = tokio::task::spawn_blocking(move || {
        let _in_span = span.enter();
        let mut reqs: Vec<RawRequest<'_>> = addrs
            .iter()
            .enumerate()
            .map(|(i, a)| RawRequest::Write {
                endpoint: &endpoint,
                remote_addr: *a,
                src: vec![&kv2[i * bl..(i + 1) * bl]],
            })
            .collect();
        let out = engine.batch_raw(&mut reqs);
        out.into_iter().find_map(|r| r.err()).map(|e| e.to_string())
    })
    .await;
    match res {
        Ok(None) => {
            sim.parked.remove(&msg.transfer_id);
            sim.stats.kv_bytes_sent.inc_by(need as u64);
            sim.stats.transfers_ok.inc();
            json!({ "status": "FINISH" })
        }
        Ok(Some(e)) => {
            sim.stats.transfers_failed.inc();
            err(format!("writing KV into the decoder failed: {e}"))
        }
        Err(e) => err(format!("transfer task failed: {e}")),
    }
}

/// Where the decoder finds the prefill engine's side channel.
pub enum Remote {
    /// MooncakeConnector: resolve `engine_id` through the bootstrap.
    Bootstrap {
        bootstrap_addr: String,
        engine_id: String,
        transfer_id: String,
    },
    /// NIXL-style params: the prefiller's address is in the params.
    Direct {
        host: String,
        port: u16,
        engine_id: String,
        transfer_id: String,
    },
}

/// Decode side: pulls the KV of a `blocks`-block prompt from the remote prefill engine.
pub async fn pull(sim: &Arc<Sim>, remote: Remote, blocks: usize) -> Result<Vec<u8>, PdError> {
    let (side_channel, engine_id, transfer_id) = match remote {
        Remote::Bootstrap {
            bootstrap_addr,
            engine_id,
            transfer_id,
        } => {
            let url = format!("{}/query", bootstrap_addr.trim_end_matches('/'));
            let table = sim
                .client
                .call(Method::GET, &url, None, Duration::from_secs(5))
                .await
                .map_err(PdError::Bootstrap)?;
            let addr = table
                .as_object()
                .into_iter()
                .flat_map(|m| m.values())
                .find(|e| e.get("engine_id").and_then(|v| v.as_str()) == Some(engine_id.as_str()))
                .and_then(|e| e.pointer("/worker_addr/0/0"))
                .and_then(|v| v.as_str())
                .ok_or_else(|| PdError::UnknownEngine(engine_id.clone(), bootstrap_addr.clone()))?;
            let hp = addr
                .trim_start_matches("tcp://")
                .trim_start_matches("http://");
            (format!("http://{hp}"), engine_id, transfer_id)
        }
        Remote::Direct {
            host,
            port,
            engine_id,
            transfer_id,
        } => (format!("http://{host}:{port}"), engine_id, transfer_id),
    };
    let bl = sim.cfg.shape.block_bytes;
    let region = sim
        .registry
        .alloc(blocks.max(1) * bl)
        .map_err(|e| PdError::Local(e.to_string()))?;
    let msg = TransferRequestMsg {
        transfer_id,
        remote_engine_id: engine_id,
        decode_engine_id: sim.cfg.engine_id.clone(),
        endpoint: sim.region_endpoint.clone(),
        block_addrs: (0..blocks)
            .map(|i| region.addr() + (i * bl) as u64)
            .collect(),
        block_len: bl as u64,
    };
    let body = serde_json::to_value(&msg).map_err(|e| PdError::Local(e.to_string()))?;
    let answer = sim
        .client
        .call(
            Method::POST,
            &format!("{side_channel}/sim/kv/transfer"),
            Some(&body),
            sim.cfg.transfer_timeout + Duration::from_secs(5),
        )
        .await
        .map_err(PdError::SideChannel)?;
    match answer.get("status").and_then(|s| s.as_str()) {
        Some("FINISH") => {}
        _ => {
            let m = answer
                .get("message")
                .and_then(|m| m.as_str())
                .unwrap_or("no message")
                .to_string();
            return Err(PdError::Remote(m));
        }
    }
    // FINISH orders the peer's writes before this read.
    let mut kv = region.to_vec();
    kv.truncate(blocks * bl);
    sim.stats.kv_bytes_received.inc_by(kv.len() as u64);
    Ok(kv)
}
