//! `BatchObjectLocations` and `BatchPutStartResponse` written straight from the core's
//! results, for the quick calls' answers to exists, location lookups and put starts (the
//! master's hottest calls).
//!
//! Building the prost structs first costs eleven `String` copies per replica (every field of
//! its segment's descriptor), then encoding copies them once more. Here each distinct segment
//! of a batch is encoded once (by prost, from [`pb::SegmentDescriptor`]) and its bytes are
//! copied into every replica that names it, so a batch of 32 keys on one segment builds one
//! descriptor instead of 32. The bytes are the ones prost writes for the same message, which
//! the tests check field by field, so clients decode them as any gRPC answer.

use std::sync::Arc;

use lunakv_proto::master as pb;
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint};

use crate::core::{Location, OpError, ReplicaView, SegmentDesc};
use crate::rpc::convert::Placed;

/// Appends `results` to `out` as the encoding of a `BatchObjectLocations` with one
/// `ObjectLocation` per result, in order.
pub(crate) fn encode_batch(
    results: &[Result<Location, OpError>],
    segments: &mut Descriptors,
    out: &mut Vec<u8>,
) {
    encode_results(
        results.iter().map(|r| r.as_ref().map(Shape::location)),
        segments,
        out,
    );
}

/// Appends `results` (each a put's generation and placements) to `out` as the encoding of a
/// `BatchPutStartResponse` with one `PutStartResponse` per result, in order.
pub(crate) fn encode_put_starts(
    results: &[Result<Placed, OpError>],
    segments: &mut Descriptors,
    out: &mut Vec<u8>,
) {
    encode_results(
        results.iter().map(|r| {
            r.as_ref().map(|(generation, replicas)| Shape {
                head: [(3, *generation), (0, 0)],
                replicas_tag: 4,
                replicas,
                tail: (0, 0),
            })
        }),
        segments,
        out,
    );
}

/// An answer message that succeeded: varint fields `head` (tag 0: absent), the repeated
/// `Replica` field, then the varint field `tail`. Its failure shares the field numbers of
/// both messages: code 1 and message 2.
struct Shape<'a> {
    head: [(u32, u64); 2],
    replicas_tag: u32,
    replicas: &'a [ReplicaView],
    tail: (u32, u64),
}

impl<'a> Shape<'a> {
    fn location(l: &'a Location) -> Shape<'a> {
        Shape {
            head: [(3, l.generation), (4, l.size)],
            replicas_tag: 5,
            replicas: &l.replicas,
            tail: (6, l.lease_ttl.as_millis() as u64),
        }
    }
}

fn encode_results<'a>(
    results: impl Iterator<Item = Result<Shape<'a>, &'a OpError>>,
    segments: &mut Descriptors,
    out: &mut Vec<u8>,
) {
    for r in results {
        let len = answer_len(&r, segments);
        encode_key(1, WireType::LengthDelimited, out);
        encode_varint(len as u64, out);
        let start = out.len();
        encode_answer(&r, segments, out);
        debug_assert_eq!(out.len() - start, len, "an answer's length was miscounted");
    }
}

/// The encoded descriptors of the segments a quick connection's answers have named, kept
/// across its batches: a descriptor is encoded once per connection, not once per batch.
///
/// An entry is found by the identity of its `Arc`, which it holds, so the address cannot be
/// reused for another descriptor; a segment mounted again gets a new `Arc`, hence a new entry.
/// At most [`Descriptors::KEPT`] are kept (the set starts over when full).
#[derive(Default)]
pub(crate) struct Descriptors(Vec<(Arc<SegmentDesc>, Vec<u8>)>);

impl Descriptors {
    /// A pool has a few segments per store; a scan of this many beats a map.
    const KEPT: usize = 64;

    fn encoded(&mut self, desc: &Arc<SegmentDesc>) -> &[u8] {
        let at = match self.0.iter().position(|(d, _)| Arc::ptr_eq(d, desc)) {
            Some(at) => at,
            None => {
                if self.0.len() >= Self::KEPT {
                    self.0.clear();
                }
                let bytes = pb::SegmentDescriptor::from(&**desc).encode_to_vec();
                self.0.push((desc.clone(), bytes));
                self.0.len() - 1
            }
        };
        &self.0[at].1
    }
}

fn kind(r: &ReplicaView) -> u64 {
    if r.disk {
        pb::ReplicaKind::LocalDisk as u64
    } else {
        pb::ReplicaKind::Memory as u64
    }
}

/// A field's key and varint value, skipped at 0 as proto3 (and prost) skip defaults (and at
/// tag 0, a field the message does not have).
fn varint_len(tag: u32, v: u64) -> usize {
    if v == 0 || tag == 0 {
        0
    } else {
        prost::encoding::key_len(tag) + encoded_len_varint(v)
    }
}

fn put_varint(tag: u32, v: u64, out: &mut Vec<u8>) {
    if v != 0 && tag != 0 {
        encode_key(tag, WireType::Varint, out);
        encode_varint(v, out);
    }
}

fn bytes_len(tag: u32, b: &[u8]) -> usize {
    if b.is_empty() {
        0
    } else {
        prost::encoding::key_len(tag) + encoded_len_varint(b.len() as u64) + b.len()
    }
}

/// A length-delimited field; `always` writes it even when empty (a present sub-message).
fn put_bytes(tag: u32, b: &[u8], always: bool, out: &mut Vec<u8>) {
    if always || !b.is_empty() {
        encode_key(tag, WireType::LengthDelimited, out);
        encode_varint(b.len() as u64, out);
        out.extend_from_slice(b);
    }
}

fn capability(r: &ReplicaView) -> &[u8] {
    r.capability.as_ref().map_or(&[], |c| c.as_bytes())
}

fn replica_len(r: &ReplicaView, segments: &mut Descriptors) -> usize {
    let desc = segments.encoded(&r.segment).len();
    // The segment is a present sub-message: written even if it encoded to nothing.
    1 + encoded_len_varint(desc as u64)
        + desc
        + varint_len(2, r.offset)
        + varint_len(3, r.size)
        + varint_len(4, kind(r))
        + bytes_len(5, capability(r))
}

fn answer_len(r: &Result<Shape<'_>, &OpError>, segments: &mut Descriptors) -> usize {
    match r {
        Ok(s) => {
            let replicas: usize = s
                .replicas
                .iter()
                .map(|v| {
                    let n = replica_len(v, segments);
                    prost::encoding::key_len(s.replicas_tag) + encoded_len_varint(n as u64) + n
                })
                .sum();
            s.head.iter().map(|&(t, v)| varint_len(t, v)).sum::<usize>()
                + replicas
                + varint_len(s.tail.0, s.tail.1)
        }
        Err(e) => varint_len(1, code(e)) + bytes_len(2, e.message.as_bytes()),
    }
}

fn encode_answer(r: &Result<Shape<'_>, &OpError>, segments: &mut Descriptors, out: &mut Vec<u8>) {
    match r {
        Ok(s) => {
            for &(t, v) in &s.head {
                put_varint(t, v, out);
            }
            for v in s.replicas {
                let n = replica_len(v, segments);
                encode_key(s.replicas_tag, WireType::LengthDelimited, out);
                encode_varint(n as u64, out);
                put_bytes(1, segments.encoded(&v.segment), true, out);
                put_varint(2, v.offset, out);
                put_varint(3, v.size, out);
                put_varint(4, kind(v), out);
                put_bytes(5, capability(v), false, out);
            }
            put_varint(s.tail.0, s.tail.1, out);
        }
        Err(e) => {
            put_varint(1, code(e), out);
            put_bytes(2, e.message.as_bytes(), false, out);
        }
    }
}

/// An int32 field on the wire: a negative value is sign-extended to ten bytes.
fn code(e: &OpError) -> u64 {
    i64::from(e.code.as_i32()) as u64
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use lunakv_proto::ErrorCode;

    use super::*;

    fn desc(name: &str) -> Arc<SegmentDesc> {
        Arc::new(SegmentDesc {
            name: name.into(),
            transfer_endpoint: format!("{name}:17000"),
            size: 1 << 30,
            host_id: "boot-1".into(),
            shm_socket: "/run/lunakv/a.sock".into(),
            protocol: "tcp".into(),
            enable_offload: true,
            disk_capacity: 7 << 20,
            instance_id: "i-1".into(),
            requested_protocol: "rdma".into(),
            protocol_reason: "no RDMA device".into(),
            data_secret: None,
        })
    }

    fn replica(seg: &Arc<SegmentDesc>, offset: u64, disk: bool, cap: bool) -> ReplicaView {
        let capability = cap.then(|| {
            let secret = lunakv_transfer::MountSecret::from_slice(&[9; 32]).expect("secret");
            let g = lunakv_transfer::Grant {
                segment: &seg.name,
                generation: 3,
                offset,
                len: 64,
            };
            lunakv_transfer::Capability::issue(&secret, &g, 1, Duration::from_secs(5))
        });
        ReplicaView {
            segment: seg.clone(),
            offset,
            size: 64,
            disk,
            capability,
        }
    }

    /// What the gRPC handlers send for the same results.
    fn by_prost(results: Vec<Result<Location, OpError>>) -> Vec<u8> {
        pb::BatchObjectLocations {
            results: results
                .into_iter()
                .map(crate::rpc::convert::location)
                .collect(),
        }
        .encode_to_vec()
    }

    #[test]
    fn the_bytes_are_prosts() {
        let (a, b) = (desc("a:1"), desc("b:1"));
        let mut bare = (*desc("")).clone();
        bare.name = String::new();
        bare.transfer_endpoint = String::new();
        bare.size = 0;
        bare.host_id = String::new();
        bare.shm_socket = String::new();
        bare.protocol = String::new();
        bare.enable_offload = false;
        bare.disk_capacity = 0;
        bare.instance_id = String::new();
        bare.requested_protocol = String::new();
        bare.protocol_reason = String::new();
        let bare = Arc::new(bare);
        let loc = |generation, replicas| Location {
            generation,
            size: 64,
            replicas,
            lease_ttl: Duration::from_millis(5000),
        };
        let results = vec![
            Ok(loc(1, vec![replica(&a, 0, false, false)])),
            Err(OpError::new(ErrorCode::ObjectNotFound, "k: not found")),
            Ok(loc(
                u64::MAX,
                vec![
                    replica(&a, 1 << 40, false, true),
                    replica(&b, 0, true, false),
                    replica(&a, 128, false, true),
                ],
            )),
            Ok(loc(0, vec![])),
            Ok(Location {
                generation: 2,
                size: 0,
                replicas: vec![replica(&bare, 0, false, false)],
                lease_ttl: Duration::ZERO,
            }),
            Err(OpError::new(ErrorCode::InvalidKey, "")),
        ];
        let mut mine = Vec::new();
        encode_batch(&results, &mut Descriptors::default(), &mut mine);
        assert_eq!(mine, by_prost(results.clone()));
        let back = pb::BatchObjectLocations::decode(&mine[..]).expect("decodes");
        assert_eq!(back.results.len(), results.len());
        assert_eq!(
            back.results[2].replicas[1]
                .segment
                .as_ref()
                .expect("seg")
                .name,
            "b:1"
        );
        assert_eq!(back.results[1].code, ErrorCode::ObjectNotFound.as_i32());

        let mut empty = Vec::new();
        encode_batch(&[], &mut Descriptors::default(), &mut empty);
        assert_eq!(empty, by_prost(vec![]));
    }

    #[test]
    fn put_starts_are_prosts_too() {
        let (a, b) = (desc("a:1"), desc("b:1"));
        let results: Vec<Result<Placed, OpError>> = vec![
            Ok((
                7,
                vec![replica(&a, 64, false, true), replica(&b, 0, false, true)],
            )),
            Err(OpError::new(
                ErrorCode::NoAvailableHandle,
                "no segment has room",
            )),
            Ok((8, vec![])),
            Ok((0, vec![replica(&b, 1 << 33, false, false)])),
        ];
        let mut mine = Vec::new();
        encode_put_starts(&results, &mut Descriptors::default(), &mut mine);
        let theirs = pb::BatchPutStartResponse {
            results: results
                .into_iter()
                .map(crate::rpc::convert::put_start)
                .collect(),
        }
        .encode_to_vec();
        assert_eq!(mine, theirs);
    }

    #[test]
    fn each_segment_is_encoded_once_per_connection() {
        let a = desc("a:1");
        let batch = |seg: &Arc<SegmentDesc>| -> Vec<Result<Location, OpError>> {
            (0..32)
                .map(|i| {
                    Ok(Location {
                        generation: i,
                        size: 64,
                        replicas: vec![replica(seg, i * 64, false, false)],
                        lease_ttl: Duration::from_secs(5),
                    })
                })
                .collect()
        };
        let mut segments = Descriptors::default();
        for _ in 0..3 {
            let results = batch(&a);
            let mut mine = Vec::new();
            encode_batch(&results, &mut segments, &mut mine);
            assert_eq!(mine, by_prost(results));
            assert_eq!(
                segments.0.len(),
                1,
                "one entry for a segment met in every batch"
            );
        }

        // The same segment mounted again has a new descriptor: its answers carry the new one.
        let mut remounted = (*a).clone();
        remounted.transfer_endpoint = "a:1:17001".into();
        let remounted = Arc::new(remounted);
        let results = batch(&remounted);
        let mut mine = Vec::new();
        encode_batch(&results, &mut segments, &mut mine);
        assert_eq!(mine, by_prost(results));
        let back = pb::BatchObjectLocations::decode(&mine[..]).expect("decodes");
        let endpoint = &back.results[0].replicas[0].segment.as_ref().expect("seg");
        assert_eq!(endpoint.transfer_endpoint, "a:1:17001");

        // Bounded: a connection that meets many segments keeps at most KEPT of them.
        for i in 0..3 * Descriptors::KEPT {
            let d = desc(&format!("s{i}:1"));
            let results = vec![Ok(Location {
                generation: 1,
                size: 64,
                replicas: vec![replica(&d, 0, false, false)],
                lease_ttl: Duration::from_secs(5),
            })];
            let mut mine = Vec::new();
            encode_batch(&results, &mut segments, &mut mine);
            assert_eq!(mine, by_prost(results));
            assert!(segments.0.len() <= Descriptors::KEPT);
        }
    }
}
