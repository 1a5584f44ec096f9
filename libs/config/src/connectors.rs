//! Does a routing sidecar's `--kv-connector` match the connector its engines run?
//!
//! llm-d's router (and `lunakv-sidecar`) accepts only fixed connector names (`nixlv2`,
//! `shared-storage`, `mooncake`, ...); each drives one vLLM connector, which the engine must run
//! either as its top-level `kv_connector` or nested in a `MultiConnector`'s
//! `kv_connector_extra_config.connectors`. A mismatch does not fail at startup: P/D silently
//! breaks. One implementation serves `lunakv doctor` and the Kubernetes overlay test.
//!
//! The same two also check a vLLM bug that P/D with the shared store runs into:
//! [`vllm_stats_risk`] (vLLM #43828, MultiConnector with MooncakeConnector and stats on).

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

/// vLLM #43828: `MultiConnector.build_prom_metrics` registers only the children that have
/// Prometheus metrics, but `MultiKVConnectorPromMetrics.observe` asserts that every child which
/// reported transfer stats is registered. `MooncakeConnector` reports stats and has no
/// Prometheus metrics, so a MultiConnector running it (next to MooncakeStoreConnector, the XpYd
/// composition) kills the API server at the first successful transfer, unless vLLM's stats are
/// off (`--disable-log-stats`). The fix is vLLM PR #43836.
pub const VLLM_STATS_ISSUE: &str = "vLLM issue #43828";
/// The vLLM change that removes the assertion.
pub const VLLM_STATS_FIX: &str = "vLLM PR #43836";
/// The first vLLM release that contains [`VLLM_STATS_FIX`]. `None`: none did when this was
/// written (the PR was open and vLLM's main branch still asserted), so every version counts as
/// affected. Set it when a release ships the fix.
pub const VLLM_STATS_FIXED_IN: Option<VllmVersion> = None;

/// A vLLM version, `major.minor.patch` (`v0.11.0`, `0.32.0rc1`, `0.11.1.dev12+gabc` parse; the
/// pre-release and local parts are ignored).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct VllmVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl std::str::FromStr for VllmVersion {
    type Err = VllmArgsError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || VllmArgsError::Version(s.to_string());
        let t = s.trim().trim_start_matches(['v', 'V']);
        let mut nums = t.split('.').map(|p| {
            let digits: String = p.chars().take_while(char::is_ascii_digit).collect();
            digits.parse::<u32>().ok()
        });
        let major = nums.next().flatten().ok_or_else(bad)?;
        let minor = nums.next().flatten().ok_or_else(bad)?;
        let patch = nums.next().flatten().unwrap_or(0);
        Ok(VllmVersion {
            major,
            minor,
            patch,
        })
    }
}

impl std::fmt::Display for VllmVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Why a vLLM command line or version could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VllmArgsError {
    #[error(
        "--kv-transfer-config in the vLLM arguments is not JSON ({reason}): {value}; give the \
         engine's value with its double quotes, e.g. --kv-transfer-config='{{\"kv_connector\": ...}}'"
    )]
    KvTransferConfig { value: String, reason: String },
    #[error("'{0}' is not a vLLM version: give it as X.Y.Z (what `vllm --version` prints)")]
    Version(String),
}

/// What lunakv reads from a `vllm serve` command line.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VllmArgs {
    /// `--kv-transfer-config` (or `--kv_transfer_config`), parsed.
    pub kv_transfer_config: Option<Value>,
    /// `--disable-log-stats` is given.
    pub stats_disabled: bool,
}

/// Reads a `vllm serve` command line given as one string: as `ps` shows it, as a pod spec's
/// args list reads, or as typed with the JSON in single quotes. Words are split at whitespace;
/// the `--kv-transfer-config` value is joined back over the spaces inside it (a folded YAML
/// scalar has them) until it parses, and one pair of single quotes around it is dropped.
pub fn parse_vllm_args(line: &str) -> Result<VllmArgs, VllmArgsError> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let mut out = VllmArgs::default();
    let mut i = 0;
    while i < words.len() {
        let w = words[i].trim_matches('\'');
        i += 1;
        if w == "--disable-log-stats" || w == "--disable_log_stats" {
            out.stats_disabled = true;
            continue;
        }
        let value = ["--kv-transfer-config", "--kv_transfer_config"]
            .iter()
            .find_map(|f| {
                if let Some(v) = words[i - 1].strip_prefix(&format!("{f}=")) {
                    Some(v.to_string())
                } else if w == *f {
                    let v = words.get(i).map(|v| v.to_string());
                    i += 1;
                    v
                } else {
                    None
                }
            });
        let Some(mut value) = value else { continue };
        let parsed = loop {
            let unquoted = value
                .strip_prefix('\'')
                .and_then(|v| v.strip_suffix('\''))
                .unwrap_or(&value);
            match serde_json::from_str::<Value>(unquoted) {
                Ok(v) => break v,
                Err(e) if i >= words.len() || words[i].starts_with("--") => {
                    return Err(VllmArgsError::KvTransferConfig {
                        value,
                        reason: e.to_string(),
                    });
                }
                Err(_) => {
                    value.push(' ');
                    value.push_str(words[i]);
                    i += 1;
                }
            }
        };
        out.kv_transfer_config = Some(parsed);
    }
    Ok(out)
}

/// Whether `kv_transfer_config` is a MultiConnector with MooncakeConnector among its children
/// (the composition [`VLLM_STATS_ISSUE`] affects).
pub fn multi_runs_mooncake(kv_transfer_config: &Value) -> bool {
    let top = kv_transfer_config
        .get("kv_connector")
        .and_then(Value::as_str);
    if top != Some("MultiConnector") {
        return false;
    }
    kv_transfer_config
        .pointer("/kv_connector_extra_config/connectors")
        .and_then(Value::as_array)
        .is_some_and(|nested| {
            nested
                .iter()
                .any(|n| engine_connectors(n).contains("MooncakeConnector"))
        })
}

/// What [`vllm_stats_risk`] concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StatsRisk {
    /// The engine does not run MooncakeConnector inside a MultiConnector.
    NotAffected,
    /// Affected composition, but stats are off (`--disable-log-stats`).
    Avoided,
    /// Affected composition on a vLLM that has the fix.
    Fixed(VllmVersion),
    /// The API server dies at the first successful transfer. `version`: the engine's, when known.
    Crashes { version: Option<VllmVersion> },
    /// Affected composition; whether stats are on is unknown (no command line to look at).
    Unknown,
}

/// Does an engine with `kv_transfer_config` crash on [`VLLM_STATS_ISSUE`]? `stats_disabled` is
/// `None` when its command line is not known; `version` when its vLLM version is not.
pub fn vllm_stats_risk(
    kv_transfer_config: &Value,
    stats_disabled: Option<bool>,
    version: Option<VllmVersion>,
) -> StatsRisk {
    if !multi_runs_mooncake(kv_transfer_config) {
        return StatsRisk::NotAffected;
    }
    if let (Some(v), Some(fixed)) = (version, VLLM_STATS_FIXED_IN)
        && v >= fixed
    {
        return StatsRisk::Fixed(v);
    }
    match stats_disabled {
        Some(true) => StatsRisk::Avoided,
        Some(false) => StatsRisk::Crashes { version },
        None => StatsRisk::Unknown,
    }
}

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

    #[test]
    fn vllm_args_in_the_forms_operators_paste_them() {
        let multi = json!({"kv_connector": "MultiConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"connectors": [
                {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"},
                {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}]}});
        // Shell-quoted, as in a terminal (the JSON has no spaces, so no joining either).
        let a = parse_vllm_args(&format!(
            "vllm serve Qwen/Qwen3-0.6B --port=8000 --kv-transfer-config '{multi}'"
        ))
        .expect("parses");
        assert_eq!(a.kv_transfer_config.as_ref(), Some(&multi));
        assert!(!a.stats_disabled);
        // `=` form with the folded YAML's spaces and no quotes, plus the flag.
        let a = parse_vllm_args(
            r#"--disable-log-stats --kv-transfer-config={"kv_connector":"MultiConnector", "kv_connector_extra_config":{"connectors":[ {"kv_connector":"MooncakeConnector"}]}} --port=8200"#,
        )
        .expect("parses");
        assert!(a.stats_disabled);
        assert!(multi_runs_mooncake(
            a.kv_transfer_config.as_ref().expect("kv")
        ));
        assert!(
            parse_vllm_args("--port=1")
                .expect("parses")
                .kv_transfer_config
                .is_none()
        );
        assert!(matches!(
            parse_vllm_args("--kv-transfer-config={nope --port=1"),
            Err(VllmArgsError::KvTransferConfig { .. })
        ));
        // Single quotes around the value, as typed in a shell.
        let a = parse_vllm_args("--kv-transfer-config='{\"kv_connector\": \"MooncakeConnector\"}'")
            .expect("parses");
        assert_eq!(
            a.kv_transfer_config,
            Some(json!({"kv_connector": "MooncakeConnector"}))
        );
    }

    #[test]
    fn versions() {
        let v = |s: &str| s.parse::<VllmVersion>().expect(s);
        assert_eq!(v("v0.11.0").to_string(), "0.11.0");
        assert_eq!(v("0.32.0rc1"), v("0.32.0"));
        assert_eq!(v("0.11.1.dev12+gabc").to_string(), "0.11.1");
        assert!(v("0.32.0") > v("0.9.2"));
        assert!("latest".parse::<VllmVersion>().is_err());
    }

    #[test]
    fn the_stats_crash_needs_multiconnector_with_mooncake_and_stats_on() {
        let multi = json!({"kv_connector": "MultiConnector",
            "kv_connector_extra_config": {"connectors": [
                {"kv_connector": "MooncakeConnector"},
                {"kv_connector": "MooncakeStoreConnector"}]}});
        let store_only = json!({"kv_connector": "MultiConnector",
            "kv_connector_extra_config": {"connectors": [
                {"kv_connector": "MooncakeStoreConnector"}]}});
        let plain = json!({"kv_connector": "MooncakeConnector"});
        let v32 = Some(VllmVersion {
            major: 0,
            minor: 32,
            patch: 0,
        });
        assert_eq!(
            vllm_stats_risk(&multi, Some(false), v32),
            StatsRisk::Crashes { version: v32 }
        );
        assert_eq!(vllm_stats_risk(&multi, Some(true), v32), StatsRisk::Avoided);
        assert_eq!(vllm_stats_risk(&multi, None, None), StatsRisk::Unknown);
        assert_eq!(
            vllm_stats_risk(&store_only, Some(false), v32),
            StatsRisk::NotAffected
        );
        // A MooncakeConnector on its own has no MultiConnector to assert.
        assert_eq!(
            vllm_stats_risk(&plain, Some(false), v32),
            StatsRisk::NotAffected
        );
        // No release is known to have the fix: a very new version is still affected.
        let future = Some(VllmVersion {
            major: 9,
            minor: 0,
            patch: 0,
        });
        assert_eq!(VLLM_STATS_FIXED_IN, None);
        assert!(matches!(
            vllm_stats_risk(&multi, Some(false), future),
            StatsRisk::Crashes { .. }
        ));
    }
}
