//! # lunakv-master
//!
//! The master of a lunakv pool (upstream: `mooncake_master`): placement and metadata, never
//! bytes. It serves `proto/lunakv/master.proto` over gRPC (default :50051) and an admin +
//! Prometheus HTTP listener (default :9003). Used by the `lunakv-master` binary, and by tests
//! and tools that start a master in-process.
//!
//! # Layout
//! Grouped by what each part serves: the two ports (RPC, admin), high availability, the core
//! both ports call, and what the core uses.
//! - [`rpc`]: the RPC port, both transports of the master's calls.
//!   - [`rpc::service`]: the tonic service and the gate every call passes (HA lease, rebuild).
//!   - [`rpc::convert`]: prost <-> domain conversions, the error -> `Status` mapping.
//!   - `rpc::quick`, `rpc::lanes`: quick calls on the same port, and the threads that serve
//!     plaintext quick connections.
//!   - `rpc::incoming`: sorts the port's connections (TLS, gRPC, quick calls, foreign clients).
//! - [`admin`]: the admin + Prometheus HTTP port: `/metrics`, `/health`, upstream's listings,
//!   `/namespaces`, drain jobs, the tenant quota API.
//!   - [`admin::routes`]: the router and its handlers; `admin::upstream`: upstream's listings,
//!     `remove_all` and drain jobs; `admin::state`: what every handler reads.
//!   - [`admin::tenants`]: the tenant quota policy file (`--enable_multi_tenants`).
//!   - [`admin::tls`]: HTTPS on the admin port (`LUNAKV_ADMIN_TLS=1`).
//! - [`auth`]: the one check of every call on both ports (tokens, TLS, the caller's identity).
//! - [`ha`]: `--enable_ha` and the rebuild after a takeover or restart.
//!   - [`ha::election`]: leader election on etcd, the lease-based write fence, redirects.
//!   - [`ha::recovery`]: the rebuild window, until every recorded segment remounted.
//!   - [`ha::standby`]: the warm standby's copy of the leader's index (`ReplicateIndex`).
//!   - [`ha::metrics`]: the HA metrics, which outlive each term's core.
//! - [`slot`]: [`slot::CoreSlot`], the current core every request goes through.
//! - [`server`]: wiring, listeners, background tasks, graceful drain.
//! - [`core`]: segment registry, object index, leases, pins, eviction, zombie puts, liveness.
//!   Pure logic, unit-tested without gRPC.
//! - [`events`]: pool KV events on ZMQ, Mooncake's and vLLM's formats.
//! - [`alloc`]: the best-fit offset allocator, one per segment.
//! - [`notifier`]: how frees reach a segment's owner before a range is reused.
//! - [`namespaces`]: cross-instance key consistency per vLLM key namespace (`lunakv doctor`).
//! - [`metrics`]: the master's Prometheus metrics, under Mooncake's names.
//! - [`persist`]: what survives a restart (epoch, cluster id, segment endpoints) in a
//!   [`lunakv_meta::MetaStore`]; the object index is rebuilt from owners' inventories.
//!
//! # Starting one in a test
//! ```no_run
//! # async fn demo() -> Result<(), lunakv_master::ServeError> {
//! let mut cfg = lunakv_master::MasterConfig::default();
//! cfg.rpc_port = 0;
//! cfg.metrics_port = 0;
//! cfg.data_dir = "/tmp/some-test-dir".into();
//! let m = lunakv_master::start(cfg).await?;
//! // m.rpc_url() for MasterClient::connect; m.admin_addr for HTTP.
//! m.shutdown().await
//! # }
//! ```
//! Once bound, the master prints one line on stdout that harnesses of the binary can parse:
//! `lunakv-master listening rpc=127.0.0.1:PORT admin=127.0.0.1:PORT`.
#![forbid(unsafe_code)]

pub mod admin;
pub mod alloc;
pub mod auth;
pub mod core;
pub mod events;
pub mod ha;
pub mod metrics;
pub mod namespaces;
pub mod notifier;
pub mod persist;
pub mod rpc;
pub mod server;
pub mod slot;

pub use lunakv_config::master::{MasterConfig, MasterConfigSources};
pub use server::{Listeners, Master, RunningMaster, ServeError, serve, start, start_master};
