//! One look at a master's port before tonic connects to it, to name what is listening there
//! when it is not a lunakv-master (or refuses this client's certificate).

use std::time::Duration;

use crate::ClientError;

/// One look at what `addr` speaks before tonic connects: a peer that closes the connection on
/// the HTTP/2 preface, or answers with something other than HTTP/2, is not a lunakv-master
/// (upstream's `mooncake_master` speaks coro_rpc); without this the first call fails with a bare
/// transport error. `Err` ([`ClientError::Rpc`]) only when that is certain: a refused or silent
/// peer is left to tonic's connect and its usual errors. Over TLS the same look also shows
/// whether the master accepted this client's certificate (under TLS 1.3 its refusal arrives
/// after the handshake), as a [`ClientError::Tls`] that names the certificate.
///
/// A lunakv-master being killed or restarting also closes or resets a connection it had
/// accepted (puts made while a master was killed used to be told "not a lunakv-master", which
/// is final). So a peer that closes on the preface is looked at once more: a foreign server
/// closes again, a restarting master by then refuses, stays silent while it starts, or answers
/// HTTP/2. Only the first is "not a lunakv-master"; the others say the master is unreachable or
/// restarting, an error the callers retry.
pub(crate) async fn speaks_grpc(
    addr: &str,
    timeout: Duration,
    tls: Option<&lunakv_tls::ClientTls>,
) -> Result<(), ClientError> {
    let wait = Duration::from_secs(2).min(timeout);
    let how = match look(addr, wait, tls).await? {
        Look::Http2 | Look::Unreachable => return Ok(()),
        Look::Foreign(seen) => return Err(not_a_master(addr, &seen)),
        Look::Closed(how) => how,
    };
    tokio::time::sleep(RELOOK_AFTER.min(wait)).await;
    match look(addr, wait, tls).await? {
        Look::Http2 => Ok(()),
        Look::Foreign(seen) => Err(not_a_master(addr, &seen)),
        Look::Closed(again) => Err(not_a_master(
            addr,
            &format!("it {how} on the HTTP/2 preface, and {again} on it again"),
        )),
        Look::Unreachable => Err(ClientError::Rpc {
            addr: addr.to_owned(),
            message: format!(
                "the master at {addr} {how} before answering, and a moment later no longer \
                 answered: it is unreachable or restarting (retrying)"
            ),
        }),
    }
}

/// How long [`speaks_grpc`] waits before it looks again at a peer that closed on the preface:
/// long enough for a killed process's port to refuse, short next to a connect's timeout.
const RELOOK_AFTER: Duration = Duration::from_millis(200);

/// What one look at the master's port showed.
#[derive(Debug, PartialEq, Eq)]
enum Look {
    /// An HTTP/2 server answered.
    Http2,
    /// No connection (refused, timed out), or a connection that stayed silent.
    Unreachable,
    /// The peer closed ("closed the connection") or reset ("reset the connection") the
    /// connection without a byte.
    Closed(&'static str),
    /// The peer answered something other than HTTP/2: what it answered.
    Foreign(String),
}

fn not_a_master(addr: &str, seen: &str) -> ClientError {
    use lunakv_proto::foreign::NOT_A_LUNAKV_MASTER;
    ClientError::Rpc {
        addr: addr.to_owned(),
        message: format!(
            "the master at {addr} does not speak gRPC ({seen}): {NOT_A_LUNAKV_MASTER} (upstream Mooncake's mooncake_master speaks coro_rpc); point master_server_address at a lunakv-master, or use upstream's mooncake package with an upstream master"
        ),
    }
}

/// Connects to `addr` (over TLS with `tls`) and sends HTTP/2's preface: what came back.
async fn look(
    addr: &str,
    wait: Duration,
    tls: Option<&lunakv_tls::ClientTls>,
) -> Result<Look, ClientError> {
    let host = addr.split_once("://").map_or(addr, |(_, rest)| rest);
    match tls {
        None => {
            let Ok(Ok(s)) = tokio::time::timeout(wait, tokio::net::TcpStream::connect(host)).await
            else {
                return Ok(Look::Unreachable);
            };
            first_frame(addr, s, wait).await
        }
        Some(t) => {
            let s = match t.connect(host, wait).await {
                Ok(s) => s,
                Err(e) => {
                    return match lunakv_tls::TlsFailure::of(&e) {
                        Some(f) => Err(ClientError::Tls {
                            addr: addr.to_owned(),
                            message: f.to_string(),
                        }),
                        None => Ok(Look::Unreachable),
                    };
                }
            };
            first_frame(addr, s, wait).await
        }
    }
}

/// Sends HTTP/2's preface and reads the first frame's header; `Err` when the peer refused this
/// client's TLS certificate.
async fn first_frame<S>(addr: &str, mut s: S, wait: Duration) -> Result<Look, ClientError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use lunakv_proto::foreign::{
        CORO_RPC_MAGIC, HTTP2_EMPTY_SETTINGS, HTTP2_PREFACE, server_speaks_http2,
    };
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let mut hello = HTTP2_PREFACE.to_vec();
    hello.extend_from_slice(&HTTP2_EMPTY_SETTINGS);
    if s.write_all(&hello).await.is_err() {
        return Ok(Look::Unreachable);
    }
    let mut first = [0u8; 9];
    let mut got = 0;
    let mut tls_failure = None;
    let mut reset = false;
    let read = tokio::time::timeout(wait, async {
        while got < first.len() {
            match s.read(&mut first[got..]).await {
                Ok(0) => break,
                Err(e) => {
                    if lunakv_tls::TlsFailure::of(&e).is_some() {
                        tls_failure = Some(e);
                    } else {
                        reset = true;
                    }
                    break;
                }
                Ok(n) => got += n,
            }
        }
    })
    .await;
    if let Some(f) = tls_failure.as_ref().and_then(lunakv_tls::TlsFailure::of) {
        return Err(ClientError::Tls {
            addr: addr.to_owned(),
            message: f.to_string(),
        });
    }
    if read.is_err() && got == 0 {
        // Silent: maybe overloaded, or starting; tonic decides.
        return Ok(Look::Unreachable);
    }
    if server_speaks_http2(&first[..got]) {
        return Ok(Look::Http2);
    }
    Ok(if got == 0 {
        Look::Closed(if reset {
            "reset the connection"
        } else {
            "closed the connection"
        })
    } else if first[0] == CORO_RPC_MAGIC {
        Look::Foreign("it answered with a coro_rpc header".to_string())
    } else {
        Look::Foreign(format!("it answered {:02x?}", &first[..got]))
    })
}
