//! The etcd backend: a small etcd v3 client ([`EtcdClient`]: KV, transactions, leases, watches)
//! and the [`EtcdMetaStore`] built on it, which passes the same [`crate::conformance`] suite as
//! the embedded store. lunakv's masters also use the client directly for leader election, and
//! clients for following the leader key.
//!
//! Every call is bounded by the client's timeout: a tonic channel balanced over several endpoints
//! waits for a ready endpoint rather than failing, so an unbounded call against a dead etcd would
//! hang forever.
//!
//! A secured etcd ([`EtcdSecurity`]) is reached over TLS (its CA, optionally a client certificate
//! for `--client-cert-auth`) and/or as an etcd user: the client authenticates before its first
//! call, sends the token with every call, and authenticates again once when etcd says the token
//! is no longer valid (simple tokens expire after `--auth-token-ttl` of disuse).
//!
//! The client is in `client.rs`, the store in `store.rs`, and the transaction parts both
//! build (compares, operations) in `txn.rs`.

/// Generated code for `proto/etcd_v3.proto` (etcd's `etcdserverpb`, trimmed).
#[allow(clippy::all, rust_2018_idioms, missing_docs)]
pub mod pb {
    tonic::include_proto!("etcdserverpb");
}

pub use pb::KeyValue;

mod client;
mod store;
mod txn;

pub use client::{EtcdAuth, EtcdClient, EtcdSecurity, EtcdTls, EtcdWatch, WatchEvent, prefix_end};
pub use store::{EtcdMetaStore, WriteFence};
pub use txn::cmp_lease;

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn prefix_end_is_the_next_key() {
        assert_eq!(prefix_end(b"ab"), b"ac".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
        assert_eq!(prefix_end(b""), vec![0]);
    }
}
