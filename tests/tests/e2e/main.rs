//! lunakv's end-to-end tests, one module per area, in one test binary: each test starts the
//! real binaries (or a real etcd, Prometheus, kubectl) on loopback. One binary rather than one
//! per file because a debug link of this crate is hundreds of megabytes: 29 of them took over
//! 6 GB of disk and most of CI's link time. One area: `cargo test -p lunakv-tests --test e2e
//! <module>::`.

mod abuse_pool;
mod admin_routes;
mod bench_device;
mod bootstrap_etcd;
mod bootstrap_service;
mod cli;
mod dashboards;
mod data_caps;
mod doctor;
mod drain;
mod etcd_security;
mod ha;
mod ha_warm;
mod k8s_overlays;
mod kv_events_ha;
mod logs;
mod master_auth;
mod metrics_lint;
mod mtls;
mod offload;
mod otel;
mod pd_bench;
mod pd_sidecar;
mod pd_tls;
mod prometheus_config;
mod quick_calls;
mod startup_order;
mod store_faults;
mod store_roundtrip;
mod trace_replay;
mod upstream_flags;
mod wrong_bytes;
