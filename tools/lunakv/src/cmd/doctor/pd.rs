//! The P/D checks: the bootstrap server answers, the sidecar's and vLLM's connector settings
//! agree, and vLLM's own stats show the store in use.

use super::check::Check;
use super::http::http_get;
use crate::args::DoctorArgs;

pub(super) fn check_bootstrap(a: &DoctorArgs) -> Check {
    const NAME: &str = "bootstrap";
    let Some(b) = &a.bootstrap else {
        return Check::skip(NAME, "no --bootstrap HOST:PORT given");
    };
    let addr = b
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let (code, body) = match http_get(&addr, "/query") {
        Ok(r) => r,
        Err(e) => {
            return Check::fail(
                NAME,
                format!("bootstrap {addr} does not answer GET /query: {e}"),
                "start lunakv-bootstrap (or the prefill's MooncakeConnector bootstrap) on \
                 VLLM_MOONCAKE_BOOTSTRAP_PORT (default 8998), and check --bootstrap",
            );
        }
    };
    if code != 200 {
        return Check::fail(
            NAME,
            format!(
                "bootstrap {addr} answered GET /query with HTTP {code}: {}",
                body.trim()
            ),
            "point --bootstrap at a vLLM-compatible bootstrap (lunakv-bootstrap's HTTP port)",
        );
    }
    let engines = match serde_json::from_str::<serde_json::Value>(&body) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => {
            return Check::fail(
                NAME,
                format!(
                    "bootstrap {addr} answered GET /query with something other than a JSON object: {}",
                    body.trim()
                ),
                "point --bootstrap at a vLLM-compatible bootstrap (lunakv-bootstrap's HTTP port)",
            );
        }
    };
    if engines.is_empty() {
        return Check::fail(
            NAME,
            format!("bootstrap {addr} is up but lists no engine"),
            "start the prefill engines with MooncakeConnector (kv_role kv_producer) registering \
             with this bootstrap, and check that their leases are renewed",
        );
    }
    let ids: Vec<String> = engines
        .iter()
        .map(|(dp, v)| {
            let id = v
                .get("engine_id")
                .and_then(serde_json::Value::as_str)
                .unwrap_or("?");
            format!("dp {dp}: {id}")
        })
        .collect();
    Check::pass(
        NAME,
        format!(
            "bootstrap {addr} lists {} engine(s): {}",
            ids.len(),
            ids.join(", ")
        ),
    )
}

pub(super) fn check_connectors(a: &DoctorArgs) -> Check {
    const NAME: &str = "connectors";
    let (sidecar, kv) = match (&a.sidecar_args, &a.kv_transfer_config) {
        (Some(s), Some(k)) => (s, k),
        (None, None) => {
            return Check::skip(NAME, "no --sidecar-args and --kv-transfer-config given");
        }
        (Some(_), None) => {
            return Check::skip(NAME, "--sidecar-args given without --kv-transfer-config");
        }
        (None, Some(_)) => {
            return Check::skip(NAME, "--kv-transfer-config given without --sidecar-args");
        }
    };
    let kv: serde_json::Value = match serde_json::from_str(kv) {
        Ok(v) => v,
        Err(e) => {
            return Check::fail(
                NAME,
                format!("--kv-transfer-config is not JSON ({e}): {kv}"),
                "pass the engine's --kv-transfer-config value exactly, e.g. \
                 '{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":\"kv_consumer\"}'",
            );
        }
    };
    let args: Vec<String> = sidecar
        .split_whitespace()
        .map(|t| t.trim_matches(|c| c == '"' || c == '\'').to_string())
        .collect();
    let sc = lunakv_config::connectors::sidecar_kv_connector(&args);
    match lunakv_config::connectors::connector_matches(&sc, &kv) {
        Ok(()) => Check::pass(
            NAME,
            format!(
                "sidecar --kv-connector={sc} matches the engine's {:?}",
                lunakv_config::connectors::engine_connectors(&kv)
            ),
        ),
        Err(e) => Check::fail(
            NAME,
            format!("sidecar --kv-connector={sc} does not match the engine's kv-transfer-config"),
            e.to_string(),
        ),
    }
}

/// vLLM #43828: a MultiConnector running MooncakeConnector kills the API server at its first
/// successful transfer unless vLLM's stats are off. The rule is `lunakv_config::connectors`'s,
/// shared with the Kubernetes overlay test.
pub(super) fn check_vllm_stats(a: &DoctorArgs) -> Check {
    use lunakv_config::connectors::{
        StatsRisk, VLLM_STATS_FIX, VLLM_STATS_ISSUE, VllmVersion, parse_vllm_args, vllm_stats_risk,
    };
    const NAME: &str = "vllm_stats";
    let input_fix = "pass the engine's `vllm serve` arguments as one string, e.g. \
                     --vllm-args \"$(ps -o args= -p <vllm pid>)\"";
    let args = match a.vllm_args.as_deref().map(parse_vllm_args) {
        None => None,
        Some(Ok(v)) => Some(v),
        Some(Err(e)) => return Check::fail(NAME, format!("--vllm-args: {e}"), input_fix),
    };
    let version = match a.vllm_version.as_deref().map(str::parse::<VllmVersion>) {
        None => None,
        Some(Ok(v)) => Some(v),
        Some(Err(e)) => {
            return Check::fail(
                NAME,
                format!("--vllm-version: {e}"),
                "pass what `vllm --version` prints",
            );
        }
    };
    // The engine's connectors: from its command line, else from --kv-transfer-config (whose
    // JSON errors the connectors row reports).
    let kv = args
        .as_ref()
        .and_then(|a| a.kv_transfer_config.clone())
        .or_else(|| {
            a.kv_transfer_config
                .as_deref()
                .and_then(|k| serde_json::from_str(k).ok())
        });
    let Some(kv) = kv else {
        return Check::skip(
            NAME,
            "no --vllm-args with a --kv-transfer-config, and no valid --kv-transfer-config given",
        );
    };
    let on = version.map_or_else(
        || "vLLM (version not given: --vllm-version)".to_string(),
        |v| format!("vLLM {v}"),
    );
    match vllm_stats_risk(&kv, args.as_ref().map(|a| a.stats_disabled), version) {
        StatsRisk::NotAffected => Check::pass(
            NAME,
            format!(
                "the engine runs no MooncakeConnector inside a MultiConnector: {VLLM_STATS_ISSUE} \
                 does not apply"
            ),
        ),
        StatsRisk::Avoided => Check::pass(
            NAME,
            format!(
                "MultiConnector with MooncakeConnector on {on}, stats off (--disable-log-stats): \
                 {VLLM_STATS_ISSUE} is avoided"
            ),
        ),
        StatsRisk::Fixed(v) => Check::pass(
            NAME,
            format!("vLLM {v} contains {VLLM_STATS_FIX}: {VLLM_STATS_ISSUE} is fixed"),
        ),
        StatsRisk::Crashes { .. } => Check::warn(
            NAME,
            format!(
                "MultiConnector runs MooncakeConnector with stats on (no --disable-log-stats) \
                 on {on}: the API server dies after its first successful KV transfer \
                 ({VLLM_STATS_ISSUE}: \"AssertionError: MooncakeConnector is not contained in \
                 the list of registered connectors with Prometheus metrics support\")"
            ),
            format!(
                "add --disable-log-stats to the prefill and decode `vllm serve` arguments (the \
                 pd-mooncake overlay does), or run the vLLM release that contains \
                 {VLLM_STATS_FIX}"
            ),
        ),
        StatsRisk::Unknown => Check::skip(
            NAME,
            format!(
                "the engine runs MooncakeConnector inside a MultiConnector, which \
                 {VLLM_STATS_ISSUE} crashes unless --disable-log-stats is given: pass \
                 --vllm-args to check"
            ),
        ),
    }
}
