//! The transfer wire format, shared by the tcp listener and the unix (shm) socket.
//!
//! Every frame is little-endian and fixed-size so both sides parse it from a stack buffer
//! without allocating. A request is a [`REQ_LEN`]-byte header, then (for `WRITE`/`COMMIT`)
//! `key_len` key bytes, then (for `WRITE`) `len` payload bytes, or (for `FREE`) `count`
//! 16-byte `(generation, offset)` pairs. A response is a [`RESP_LEN`]-byte header followed by
//! `len` bytes: the object for an OK `READ`, a UTF-8 message for an error status.
//!
//! Byte 5 of a request header holds flags, byte 5 of a response header the answering peer's
//! features; peers that predate them send zero there and never read them. With
//! [`FLAG_TRACE`] set, a [`TRACE_LEN`]-byte trace context ([`encode_trace`]) follows the request
//! header, before the op's own body, so the owner's span of that request joins the requester's
//! trace. A requester sets it only towards a peer whose answers carry [`FEATURE_TRACE`]; it
//! learns that from the ATTACH answer on the unix socket, and on tcp from the answer to a
//! zero-length `READ` (`RAW_READ` for a [`crate::RegionServer`]), which every version of both
//! servers refuses with BAD_REQUEST and no side effect. Only requesters that export traces
//! send that probe, once per connection.
//!
//! It is public so tests (and future non-Rust peers) can speak it directly.

use lunakv_telemetry::propagate::TraceParent;

/// First four bytes of every frame ("LKV1" read as a little-endian u32).
pub const MAGIC: u32 = u32::from_le_bytes(*b"LKV1");
/// Request header length in bytes.
pub const REQ_LEN: usize = 40;
/// Response header length in bytes.
pub const RESP_LEN: usize = 24;
/// Longest key accepted; longer keys close the connection (a peer bug or garbage).
pub const MAX_KEY_LEN: usize = 4096;
/// Most `(generation, offset)` pairs in one `FREE`.
pub const MAX_FREE_ITEMS: u32 = 1 << 20;
/// Longest error message a response may carry.
pub const MAX_MSG_LEN: u64 = 64 * 1024;

/// Offset of the flags byte in a request header and of the features byte in a response header.
pub const FLAGS_AT: usize = 5;
/// Request flag: a [`TRACE_LEN`]-byte trace context follows the header.
pub const FLAG_TRACE: u8 = 1;
/// Response feature: this peer reads the trace context of [`FLAG_TRACE`] requests.
pub const FEATURE_TRACE: u8 = 1;
/// Request flag on ATTACH: answer with the segment's identity ([`encode_identity`]) after the
/// response header, `len` bytes. Older servers ignore it and answer with `len` 0.
pub const FLAG_IDENTITY: u8 = 2;
/// Response feature: this peer answers [`FLAG_IDENTITY`].
pub const FEATURE_IDENTITY: u8 = 2;
/// Request flag: a [`crate::cap::CAP_LEN`]-byte capability follows the header (after the
/// trace context when both are set). Set only when the master handed out a capability, i.e.
/// when the owner requires them; with capabilities off no request carries it.
pub const FLAG_CAP: u8 = 4;
/// Request flag, only with [`FLAG_CAP`] on WRITE and COMMIT: the capability is followed by the
/// placement's [`crate::cap::PROOF_LEN`]-byte proof, which the owner keeps with the entry.
pub const FLAG_PROOF: u8 = 8;
/// Request flag on OFFLOAD: "tell me what you dropped". The owner answers in the layout of
/// [`encode_offload_answer`], which adds the objects its disk tier dropped to make room for this
/// OFFLOAD, so the master forgets them before it answers another lookup. Like [`FLAG_CAP`] it is
/// set after the master's tag is computed (owners tag-check the header without flags). An owner
/// without [`FEATURE_DROPS`] ignores it and answers as before; its drops reach the master on its
/// next Ping.
pub const FLAG_DROPS: u8 = 16;
/// Response feature: this peer answers [`FLAG_DROPS`].
pub const FEATURE_DROPS: u8 = 4;
/// What this crate's servers understand; every response they send carries it.
pub const FEATURES: u8 = FEATURE_TRACE | FEATURE_IDENTITY | FEATURE_DROPS;
/// Most dropped objects one OFFLOAD answer carries; an owner reports the rest on its next Ping.
pub const MAX_OFFLOAD_DROPS: usize = 1 << 20;
/// Most bytes of dropped objects ([`offload_drop_len`] each) one OFFLOAD answer carries; an
/// owner reports the rest on its next Ping. With keys of ~100 bytes, ~150,000 objects.
pub const MAX_OFFLOAD_DROP_BYTES: usize = 16 << 20;
/// Bytes of one dropped object in an OFFLOAD answer, besides its key.
const DROP_FIXED_LEN: usize = 8 + 2;

/// Bytes a dropped object with a key of `key_len` bytes takes in an OFFLOAD answer.
pub fn offload_drop_len(key_len: usize) -> usize {
    DROP_FIXED_LEN + key_len
}
/// Longest identity an ATTACH answer may carry (three short strings).
pub const MAX_IDENTITY_LEN: u64 = 1024;

/// The identity body: cluster id, segment name and instance id, each a little-endian u16
/// length then UTF-8 bytes.
pub fn encode_identity(id: &crate::SegmentIdentity) -> Vec<u8> {
    let mut b = Vec::new();
    for s in [&id.cluster_id, &id.name, &id.instance_id] {
        let bytes = &s.as_bytes()[..s.len().min(300)];
        b.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
        b.extend_from_slice(bytes);
    }
    b
}

/// Decodes an identity body; `None` when it is malformed.
pub fn decode_identity(mut b: &[u8]) -> Option<crate::SegmentIdentity> {
    let mut field = || {
        let n = usize::from(u16::from_le_bytes(b.get(..2)?.try_into().ok()?));
        let s = std::str::from_utf8(b.get(2..2 + n)?).ok()?.to_owned();
        b = &b[2 + n..];
        Some(s)
    };
    Some(crate::SegmentIdentity {
        cluster_id: field()?,
        name: field()?,
        instance_id: field()?,
    })
}
/// The trace context: version 0, then the W3C trace id (16 bytes), parent span id (8) and
/// trace flags (1) of the requester's span, i.e. a binary `traceparent`.
pub const TRACE_LEN: usize = 26;

/// Encodes a trace context for a [`FLAG_TRACE`] request.
pub fn encode_trace(t: &TraceParent) -> [u8; TRACE_LEN] {
    let mut b = [0u8; TRACE_LEN];
    b[1..17].copy_from_slice(&t.trace_id);
    b[17..25].copy_from_slice(&t.span_id);
    b[25] = t.flags;
    b
}

/// Decodes a trace context; `None` for a version this build does not know (ignored, the
/// request itself is served).
pub fn decode_trace(b: &[u8; TRACE_LEN]) -> Option<TraceParent> {
    if b[0] != 0 {
        return None;
    }
    let mut trace_id = [0u8; 16];
    trace_id.copy_from_slice(&b[1..17]);
    let mut span_id = [0u8; 8];
    span_id.copy_from_slice(&b[17..25]);
    Some(TraceParent {
        trace_id,
        span_id,
        flags: b[25],
    })
}

/// Request operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// `WRITE(gen, key, offset, len)` + key + payload; answers OK once the entry is committed.
    Write = 1,
    /// `READ(gen, offset, len)`; answers OK + the bytes, or STALE.
    Read = 2,
    /// `FREE` of `count` pairs, waiting up to `aux` ms for pins; answers OK or TIMEOUT.
    Free = 3,
    /// Unix socket only: answers OK (value = segment size) with the memfd in SCM_RIGHTS.
    Attach = 4,
    /// Unix socket only: `PIN(gen, offset, len)`; answers OK or STALE. Pins die with the connection.
    Pin = 5,
    /// Unix socket only: `UNPIN(gen, offset, len)`; no response (saves a round trip per get).
    Unpin = 6,
    /// Unix socket only: `COMMIT(gen, key, offset, len)` + key, after the requester's memcpy.
    Commit = 7,
    /// [`crate::RegionServer`] only: `RAW_WRITE(offset = absolute address, len)` + payload into
    /// registered memory; answers OK, or OUT_OF_BOUNDS when no one region holds the range.
    RawWrite = 8,
    /// [`crate::RegionServer`] only: `RAW_READ(offset = absolute address, len)`; answers OK +
    /// the bytes, or OUT_OF_BOUNDS.
    RawRead = 9,
    /// SSD tier: `OFFLOAD` of `count` `(generation, offset)` pairs (the FREE body), waiting up to
    /// `aux` ms for pins. The owner writes each entry durably to its disk tier, then drops the
    /// DRAM entries (as FREE does) and answers OK with `value` = objects now on disk and a body
    /// of the generations it could not store (8 bytes each).
    ///
    /// With [`FLAG_DROPS`] set, an owner whose answer carries [`FEATURE_DROPS`] answers with
    /// this body instead (little-endian): `u32 F`, `F` u64 generations it could not store,
    /// `u32 D`, then `D` objects its disk tier dropped to make room for this OFFLOAD, each `u64
    /// generation`, `u16 key_len`, `key_len` UTF-8 key bytes. `F` is at most the request's
    /// `count`, `D` at most [`MAX_OFFLOAD_DROPS`], the `D` objects at most
    /// [`MAX_OFFLOAD_DROP_BYTES`], `key_len` at most [`MAX_KEY_LEN`]; a requester closes the
    /// connection on anything else. Drops beyond these go on the owner's next Ping.
    Offload = 10,
    /// SSD tier: `LOAD(gen, len)`; answers OK + the object's bytes, from DRAM while its entry is
    /// still there (an offload in flight) else from disk after its checksum passed; STALE when
    /// the owner has neither (evicted from disk, corrupt, removed).
    Load = 11,
    /// [`crate::SegmentServer`] tcp only (feature `rdma`): `RDMA_CONNECT` + `key_len` bytes of
    /// the requester's [`crate::RdmaDescriptor`] (its queue pair). Answers OK + the owner's
    /// descriptor (its queue pair, connected to the requester's, and the segment's region), or
    /// BAD_REQUEST with the reason when the segment offers no rdma. Afterwards the connection
    /// also accepts `PIN`/`UNPIN`/`COMMIT` (the RDMA data path's control ops), and the queue
    /// pair lives as long as the connection.
    RdmaConnect = 12,
    /// SSD tier, master to owner: `PROMOTE(gen, key, offset, len)` + key. The owner reads
    /// object `gen` from its disk tier (checksum verified) into `[offset, offset+len)` of its
    /// segment, a range the master reserved, and commits the DRAM entry under the same
    /// generation (as `WRITE` does); the disk copy stays. Answers OK, or STALE when the disk
    /// tier does not hold it (or it failed its checksum).
    Promote = 13,
}

/// In a `FREE` pair, this offset names the object's disk copy rather than a DRAM range.
pub const DISK_OFFSET: u64 = u64::MAX;

impl Op {
    /// The op's name in docs and span names (`WRITE`, `RAW_READ`).
    pub fn name(self) -> &'static str {
        match self {
            Op::Write => "WRITE",
            Op::Read => "READ",
            Op::Free => "FREE",
            Op::Attach => "ATTACH",
            Op::Pin => "PIN",
            Op::Unpin => "UNPIN",
            Op::Commit => "COMMIT",
            Op::RawWrite => "RAW_WRITE",
            Op::RawRead => "RAW_READ",
            Op::Offload => "OFFLOAD",
            Op::Load => "LOAD",
            Op::RdmaConnect => "RDMA_CONNECT",
            Op::Promote => "PROMOTE",
        }
    }

    /// Parses an op byte; `None` for garbage.
    pub fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            1 => Op::Write,
            2 => Op::Read,
            3 => Op::Free,
            4 => Op::Attach,
            5 => Op::Pin,
            6 => Op::Unpin,
            7 => Op::Commit,
            8 => Op::RawWrite,
            9 => Op::RawRead,
            10 => Op::Offload,
            11 => Op::Load,
            12 => Op::RdmaConnect,
            13 => Op::Promote,
            _ => return None,
        })
    }
}

/// Response statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    Ok = 0,
    /// No entry with that generation/offset/len: evicted, removed or overwritten.
    Stale = 1,
    /// The range is outside the segment; `value` carries the segment size.
    OutOfBounds = 2,
    /// A well-formed but invalid request (zero length, op not allowed on this socket...).
    BadRequest = 3,
    /// FREE waited its whole budget for pins to drop.
    Timeout = 4,
    /// The owner requires capabilities and this request's is missing, expired, forged or
    /// grants less than the op needs; or a WRITE names a generation already committed. The
    /// message says which. Nothing was read or written.
    Refused = 5,
}

impl Status {
    /// Parses a status byte; `None` for garbage.
    pub fn from_u8(v: u8) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::Stale,
            2 => Status::OutOfBounds,
            3 => Status::BadRequest,
            4 => Status::Timeout,
            5 => Status::Refused,
            _ => return None,
        })
    }
}

/// A request header. `key_len` doubles as the item count of `FREE`, `aux` as its timeout in ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub op: Op,
    pub generation: u64,
    pub offset: u64,
    pub len: u64,
    pub key_len: u32,
    pub aux: u32,
}

impl Request {
    /// `op` with every other field zero: ATTACH, and the zero-length probe.
    pub fn bare(op: Op) -> Request {
        Request {
            op,
            generation: 0,
            offset: 0,
            len: 0,
            key_len: 0,
            aux: 0,
        }
    }

    /// Encodes into a stack buffer.
    pub fn encode(&self) -> [u8; REQ_LEN] {
        let mut b = [0u8; REQ_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.op as u8;
        b[8..16].copy_from_slice(&self.generation.to_le_bytes());
        b[16..24].copy_from_slice(&self.offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..36].copy_from_slice(&self.key_len.to_le_bytes());
        b[36..40].copy_from_slice(&self.aux.to_le_bytes());
        b
    }

    /// Encodes with [`FLAG_IDENTITY`] set (an ATTACH that wants the segment's identity).
    pub fn encode_identity_request(&self) -> [u8; REQ_LEN] {
        let mut b = self.encode();
        b[FLAGS_AT] |= FLAG_IDENTITY;
        b
    }

    /// Encodes with [`FLAG_TRACE`] set when `trace` is given; returns the header and the bytes
    /// to send right after it (empty without a trace).
    pub fn encode_with<'t>(&self, trace: Option<&'t [u8; TRACE_LEN]>) -> ([u8; REQ_LEN], &'t [u8]) {
        let mut b = self.encode();
        match trace {
            Some(t) => {
                b[FLAGS_AT] |= FLAG_TRACE;
                (b, t)
            }
            None => (b, &[]),
        }
    }

    /// Decodes a header; `Err` names what is wrong (the caller closes the connection).
    pub fn decode(b: &[u8; REQ_LEN]) -> Result<Request, WireError> {
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let op = Op::from_u8(b[4]).ok_or(WireError::BadOp(b[4]))?;
        Ok(Request {
            op,
            generation: le_u64(&b[8..16]),
            offset: le_u64(&b[16..24]),
            len: le_u64(&b[24..32]),
            key_len: le_u32(&b[32..36]),
            aux: le_u32(&b[36..40]),
        })
    }
}

/// Why a header could not be decoded. The texts are the ones peers have always logged, so a
/// log search written against an older release still matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    #[error("bad op {0}")]
    BadOp(u8),
    #[error("bad response magic {0:#010x}")]
    BadResponseMagic(u32),
    #[error("bad status {0}")]
    BadStatus(u8),
}

/// A response header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Response {
    pub status: Status,
    /// Op-specific: segment size for ATTACH and OUT_OF_BOUNDS.
    pub value: u64,
    /// Bytes that follow: the object for OK READ, a message for errors.
    pub len: u64,
}

impl Response {
    /// Encodes into a stack buffer.
    pub fn encode(&self) -> [u8; RESP_LEN] {
        let mut b = [0u8; RESP_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.status as u8;
        b[FLAGS_AT] = FEATURES;
        b[8..16].copy_from_slice(&self.value.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes a header; `Err` names what is wrong.
    pub fn decode(b: &[u8; RESP_LEN]) -> Result<Response, WireError> {
        let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if magic != MAGIC {
            return Err(WireError::BadResponseMagic(magic));
        }
        let status = Status::from_u8(b[4]).ok_or(WireError::BadStatus(b[4]))?;
        Ok(Response {
            status,
            value: le_u64(&b[8..16]),
            len: le_u64(&b[16..24]),
        })
    }
}

/// Whether a request header carries a capability.
pub fn has_cap(b: &[u8; REQ_LEN]) -> bool {
    b[FLAGS_AT] & FLAG_CAP != 0
}

/// Whether a request header's capability is followed by a placement proof.
pub fn has_proof(b: &[u8; REQ_LEN]) -> bool {
    has_cap(b) && b[FLAGS_AT] & FLAG_PROOF != 0
}

/// Whether a request header carries a trace context.
pub fn is_traced(b: &[u8; REQ_LEN]) -> bool {
    b[FLAGS_AT] & FLAG_TRACE != 0
}

/// The request asks for the segment's identity ([`FLAG_IDENTITY`]).
pub fn wants_identity(b: &[u8; REQ_LEN]) -> bool {
    b[FLAGS_AT] & FLAG_IDENTITY != 0
}

/// The request asks an OFFLOAD answer to list the disk tier's drops ([`FLAG_DROPS`]).
pub fn wants_drops(b: &[u8; REQ_LEN]) -> bool {
    b[FLAGS_AT] & FLAG_DROPS != 0
}

/// An object an owner's disk tier dropped to make room, as an OFFLOAD answer names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DroppedObject {
    pub generation: u64,
    pub key: String,
}

/// The body of an OFFLOAD answer to a [`FLAG_DROPS`] request (layout: [`Op::Offload`]). The
/// caller keeps `dropped` within [`MAX_OFFLOAD_DROPS`] and [`MAX_OFFLOAD_DROP_BYTES`], and each
/// key within [`MAX_KEY_LEN`].
pub fn encode_offload_answer(failed: &[u64], dropped: &[DroppedObject]) -> Vec<u8> {
    let keys: usize = dropped.iter().map(|d| d.key.len()).sum();
    let mut b = Vec::with_capacity(8 + failed.len() * 8 + dropped.len() * DROP_FIXED_LEN + keys);
    b.extend_from_slice(&(failed.len() as u32).to_le_bytes());
    for g in failed {
        b.extend_from_slice(&g.to_le_bytes());
    }
    b.extend_from_slice(&(dropped.len() as u32).to_le_bytes());
    for d in dropped {
        b.extend_from_slice(&d.generation.to_le_bytes());
        b.extend_from_slice(&(d.key.len() as u16).to_le_bytes());
        b.extend_from_slice(d.key.as_bytes());
    }
    b
}

/// Longest OFFLOAD answer body a requester accepts for a request of `count` pairs.
pub fn max_offload_answer_len(count: usize) -> u64 {
    (8 + count as u64 * 8).saturating_add(MAX_OFFLOAD_DROP_BYTES as u64)
}

/// Why an OFFLOAD answer body could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OffloadAnswerError {
    #[error("OFFLOAD answer truncated")]
    Truncated,
    #[error("OFFLOAD answer lists {got} failed generations for {count} pairs")]
    TooManyFailed { got: u64, count: usize },
    #[error("OFFLOAD answer lists {0} dropped objects (at most {MAX_OFFLOAD_DROPS})")]
    TooManyDropped(u64),
    #[error("OFFLOAD answer has a key of {0} bytes (at most {MAX_KEY_LEN})")]
    KeyTooLong(usize),
    #[error("OFFLOAD answer has a key that is not UTF-8")]
    KeyNotUtf8,
    #[error("OFFLOAD answer has {0} bytes after its last object")]
    Trailing(usize),
}

/// Decodes [`encode_offload_answer`]'s body for a request of `count` pairs: (generations not
/// stored, objects dropped). Every count and length is checked before it is used.
pub fn decode_offload_answer(
    b: &[u8],
    count: usize,
) -> Result<(Vec<u64>, Vec<DroppedObject>), OffloadAnswerError> {
    use OffloadAnswerError as E;
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8], E> {
        let s = b.get(at..at + n).ok_or(E::Truncated)?;
        at += n;
        Ok(s)
    };
    let f = u64::from(le_u32(take(4)?));
    if f > count as u64 {
        return Err(E::TooManyFailed { got: f, count });
    }
    let mut failed = Vec::with_capacity(f as usize);
    for _ in 0..f {
        failed.push(le_u64(take(8)?));
    }
    let d = u64::from(le_u32(take(4)?));
    if d > MAX_OFFLOAD_DROPS as u64 {
        return Err(E::TooManyDropped(d));
    }
    let mut dropped = Vec::new();
    for _ in 0..d {
        let generation = le_u64(take(8)?);
        let n = usize::from(u16::from_le_bytes([take(1)?[0], take(1)?[0]]));
        if n > MAX_KEY_LEN {
            return Err(E::KeyTooLong(n));
        }
        let key = std::str::from_utf8(take(n)?)
            .map_err(|_| E::KeyNotUtf8)?
            .to_owned();
        dropped.push(DroppedObject { generation, key });
    }
    if at != b.len() {
        return Err(E::Trailing(b.len() - at));
    }
    Ok((failed, dropped))
}

/// The features byte of a response header (0 from peers that predate it).
pub fn features(b: &[u8; RESP_LEN]) -> u8 {
    b[FLAGS_AT]
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    u64::from_le_bytes(a)
}

fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(b);
    u32::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips_and_rejects_garbage() {
        let r = Request {
            op: Op::Write,
            generation: 7 << 32 | 3,
            offset: 4096,
            len: 65536,
            key_len: 5,
            aux: 9,
        };
        assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        let mut bad = r.encode();
        bad[0] = b'X';
        assert!(
            Request::decode(&bad)
                .unwrap_err()
                .to_string()
                .contains("magic")
        );
        let mut bad = r.encode();
        bad[4] = 99;
        assert!(
            Request::decode(&bad)
                .unwrap_err()
                .to_string()
                .contains("op")
        );
    }

    #[test]
    fn trace_flag_and_context_round_trip_and_old_headers_carry_none() {
        let r = Request {
            op: Op::Write,
            generation: 1,
            offset: 0,
            len: 8,
            key_len: 1,
            aux: 0,
        };
        let (plain, none) = r.encode_with(None);
        assert!(!is_traced(&plain) && none.is_empty());
        assert_eq!(plain, r.encode());
        let t = TraceParent {
            trace_id: [7; 16],
            span_id: [9; 8],
            flags: 1,
        };
        let tc = encode_trace(&t);
        let (traced, extra) = r.encode_with(Some(&tc));
        assert!(is_traced(&traced));
        assert_eq!(extra, &tc[..]);
        // The flag changes nothing an old peer decodes.
        assert_eq!(Request::decode(&traced).unwrap(), r);
        assert_eq!(decode_trace(&tc), Some(t));
        let mut future = tc;
        future[0] = 1;
        assert_eq!(decode_trace(&future), None);
        let resp = Response {
            status: Status::Ok,
            value: 0,
            len: 0,
        }
        .encode();
        assert_eq!(features(&resp) & FEATURE_TRACE, FEATURE_TRACE);
    }

    #[test]
    fn offload_answers_round_trip_and_bounds_are_checked() {
        let dropped = vec![
            DroppedObject {
                generation: 7,
                key: "a".into(),
            },
            DroppedObject {
                generation: 1 << 40,
                key: "k".repeat(MAX_KEY_LEN),
            },
        ];
        let b = encode_offload_answer(&[3, 4], &dropped);
        assert!(b.len() as u64 <= max_offload_answer_len(2));
        assert_eq!(
            decode_offload_answer(&b, 2),
            Ok((vec![3, 4], dropped.clone()))
        );
        let empty = encode_offload_answer(&[], &[]);
        assert_eq!(empty.len(), 8);
        assert_eq!(decode_offload_answer(&empty, 0), Ok((vec![], vec![])));
        // More failed generations than pairs asked.
        assert_eq!(
            decode_offload_answer(&b, 1),
            Err(OffloadAnswerError::TooManyFailed { got: 2, count: 1 })
        );
        // Every cut is refused, never read past.
        for cut in 0..b.len() {
            assert!(decode_offload_answer(&b[..cut], 2).is_err(), "cut at {cut}");
        }
        let mut long = b.clone();
        long.push(0);
        assert_eq!(
            decode_offload_answer(&long, 2),
            Err(OffloadAnswerError::Trailing(1))
        );
        // A count or a key length beyond the bounds is refused before anything is allocated.
        let mut many = encode_offload_answer(&[], &[]);
        many[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            decode_offload_answer(&many, 0),
            Err(OffloadAnswerError::TooManyDropped(u64::from(u32::MAX)))
        );
        let mut key = encode_offload_answer(&[], &dropped[..1]);
        key[16..18].copy_from_slice(&(MAX_KEY_LEN as u16 + 1).to_le_bytes());
        assert_eq!(
            decode_offload_answer(&key, 0),
            Err(OffloadAnswerError::KeyTooLong(MAX_KEY_LEN + 1))
        );
        let mut utf = encode_offload_answer(&[], &dropped[..1]);
        utf[18] = 0xFF;
        assert_eq!(
            decode_offload_answer(&utf, 0),
            Err(OffloadAnswerError::KeyNotUtf8)
        );
    }

    #[test]
    fn the_drops_flag_is_invisible_to_an_owner_that_does_not_know_it() {
        let r = Request {
            op: Op::Offload,
            generation: 0,
            offset: 0,
            len: 0,
            key_len: 3,
            aux: 100,
        };
        let mut b = r.encode();
        b[FLAGS_AT] |= FLAG_DROPS;
        assert!(wants_drops(&b) && !wants_drops(&r.encode()));
        // The header decodes the same, carries no other flag's body, and the owner's tag
        // check (over the flag-free encoding) is unchanged.
        assert_eq!(Request::decode(&b), Ok(r));
        assert!(!is_traced(&b) && !has_cap(&b) && !wants_identity(&b));
        assert_eq!(Request::decode(&b).map(|r| r.encode()), Ok(r.encode()));
        let resp = Response {
            status: Status::Ok,
            value: 0,
            len: 0,
        }
        .encode();
        assert_ne!(features(&resp) & FEATURE_DROPS, 0);
    }

    #[test]
    fn response_round_trips() {
        let r = Response {
            status: Status::OutOfBounds,
            value: 1 << 30,
            len: 12,
        };
        assert_eq!(Response::decode(&r.encode()).unwrap(), r);
    }
}
