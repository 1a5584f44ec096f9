//! The admin and Prometheus HTTP listener (upstream's port 9003): `/metrics`, `/metrics/summary`,
//! `/health`, `/get_all_segments`, `/query_key?key=...`, and for HA `/role`, `/leader`,
//! `/ha_status` (upstream's names); lunakv's `/namespaces` (cross-instance key consistency);
//! upstream's tenant quota API, `/api/v1/tenant_quotas` (GET, PUT, DELETE; docs/TENANTS.md);
//! and upstream's `/kv_events/status`, `/get_all_keys`, `/get_segments_detail`,
//! `/query_segment`, `/batch_query_keys`, `/api/v1/segments/status`,
//! `/api/v1/remove_all` (POST) and the drain jobs (`/api/v1/drain_jobs`, `.../query`,
//! `.../cancel`) (`admin/upstream.rs`; docs/SECURITY.md lists them).
//!
//! - [`routes`]: the router, the handlers of the core's views, HA and the tenant quota API.
//! - `upstream`: upstream's listings, segment status, `remove_all` and drain jobs.
//! - `state`: what every handler reads.
//! - [`tenants`]: the tenant quota policy file the tenant API rewrites.
//! - [`tls`]: HTTPS on the admin port (`LUNAKV_ADMIN_TLS=1`), client certificates optional.

pub mod routes;
mod state;
pub mod tenants;
#[cfg(test)]
mod tests;
pub mod tls;
mod upstream;
