//! Does a routing sidecar's `--kv-connector` match the connector its engines run?
//!
//! llm-d's router (and `lunakv-sidecar`) accepts only fixed connector names (`nixlv2`,
//! `shared-storage`, `mooncake`, ...); each drives one vLLM connector, which the engine must run
//! either as its top-level `kv_connector` or nested in a `MultiConnector`'s
//! `kv_connector_extra_config.connectors`. A mismatch does not fail at startup: P/D silently
//! breaks. One implementation serves `lunakv doctor` and the Kubernetes overlay test.

use std::collections::BTreeSet;

use serde_json::Value;

/// The vLLM connector a sidecar's `--kv-connector` value drives; `None` for names the router
/// does not accept (`MultiConnector` is not one).
pub fn sidecar_connector(kv_connector: &str) -> Option<&'static str> {
    match kv_connector {
        "mooncake" => Some("MooncakeConnector"),
        "nixlv2" => Some("NixlConnector"),
        "shared-storage" => Some("SharedStorageConnector"),
        _ => None,
    }
}

/// Every connector name a `--kv-transfer-config` runs: the top level and, for a
/// MultiConnector, each nested one (recursively).
pub fn engine_connectors(kv_transfer_config: &Value) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    if let Some(c) = kv_transfer_config
        .get("kv_connector")
        .and_then(Value::as_str)
    {
        out.insert(c.to_string());
    }
    if let Some(nested) = kv_transfer_config
        .pointer("/kv_connector_extra_config/connectors")
        .and_then(Value::as_array)
    {
        for n in nested {
            out.extend(engine_connectors(n));
        }
    }
    out
}

/// Why a sidecar and an engine do not match.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConnectorMismatch {
    #[error(
        "sidecar --kv-connector={0} is not a connector the router accepts: use mooncake, nixlv2 \
         or shared-storage"
    )]
    UnknownSidecarConnector(String),
    #[error(
        "sidecar --kv-connector={sidecar} needs the engine to run {want} (top-level or in a \
         MultiConnector), but its --kv-transfer-config runs {have:?}: add {want} to the engine's \
         kv_connector (or its MultiConnector's connectors), or change the sidecar's --kv-connector"
    )]
    EngineLacks {
        sidecar: String,
        want: &'static str,
        have: BTreeSet<String>,
    },
}

/// Does a sidecar with `--kv-connector=sidecar` match an engine running `kv_transfer_config`?
pub fn connector_matches(
    sidecar: &str,
    kv_transfer_config: &Value,
) -> Result<(), ConnectorMismatch> {
    let want = sidecar_connector(sidecar)
        .ok_or_else(|| ConnectorMismatch::UnknownSidecarConnector(sidecar.to_string()))?;
    let have = engine_connectors(kv_transfer_config);
    if have.contains(want) {
        Ok(())
    } else {
        Err(ConnectorMismatch::EngineLacks {
            sidecar: sidecar.to_string(),
            want,
            have,
        })
    }
}

/// The `--kv-connector` value in a sidecar's arguments (`--kv-connector=X` or
/// `--kv-connector X`); llm-d's default, `nixlv2`, when absent.
pub fn sidecar_kv_connector<S: AsRef<str>>(args: &[S]) -> String {
    let mut it = args.iter().map(AsRef::as_ref);
    while let Some(a) = it.next() {
        if let Some(v) = a.strip_prefix("--kv-connector=") {
            return v.to_string();
        }
        if a == "--kv-connector"
            && let Some(v) = it.next()
        {
            return v.to_string();
        }
    }
    DEFAULT_SIDECAR_CONNECTOR.to_string()
}

/// The router's `--kv-connector` default.
pub const DEFAULT_SIDECAR_CONNECTOR: &str = "nixlv2";

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn top_level_and_nested_connectors_match() {
        let top = json!({"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"});
        let nested = json!({
            "kv_connector": "MultiConnector", "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"connectors": [
                {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"},
                {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_consumer"}]}});
        let store_only = json!({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"});
        let nixl = json!({"kv_connector": "NixlConnector", "kv_role": "kv_both"});
        assert!(connector_matches("mooncake", &top).is_ok());
        assert!(connector_matches("mooncake", &nested).is_ok());
        assert!(connector_matches("mooncake", &store_only).is_err());
        assert!(connector_matches("mooncake", &nixl).is_err());
        assert!(connector_matches("nixlv2", &nixl).is_ok());
        assert!(connector_matches("nixlv2", &nested).is_err());
        assert_eq!(
            connector_matches("MultiConnector", &nested),
            Err(ConnectorMismatch::UnknownSidecarConnector(
                "MultiConnector".into()
            ))
        );
        let e = connector_matches("mooncake", &store_only).expect_err("mismatch");
        assert!(e.to_string().contains("MooncakeConnector"), "{e}");
    }

    #[test]
    fn sidecar_flag_in_both_spellings() {
        assert_eq!(
            sidecar_kv_connector(&["--port=8000", "--kv-connector=mooncake"]),
            "mooncake"
        );
        assert_eq!(
            sidecar_kv_connector(&["--kv-connector", "shared-storage"]),
            "shared-storage"
        );
        assert_eq!(sidecar_kv_connector(&["--port=8000"]), "nixlv2");
    }
}
