//! User-facing messages that more than one crate prints or checks: one constant each, so the
//! service, the tools that explain it and the tests that pin it cannot drift apart.

/// Why a tenant other than upstream's `"default"` is refused, wherever upstream's `tenant_id`
/// arrives: `lunakv-store --tenant_id`, and the Python `setup(tenant_id=...)` that vLLM calls
/// when mooncake_config.json names a tenant. lunakv has one key namespace, so accepting the
/// tenant would silently mix its keys with everyone else's.
pub const TENANT_REFUSAL: &str = "lunakv has no tenant namespaces yet, so this tenant's keys would mix with every other's; remove tenant_id (from mooncake_config.json or the command line) or set it to \"default\"";

/// The master's cross-instance rule for a flagged namespace (vLLM instances that never share a
/// block): its metric help text, `lunakv doctor`'s line, and the tests of both.
pub const UNSHARED_NAMESPACE: &str =
    "instances never share a block: PYTHONHASHSEED or hash algorithm differs";
