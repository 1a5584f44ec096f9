//! The parts of an etcd transaction both the client and the store build: compares on a key's
//! version, value or lease, and put / delete / get operations.

use super::pb;
use super::pb::KeyValue;
use super::pb::compare::{CompareResult, CompareTarget, TargetUnion};
use super::pb::request_op::Request as Op;
use super::pb::response_op::Response as OpResp;

pub(super) fn cmp_version(key: &[u8], version: i64) -> pb::Compare {
    pb::Compare {
        result: CompareResult::Equal as i32,
        target: CompareTarget::Version as i32,
        key: key.to_vec(),
        target_union: Some(TargetUnion::Version(version)),
        range_end: Vec::new(),
    }
}

pub(super) fn cmp_value(key: &[u8], value: &[u8]) -> pb::Compare {
    pb::Compare {
        result: CompareResult::Equal as i32,
        target: CompareTarget::Value as i32,
        key: key.to_vec(),
        target_union: Some(TargetUnion::Value(value.to_vec())),
        range_end: Vec::new(),
    }
}

/// `key` is attached to `lease` (the fence: only the holder of the leader key's lease writes).
pub fn cmp_lease(key: &[u8], lease: i64) -> pb::Compare {
    pb::Compare {
        result: CompareResult::Equal as i32,
        target: CompareTarget::Lease as i32,
        key: key.to_vec(),
        target_union: Some(TargetUnion::Lease(lease)),
        range_end: Vec::new(),
    }
}

pub(super) fn op_put(key: &[u8], value: &[u8], lease: i64) -> pb::RequestOp {
    pb::RequestOp {
        request: Some(Op::RequestPut(pb::PutRequest {
            key: key.to_vec(),
            value: value.to_vec(),
            lease,
            ..Default::default()
        })),
    }
}

pub(super) fn op_delete(key: &[u8]) -> pb::RequestOp {
    pb::RequestOp {
        request: Some(Op::RequestDeleteRange(pb::DeleteRangeRequest {
            key: key.to_vec(),
            ..Default::default()
        })),
    }
}

pub(super) fn op_get(key: &[u8]) -> pb::RequestOp {
    pb::RequestOp {
        request: Some(Op::RequestRange(pb::RangeRequest {
            key: key.to_vec(),
            ..Default::default()
        })),
    }
}

pub(super) fn first_kv(responses: Vec<pb::ResponseOp>) -> Option<KeyValue> {
    responses.into_iter().find_map(|r| match r.response {
        Some(OpResp::ResponseRange(rr)) => rr.kvs.into_iter().next(),
        _ => None,
    })
}
