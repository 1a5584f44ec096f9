//! User-facing messages that more than one crate prints or checks: one constant each, so the
//! service, the tools that explain it and the tests that pin it cannot drift apart.

/// Why `lunakv-store --tenant_id` takes only upstream's `"default"`: a store-client's segment
/// holds every tenant's objects, and in lunakv each engine names its own tenant (the Python
/// `setup(tenant_id=...)` that vLLM and SGLang call from their Mooncake config), so a tenant on
/// the store-client would have nothing to apply to.
pub const TENANT_REFUSAL: &str = "a lunakv-store segment holds every tenant's objects and each engine names its own tenant, so tenant_id here would be ignored; set tenant_id in the engine's mooncake_config.json (or setup(tenant_id=...)) and remove it from the lunakv-store command line";

/// The master's cross-instance rule for a flagged namespace (vLLM instances that never share a
/// block): its metric help text, `lunakv doctor`'s line, and the tests of both.
pub const UNSHARED_NAMESPACE: &str =
    "instances never share a block: PYTHONHASHSEED or hash algorithm differs";
