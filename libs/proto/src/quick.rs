//! Quick calls: the master's hottest calls, `BatchExistKey` (vLLM asks it on every scheduling
//! pass of a waiting request), `BatchGetReplicaList`, and the two halves of every put,
//! `BatchPutStart` and `BatchPutEnd`, as length-prefixed frames on the master's RPC port beside
//! gRPC.
//!
//! A tonic unary call costs about 120 us on loopback on a 2-core machine: HTTP/2 framing and
//! the hand-offs between the caller's thread, the client's connection task and the server's.
//! Upstream's coro_rpc answers the same exists in about 33 us. A quick call is written and read
//! on the caller's own thread over a plain TCP connection, with the same protobuf messages, the
//! same token check and the same handler as the gRPC call, so only the transport differs
//! (docs/ARCHITECTURE.md, "Existence checks").
//!
//! The wire, all integers big-endian:
//! - The client opens with [`MAGIC`] (8 bytes); the master's port tells it from HTTP/2 by it.
//! - Request: `u32 len`, then `len` bytes: `u8 method`, `u16 auth_len`, `auth_len` bytes of the
//!   `authorization` value (`Bearer <token>`, empty without a token), the protobuf request.
//! - Response: `u32 len`, then `len` bytes: `u8 0` and the protobuf response, or `u8 1`,
//!   `i32` gRPC status code and the status message (UTF-8).
//!
//! No frame may exceed [`MAX_FRAME`]; either side closes the connection on a bigger one.

use std::fmt;

/// What a quick-call client sends first on a new connection.
pub const MAGIC: &[u8; 8] = b"LKVQUIK1";

/// The largest request frame the master accepts (tonic's default message limit).
pub const MAX_FRAME: usize = 4 << 20;

/// The largest answer frame a client accepts: the same limit as its gRPC calls' answers (a
/// large batch's locations pass 4 MiB, and a put's answer refused after the master placed it
/// would be lost).
pub const MAX_ANSWER: usize = 256 << 20;

/// The calls a quick frame can carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Method {
    BatchExistKey = 1,
    BatchGetReplicaList = 2,
    BatchPutStart = 3,
    BatchPutEnd = 4,
}

impl Method {
    pub fn from_u8(b: u8) -> Option<Method> {
        match b {
            1 => Some(Method::BatchExistKey),
            2 => Some(Method::BatchGetReplicaList),
            3 => Some(Method::BatchPutStart),
            4 => Some(Method::BatchPutEnd),
            _ => None,
        }
    }

    /// Whether the call changes the index: one whose answer was lost may have been applied, so
    /// it is not simply made again.
    pub fn mutates(self) -> bool {
        matches!(self, Method::BatchPutStart | Method::BatchPutEnd)
    }

    /// The gRPC path of the same call (the token check is keyed by it).
    pub fn grpc_path(self) -> &'static str {
        match self {
            Method::BatchExistKey => "/lunakv.master.v1.Master/BatchExistKey",
            Method::BatchGetReplicaList => "/lunakv.master.v1.Master/BatchGetReplicaList",
            Method::BatchPutStart => "/lunakv.master.v1.Master/BatchPutStart",
            Method::BatchPutEnd => "/lunakv.master.v1.Master/BatchPutEnd",
        }
    }
}

/// A request frame's body that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("a quick-call frame of {len} bytes is over the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    #[error("a quick-call frame is cut short: {0}")]
    Short(&'static str),
    #[error("quick-call method {0} is unknown (this master knows 1 to 4)")]
    UnknownMethod(u8),
    #[error("a quick-call response of kind {0} is unknown")]
    UnknownKind(u8),
}

/// A parsed request: the method, the presented authorization (may be empty) and the protobuf
/// body, borrowed from the frame.
#[derive(Debug, PartialEq, Eq)]
pub struct Request<'a> {
    pub method: Method,
    pub authorization: &'a [u8],
    pub body: &'a [u8],
}

/// A whole request frame, length prefix included.
pub fn encode_request(method: Method, authorization: &[u8], body: &[u8]) -> Vec<u8> {
    let auth_len = authorization.len().min(u16::MAX as usize);
    let len = 1 + 2 + auth_len + body.len();
    let mut out = Vec::with_capacity(4 + len);
    out.extend_from_slice(&(len as u32).to_be_bytes());
    out.push(method as u8);
    out.extend_from_slice(&(auth_len as u16).to_be_bytes());
    out.extend_from_slice(&authorization[..auth_len]);
    out.extend_from_slice(body);
    out
}

/// The body length a request frame's 4-byte prefix announces, refused over [`MAX_FRAME`].
pub fn frame_len(prefix: [u8; 4]) -> Result<usize, FrameError> {
    len_within(prefix, MAX_FRAME)
}

/// The body length an answer frame's prefix announces, refused over [`MAX_ANSWER`].
pub fn answer_len(prefix: [u8; 4]) -> Result<usize, FrameError> {
    len_within(prefix, MAX_ANSWER)
}

fn len_within(prefix: [u8; 4], max: usize) -> Result<usize, FrameError> {
    let len = u32::from_be_bytes(prefix) as usize;
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    Ok(len)
}

/// Parses a request frame's body (after the length prefix).
pub fn decode_request(frame: &[u8]) -> Result<Request<'_>, FrameError> {
    let (&m, rest) = frame.split_first().ok_or(FrameError::Short("no method"))?;
    let method = Method::from_u8(m).ok_or(FrameError::UnknownMethod(m))?;
    if rest.len() < 2 {
        return Err(FrameError::Short("no authorization length"));
    }
    let auth_len = u16::from_be_bytes([rest[0], rest[1]]) as usize;
    let rest = &rest[2..];
    if rest.len() < auth_len {
        return Err(FrameError::Short("authorization"));
    }
    let (authorization, body) = rest.split_at(auth_len);
    Ok(Request {
        method,
        authorization,
        body,
    })
}

/// A response: the protobuf answer, or a gRPC status.
#[derive(Debug, PartialEq, Eq)]
pub enum Response<'a> {
    Ok(&'a [u8]),
    Status { code: i32, message: &'a str },
}

impl fmt::Display for Response<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Response::Ok(b) => write!(f, "ok ({} bytes)", b.len()),
            Response::Status { code, message } => write!(f, "status {code}: {message}"),
        }
    }
}

/// A whole response frame carrying `body`, length prefix included.
pub fn encode_ok(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + body.len());
    encode_ok_into(&mut out, |o| o.extend_from_slice(body));
    out
}

/// Appends a response frame to `out` whose body `write` appends in place (no copy of an
/// encoded body). A server reuses one `out` for a connection's answers: a fresh buffer per
/// answer grew by reallocation every time, onto pages the allocator had to fault in again.
pub fn encode_ok_into(out: &mut Vec<u8>, write: impl FnOnce(&mut Vec<u8>)) {
    let at = out.len();
    out.extend_from_slice(&[0u8; 5]);
    write(out);
    let len = (out.len() - at - 4) as u32;
    out[at..at + 4].copy_from_slice(&len.to_be_bytes());
}

/// A whole response frame carrying a gRPC status.
pub fn encode_status(code: i32, message: &str) -> Vec<u8> {
    let mut out = Vec::new();
    encode_status_into(&mut out, code, message);
    out
}

/// Appends [`encode_status`]'s frame to `out`.
pub fn encode_status_into(out: &mut Vec<u8>, code: i32, message: &str) {
    // A status message never needs the whole frame; keep it well inside the limit.
    let message = &message[..floor_char_boundary(message, 64 << 10)];
    out.reserve(9 + message.len());
    out.extend_from_slice(&((1 + 4 + message.len()) as u32).to_be_bytes());
    out.push(1);
    out.extend_from_slice(&code.to_be_bytes());
    out.extend_from_slice(message.as_bytes());
}

fn floor_char_boundary(s: &str, max: usize) -> usize {
    if s.len() <= max {
        return s.len();
    }
    (0..=max)
        .rev()
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0)
}

/// Parses a response frame's body (after the length prefix).
pub fn decode_response(frame: &[u8]) -> Result<Response<'_>, FrameError> {
    let (&kind, rest) = frame.split_first().ok_or(FrameError::Short("no kind"))?;
    match kind {
        0 => Ok(Response::Ok(rest)),
        1 => {
            if rest.len() < 4 {
                return Err(FrameError::Short("status code"));
            }
            let code = i32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]);
            let message = std::str::from_utf8(&rest[4..]).unwrap_or("(status message not UTF-8)");
            Ok(Response::Status { code, message })
        }
        k => Err(FrameError::UnknownKind(k)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_comes_back_as_it_was_sent() {
        let f = encode_request(Method::BatchExistKey, b"Bearer t0ken", b"\x0a\x01k");
        let len = frame_len(f[..4].try_into().unwrap()).unwrap();
        assert_eq!(len, f.len() - 4);
        let r = decode_request(&f[4..]).unwrap();
        assert_eq!(r.method, Method::BatchExistKey);
        assert_eq!(r.authorization, b"Bearer t0ken");
        assert_eq!(r.body, b"\x0a\x01k");
        assert_eq!(
            Method::BatchGetReplicaList.grpc_path(),
            "/lunakv.master.v1.Master/BatchGetReplicaList"
        );
    }

    #[test]
    fn responses_carry_answers_and_statuses() {
        let ok = encode_ok(b"abc");
        assert_eq!(decode_response(&ok[4..]).unwrap(), Response::Ok(b"abc"));
        let mut out = b"kept".to_vec();
        encode_ok_into(&mut out, |o| o.extend_from_slice(b"abc"));
        assert_eq!(
            &out[..4],
            b"kept",
            "a frame is appended after what the buffer holds"
        );
        assert_eq!(&out[4..], ok);
        let mut empty = Vec::new();
        encode_ok_into(&mut empty, |_| {});
        assert_eq!(empty, encode_ok(b""));
        let st = encode_status(14, "not the leader");
        assert_eq!(
            decode_response(&st[4..]).unwrap(),
            Response::Status {
                code: 14,
                message: "not the leader"
            }
        );
        let long = "é".repeat(40_000);
        let st = encode_status(2, &long);
        let Response::Status { message, .. } = decode_response(&st[4..]).unwrap() else {
            panic!("a status");
        };
        assert!(message.len() <= 64 << 10 && long.starts_with(message));
    }

    #[test]
    fn bad_frames_are_refused_by_name() {
        assert_eq!(
            frame_len(((MAX_FRAME + 1) as u32).to_be_bytes()),
            Err(FrameError::TooLarge {
                len: MAX_FRAME + 1,
                max: MAX_FRAME
            })
        );
        // An answer may be as large as a gRPC answer the client accepts.
        assert_eq!(
            answer_len(((MAX_FRAME + 1) as u32).to_be_bytes()),
            Ok(MAX_FRAME + 1)
        );
        assert!(answer_len(((MAX_ANSWER + 1) as u32).to_be_bytes()).is_err());
        assert_eq!(decode_request(&[]), Err(FrameError::Short("no method")));
        assert_eq!(
            decode_request(&[9, 0, 0]),
            Err(FrameError::UnknownMethod(9))
        );
        assert_eq!(
            decode_request(&[1, 0]),
            Err(FrameError::Short("no authorization length"))
        );
        assert_eq!(
            decode_request(&[1, 0, 5, b'x']),
            Err(FrameError::Short("authorization"))
        );
        assert_eq!(decode_response(&[7]), Err(FrameError::UnknownKind(7)));
        assert_eq!(
            decode_response(&[1, 0]),
            Err(FrameError::Short("status code"))
        );
    }
}
