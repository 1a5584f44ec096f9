//! The master's side of quick calls ([`lunakv_proto::quick`]): `BatchExistKey`,
//! `BatchGetReplicaList`, `BatchPutStart` and `BatchPutEnd` as plain frames on the RPC port,
//! answered by the very handlers the gRPC calls reach, after the same token check
//! ([`crate::auth::check_grpc`]).
//!
//! Over TLS the frames travel inside the TLS session, and the connection's client identity
//! (mTLS) reaches the handlers as the gRPC calls' does ([`lunakv_tls::Peer`]).
//!
//! A status travels without its metadata (leader redirects, "rebuilding"): the client answers
//! any status by making the same call over gRPC, which knows how to follow those.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lunakv_proto::master as pb;
use lunakv_proto::quick::{self, Method};
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::Semaphore;

use crate::auth::AuthPolicy;
use crate::metrics::Rpc;
use crate::rpc::lanes::Lanes;
use crate::rpc::service::MasterService;
use lunakv_tls::Peer;

/// Quick connections open at once; more are closed at once (their clients use gRPC).
const MAX_CONNECTIONS: usize = 1024;
/// A quick connection silent this long is closed (its client reconnects on its next call).
const IDLE: Duration = Duration::from_secs(300);
/// Bytes a quick connection reads ahead: a batch of 32 vLLM keys is about 4 KiB.
const READ_BUFFER: usize = 16 << 10;
/// A connection keeps its request and answer buffers between frames up to this size; one
/// that grew past it for a large frame is given back after that frame.
const KEEP_BUFFER: usize = 256 << 10;
/// A client that opened a connection must send its magic within this.
const HELLO_WAIT: Duration = Duration::from_secs(5);
/// A frame's body, once announced, must arrive within this.
const BODY_WAIT: Duration = Duration::from_secs(30);

/// Serves the quick connections the RPC listener hands over.
pub(crate) struct QuickServer {
    svc: MasterService,
    policy: Arc<AuthPolicy>,
    slots: Arc<Semaphore>,
    warned_full: AtomicBool,
    /// Where plaintext connections are served ([`crate::rpc::lanes`]).
    lanes: Lanes,
}

impl QuickServer {
    pub(crate) fn new(
        svc: MasterService,
        policy: Arc<AuthPolicy>,
        lanes: Lanes,
    ) -> Arc<QuickServer> {
        Arc::new(QuickServer {
            svc,
            policy,
            slots: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
            warned_full: AtomicBool::new(false),
            lanes,
        })
    }

    /// Takes over the plaintext `stream`, whose first bytes are the quick magic, arrived from
    /// `peer`, and serves it on one of the lanes.
    pub(crate) fn accept_tcp(self: &Arc<Self>, stream: tokio::net::TcpStream, peer: Peer) {
        let Some(permit) = self.slot() else {
            return;
        };
        // Out of this runtime's epoll, into the lane's (in the lane's context).
        let stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "quick-call connection could not move to its lane");
                return;
            }
        };
        let this = self.clone();
        self.lanes.spawn(async move {
            let _permit = permit;
            let r = match tokio::net::TcpStream::from_std(stream) {
                Ok(stream) => this.connection(stream, &peer).await,
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                tracing::debug!(error = %e, "quick-call connection ended");
            }
        });
    }

    /// Takes over `stream` (a TLS session), whose first bytes are the quick magic, arrived
    /// from `peer`. It stays on the runtime that accepted it, which drives its socket.
    pub(crate) fn accept<S>(self: &Arc<Self>, stream: S, peer: Peer)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let Some(permit) = self.slot() else {
            return;
        };
        let this = self.clone();
        tokio::spawn(async move {
            let _permit = permit;
            if let Err(e) = this.connection(stream, &peer).await {
                tracing::debug!(error = %e, "quick-call connection ended");
            }
        });
    }

    /// A connection's place among [`MAX_CONNECTIONS`], or `None` (warned once) when all are
    /// taken: the connection is closed and its client uses gRPC.
    fn slot(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let permit = self.slots.clone().try_acquire_owned().ok();
        if permit.is_none() && !self.warned_full.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                limit = MAX_CONNECTIONS,
                "quick-call connections are at their limit; new ones are closed and those clients use gRPC"
            );
        }
        permit
    }

    async fn connection<S>(&self, stream: S, peer: &Peer) -> std::io::Result<()>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        // A frame's prefix and body (and often the next frame) come in one read instead of
        // two or three: the syscalls per call are a visible share of the master's CPU.
        let mut stream = tokio::io::BufReader::with_capacity(READ_BUFFER, stream);
        let mut magic = [0u8; 8];
        tokio::time::timeout(HELLO_WAIT, stream.read_exact(&mut magic)).await??;
        if &magic != quick::MAGIC {
            return Ok(());
        }
        // Reused for every frame: a fresh answer buffer per frame grew by reallocation each
        // time, onto pages the allocator faulted in again (docs/BENCH.md, "Metadata").
        let (mut frame, mut out) = (Vec::new(), Vec::new());
        loop {
            let mut prefix = [0u8; 4];
            match tokio::time::timeout(IDLE, stream.read_exact(&mut prefix)).await {
                Err(_) => return Ok(()),
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Ok(r) => r?,
            };
            let len = match quick::frame_len(prefix) {
                Ok(len) => len,
                Err(e) => {
                    let out =
                        quick::encode_status(tonic::Code::ResourceExhausted as i32, &e.to_string());
                    stream.write_all(&out).await?;
                    return Ok(());
                }
            };
            // The buffer grows as bytes arrive, within BODY_WAIT: a peer that announces a large
            // frame and trickles it holds neither memory it did not send nor its slot for long.
            frame.clear();
            let mut body = (&mut stream).take(len as u64);
            match tokio::time::timeout(BODY_WAIT, body.read_to_end(&mut frame)).await {
                Ok(Ok(n)) if n == len => {}
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    tracing::debug!(
                        len,
                        "quick-call frame not received within {BODY_WAIT:?}; closed"
                    );
                    return Ok(());
                }
            }
            out.clear();
            self.answer(&frame, peer, &mut out).await;
            stream.write_all(&out).await?;
            for buf in [&mut frame, &mut out] {
                if buf.capacity() > KEEP_BUFFER {
                    *buf = Vec::new();
                }
            }
        }
    }

    /// Appends one response frame for one request frame to `out`.
    async fn answer(&self, frame: &[u8], peer: &Peer, out: &mut Vec<u8>) {
        let req = match quick::decode_request(frame) {
            Ok(r) => r,
            Err(e) => {
                let code = tonic::Code::InvalidArgument as i32;
                return quick::encode_status_into(out, code, &e.to_string());
            }
        };
        let authorization = if req.authorization.is_empty() {
            None
        } else {
            http::HeaderValue::from_bytes(req.authorization).ok()
        };
        let caller = match crate::auth::check_grpc(
            &self.policy,
            req.method.grpc_path(),
            authorization.as_ref(),
            Some(peer),
        ) {
            Ok(c) => c,
            Err(s) => return status(&s, out),
        };
        self.svc.count_quick_call();
        let svc = &self.svc;
        // The very calls the gRPC handlers make, so both transports answer the same bytes.
        match req.method {
            Method::BatchExistKey => match pb::BatchExistKeyRequest::decode(req.body) {
                Ok(m) => reply(
                    svc.batch_locations(Rpc::BatchExistKey, &m.client_id, &m.keys)
                        .await,
                    out,
                ),
                Err(e) => undecodable(req.method, &e, out),
            },
            Method::BatchGetReplicaList => match pb::BatchGetReplicaListRequest::decode(req.body) {
                Ok(m) => reply(
                    svc.batch_locations(Rpc::BatchGetReplicaList, &m.client_id, &m.keys)
                        .await,
                    out,
                ),
                Err(e) => undecodable(req.method, &e, out),
            },
            Method::BatchPutStart => match pb::BatchPutStartRequest::decode(req.body) {
                Ok(m) => reply(svc.batch_put_starts(&caller, m).await, out),
                Err(e) => undecodable(req.method, &e, out),
            },
            Method::BatchPutEnd => match pb::BatchKeysRequest::decode(req.body) {
                Ok(m) => reply(svc.batch_put_ends(&caller, m).await, out),
                Err(e) => undecodable(req.method, &e, out),
            },
        }
    }
}

fn reply<T: Message>(r: Result<T, tonic::Status>, out: &mut Vec<u8>) {
    match r {
        Ok(answer) => quick::encode_ok_into(out, |out| answer.encode_raw(out)),
        Err(s) => status(&s, out),
    }
}

fn status(s: &tonic::Status, out: &mut Vec<u8>) {
    quick::encode_status_into(out, s.code() as i32, s.message());
}

fn undecodable(method: Method, e: &prost::DecodeError, out: &mut Vec<u8>) {
    quick::encode_status_into(
        out,
        tonic::Code::InvalidArgument as i32,
        &format!("the {method:?} request in a quick-call frame does not decode: {e}"),
    );
}
