//! # lunakv-master
//!
//! The master of a lunakv pool (upstream: `mooncake_master`): placement and metadata, never
//! bytes. It serves `proto/lunakv/master.proto` over gRPC (default :50051) and an admin +
//! Prometheus HTTP listener (default :9003). Used by the `lunakv-master` binary, and by tests
//! and tools that start a master in-process.
//!
//! # Layout
//! - [`core`]: segment registry, object index, leases, pins, eviction, zombie puts, liveness.
//!   Pure logic, unit-tested without gRPC.
//! - [`alloc`]: the best-fit offset allocator, one per segment.
//! - [`notifier`]: how frees reach a segment's owner before a range is reused.
//! - [`rpc`]: the tonic service, prost -> domain conversions, the error -> `Status` mapping.
//! - [`admin`]: `/metrics`, `/health`, `/get_all_segments`, `/query_key`, `/namespaces`.
//! - [`namespaces`]: cross-instance key consistency per vLLM key namespace (`lunakv doctor`).
//! - [`persist`]: what survives a restart (epoch, cluster id, segment endpoints) in a
//!   [`lunakv_meta::MetaStore`]; the object index is rebuilt from owners' inventories.
//! - [`server`]: wiring, listeners, background tasks, graceful drain.
//! - [`ha`]: `--enable_ha`: leader election on etcd, the lease-based write fence, redirects.
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
